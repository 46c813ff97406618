"""Clustering: k-means with as many clusters as gold labels, V-measure against the labels (MTEB Clustering).

Embeddings use the "clustering" prefix and are L2-normalised first, so k-means works on cosine geometry.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.cluster import KMeans
from sklearn.metrics import v_measure_score

from moembed.eval import readers
from moembed.eval.encoding import EmbeddingCache, View, encode, normalize
from moembed.eval.task import RunOptions, Task, TaskType


class Clustering(TaskType):
    """`<split>.jsonl` {"text","label"} with task.json {"type": "clustering"} (the records look like
    classification's, so the type is never guessed)."""

    name = "clustering"
    main_score = "v_measure"
    query_prompt = document_prompt = "clustering"

    def read(self, path: Path, split: str) -> dict:
        return {"test": readers.labelled(path / f"{split}.jsonl"), "train": None}

    def run(self, model, task: Task, view: View, cache: EmbeddingCache | None, options: RunOptions,
            seed: int = 0) -> dict[str, float]:
        rows = task.data["test"]
        x = normalize(encode(model, [t for t, _ in rows], self.query_prompt, view, cache).astype(np.float64))
        labels = [lab for _, lab in rows]
        k = len(set(labels))
        pred = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(x)
        return {"v_measure": float(v_measure_score(labels, pred))}

    def texts(self, data: dict) -> list[str]:
        return [x for x, _ in data["test"]]
