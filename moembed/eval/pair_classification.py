"""Pair classification: average precision of the similarity score for pairs labelled 1 (duplicate) vs 0.

MTEB reports the maximum AP over cosine, dot, Euclidean and Manhattan scores; moembed reports the AP of the
model's own similarity (cosine, or the model's `similarity`), which is what a user of the model would rank by.
Prefix: "classification" for both sentences (see sts.py).
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import average_precision_score

from moembed.eval.encoding import EmbeddingCache, View, encode, pairwise
from moembed.eval.task import Task

PROMPT = "classification"


def best_accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    """Accuracy at the best threshold on the scores (MTEB's cosine_accuracy)."""
    order = np.argsort(-scores, kind="stable")
    y = labels[order]
    pos_above = np.concatenate([[0], np.cumsum(y)])  # positives predicted positive when top-j are called positive
    neg_below = (len(y) - y.sum()) - np.concatenate([[0], np.cumsum(1 - y)])
    return float(((pos_above + neg_below) / len(y)).max())


def run_pairs(model, task: Task, view: View, cache: EmbeddingCache | None = None) -> dict[str, float]:
    rows = task.data["rows"]
    a = encode(model, [r[0] for r in rows], PROMPT, view, cache)
    b = encode(model, [r[1] for r in rows], PROMPT, view, cache)
    sims = pairwise(model, a, b)  # (n,)
    labels = np.array([r[2] for r in rows])
    return {"ap": float(average_precision_score(labels, sims)), "accuracy": best_accuracy(sims, labels)}
