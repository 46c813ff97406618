"""Consistency filtering (nomic-embed-v1 §4.2.1, nomic-embed-v2 §3.3.2 and §4.2, arctic-embed-2 §2.3).

A teacher embeds the queries and documents of a shard; a pair is kept when its own document ranks among the top k
documents of the shard (of its source) for its query. k = 2 in Nomic, 20 in Arctic. This module holds the
decision on embeddings; `moembed.data.curate` runs it shard by shard over a file.
"""

from __future__ import annotations

import numpy as np

from moembed.data.search import search

TIE_TOLERANCE = 1e-6  # a document tied with the k-th best counts as in the top k (FAISS and exact may order ties)


def consistency_keep(
    queries: np.ndarray, docs: np.ndarray, own: np.ndarray, top_k: int, backend: str = "auto"
) -> np.ndarray:
    """Which pairs to keep: bool (n,).

    queries: (n, d) L2-normalised query embeddings, one row per pair; docs: (m, d) L2-normalised embeddings of
    the shard's distinct documents; own: (n,) index into `docs` of each pair's document.
    """
    if len(queries) == 0:
        return np.zeros(0, bool)
    scores, idx = search(queries, docs, top_k, backend)  # (n, k) best first
    own_scores = np.einsum("nd,nd->n", queries, docs[own])  # (n,) cosine with the pair's own document
    in_top = (idx == own[:, None]).any(axis=1)
    return in_top | (own_scores >= scores[:, -1] - TIE_TOLERANCE)
