"""Clustering: k-means with as many clusters as gold labels, V-measure against the labels (MTEB Clustering).

Embeddings use the "clustering" prefix and are L2-normalised first, so k-means works on cosine geometry.
"""

from __future__ import annotations

import numpy as np
from sklearn.cluster import KMeans
from sklearn.metrics import v_measure_score

from moembed.eval.encoding import EmbeddingCache, View, encode, normalize
from moembed.eval.task import Task

PROMPT = "clustering"


def run_clustering(model, task: Task, view: View, cache: EmbeddingCache | None = None,
                   seed: int = 0) -> dict[str, float]:
    rows = task.data["test"]
    x = normalize(encode(model, [t for t, _ in rows], PROMPT, view, cache).astype(np.float64))
    labels = [lab for _, lab in rows]
    k = len(set(labels))
    pred = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(x)
    return {"v_measure": float(v_measure_score(labels, pred))}
