"""Reranking: mean average precision (MAP) of each query's candidates ranked by similarity (MTEB Reranking).

Prefixes as in retrieval: "search_query" for the query, "search_document" for the candidates.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import average_precision_score

from moembed.eval.encoding import EmbeddingCache, View, encode, similarity
from moembed.eval.task import Task


def run_reranking(model, task: Task, view: View, cache: EmbeddingCache | None = None) -> dict[str, float]:
    rows = task.data["rows"]
    docs = [d for _, pos, neg in rows for d in pos + neg]
    q = encode(model, [r[0] for r in rows], "search_query", view, cache)
    d = encode(model, docs, "search_document", view, cache)
    aps, rrs, start = [], [], 0
    for i, (_, pos, neg) in enumerate(rows):
        n = len(pos) + len(neg)
        s = similarity(model, q[i : i + 1], d[start : start + n])[0]  # (n,)
        labels = np.array([1] * len(pos) + [0] * len(neg))
        aps.append(average_precision_score(labels, s) if neg else 1.0)
        first = np.flatnonzero(labels[np.argsort(-s, kind="stable")][:10])
        rrs.append(1.0 / (first[0] + 1) if len(first) else 0.0)
        start += n
    return {"map": float(np.mean(aps)), "mrr_at_10": float(np.mean(rrs))}
