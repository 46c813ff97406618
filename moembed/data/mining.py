"""Positive-aware hard-negative mining (NV-Retriever; nomic-embed-v2 §3.3.3 and Eq. 5, arctic-embed-2 §2.4).

The teacher retrieves candidates for each query among the shard's documents (of its source). Known positives —
every document paired with the same query text — are excluded, and a candidate is dropped as a likely false
negative when its score exceeds the threshold of Eq. 5, threshold = pos_score × margin (default 0.95), or, with
`abs_margin`, pos_score − abs_margin. Up to M survivors are kept, best first, with their scores.

Eq. 5 is written for positive scores. A weak teacher (or a hard pair) can score the positive below zero, and then
pos × 0.95 lies *above* pos and would admit candidates the teacher ranks over the positive. We keep the margin's
meaning, a gap of (1 − margin) × |pos| under the positive, for either sign:

    threshold = pos − (1 − margin) · |pos|      (= pos × margin, Eq. 5, when pos ≥ 0)

so with margin ≤ 1 every accepted negative scores at most the positive.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from moembed.data.search import search


class MiningConfig(BaseModel):
    """How many negatives and how strict the false-negative filter is."""

    model_config = ConfigDict(extra="forbid")

    num_negatives: int = Field(7, ge=1)  # M; nomic-embed-v2 §7.3 finds 4 → 10 helps a little
    margin: float | None = Field(0.95, gt=0)  # Eq. 5 percentage margin; None: no relative threshold
    abs_margin: float | None = Field(None, ge=0)  # drop candidates above pos_score − abs_margin
    # candidates searched first: depth_factor × M + positives + 16, four times deeper for queries left short
    depth_factor: int = Field(4, ge=1)

    def threshold(self, pos: np.ndarray) -> np.ndarray:
        """Highest accepted negative score for each positive score (n,) → (n,)."""
        t = np.full_like(pos, np.inf)
        if self.margin is not None:
            # Eq. 5 (pos × margin) for pos ≥ 0; the same relative gap below pos when pos < 0 (module docstring)
            below = np.where(pos >= 0, pos * self.margin, pos - (1.0 - self.margin) * np.abs(pos))
            t = np.minimum(t, below)
        if self.abs_margin is not None:
            t = np.minimum(t, pos - self.abs_margin)
        return t


def mine(
    queries: np.ndarray,
    docs: np.ndarray,
    own: np.ndarray,
    positives: list[set[int]],
    cfg: MiningConfig,
    backend: str = "auto",
) -> tuple[list[list[int]], list[list[float]]]:
    """Hard negatives for each pair: (document indices, scores), best first, at most M each.

    queries: (n, d) L2-normalised, one row per pair; docs: (m, d) L2-normalised distinct documents;
    own: (n,) index of each pair's document; positives: per pair, the indices of every document paired with
    that query text (always excluded). A pair may get fewer than M negatives when the shard is small or the
    threshold removes many candidates. Queries left short are searched again, four times deeper each round.
    """
    if len(queries) == 0:
        return [], []
    pos = np.einsum("nd,nd->n", queries, docs[own])  # (n,) score of the pair's own positive
    limit = cfg.threshold(pos)
    n_pos = max(len(p) for p in positives)
    depth = cfg.depth_factor * cfg.num_negatives + n_pos + 16
    neg_idx: list[list[int]] = [[] for _ in range(len(queries))]
    neg_scores: list[list[float]] = [[] for _ in range(len(queries))]
    todo = np.arange(len(queries))
    while len(todo):
        # Search deeper only for the queries whose candidates were all above the threshold or positives.
        scores, idx = search(queries[todo], docs, depth, backend)  # (t, depth) best first
        short = []
        for row, i in enumerate(todo):
            ok = (scores[row] <= limit[i]) & ~np.isin(idx[row], list(positives[i]))
            take = np.flatnonzero(ok)[: cfg.num_negatives]
            neg_idx[i] = idx[row, take].tolist()
            neg_scores[i] = [round(float(s), 6) for s in scores[row, take]]
            if len(take) < cfg.num_negatives and depth < len(docs):
                short.append(i)
        todo, depth = np.array(short, dtype=np.int64), depth * 4
    return neg_idx, neg_scores
