"""Consistency filtering (nomic-embed-v1 §4.2.1, nomic-embed-v2 §3.3.2 and §4.2, arctic-embed-2 §2.3).

A teacher embeds the queries and documents of a shard; a pair is kept when its own document ranks among the top k
documents of the shard (of its source) for its query. k = 2 in Nomic, 20 in Arctic. This module holds the
decision on embeddings; `moembed.data.curate` runs it shard by shard over a file.
"""

from __future__ import annotations

import numpy as np

from moembed.data.search import search

TIE_TOLERANCE = 1e-6  # a document tied with the k-th best counts as in the top k (FAISS and exact may order ties)


def positive_rank(
    queries: np.ndarray, docs: np.ndarray, own: np.ndarray, top_k: int, backend: str = "auto"
) -> np.ndarray:
    """How many documents the teacher ranks above each pair's own document: int (n,), 0 = first, capped at
    `top_k` (= not in the top k). A document tied with the pair's own does not count as above it.

    queries: (n, d) L2-normalised query embeddings, one row per pair; docs: (m, d) L2-normalised embeddings of
    the shard's distinct documents; own: (n,) index into `docs` of each pair's document.
    """
    if len(queries) == 0:
        return np.zeros(0, np.int64)
    scores, idx = search(queries, docs, top_k, backend)  # (n, k) best first
    own_scores = np.einsum("nd,nd->n", queries, docs[own])  # (n,) cosine with the pair's own document
    # The search's own score for the pair's document may differ from this one in the last bits (another
    # summation order), so the pair's own document is left out by index, not by score.
    above = (scores > own_scores[:, None] + TIE_TOLERANCE) & (idx != own[:, None])
    return above.sum(axis=1)


def consistency_keep(
    queries: np.ndarray, docs: np.ndarray, own: np.ndarray, top_k: int, backend: str = "auto"
) -> np.ndarray:
    """Which pairs to keep: bool (n,), those whose own document ranks among the top k (`positive_rank` < k)."""
    return positive_rank(queries, docs, own, top_k, backend) < top_k
