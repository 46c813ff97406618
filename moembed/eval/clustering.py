"""Clustering: k-means with as many clusters as gold labels, V-measure against the labels (MTEB Clustering).

Protocol "mteb" (the default): MTEB 2's bootstrapped ("fast") clustering, the default clustering class of the
mteb 2 releases (`AbsTaskClustering`; v1's `AbsTaskClusteringLegacy` is not used). On the raw `encode` vectors
(not re-normalised), `n_experiments` (10) times: draw `cluster_sample_size` (16,384) texts with replacement
(Python's `random.Random(seed).choices`, one generator for all draws), fit
`MiniBatchKMeans(k = number of labels, batch_size=512, init="k-means++", n_init=1, random_state=seed)` and score
V-measure (and AMI); the scores are the means over the draws. Unlike MTEB's tasks, which may embed only a
sample of their dataset, every text of the task directory is embedded: the directory is what is clustered.

Protocol "legacy": one `KMeans(k, n_init=10, random_state=seed)` on the L2-normalised embeddings.

Embeddings use the "clustering" prefix.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from sklearn.cluster import KMeans, MiniBatchKMeans
from sklearn.metrics import adjusted_mutual_info_score, v_measure_score

from moembed.eval import readers
from moembed.eval.encoding import EmbeddingCache, View, encode, normalize
from moembed.eval.task import Protocol, RunOptions, Task, TaskType


def mteb_scores(x: np.ndarray, labels: np.ndarray, p: Protocol) -> dict[str, float]:
    """Bootstrapped mini-batch k-means of x (n, d) against labels (n,), MTEB's protocol."""
    seed = p.random_seed
    rng = random.Random(seed)
    k = np.unique(labels).size
    v, ami = [], []
    for _ in range(p.n_experiments):
        idx = rng.choices(range(len(x)), k=p.cluster_sample_size)  # with replacement
        model = MiniBatchKMeans(n_clusters=k, batch_size=512, init="k-means++", n_init=1, random_state=seed)
        pred = model.fit_predict(x[idx])
        v.append(v_measure_score(labels[idx], pred))
        ami.append(adjusted_mutual_info_score(labels[idx], pred))
    return {"v_measure": float(np.mean(v)), "v_measure_std": float(np.std(v)), "ami": float(np.mean(ami))}


def legacy_scores(x: np.ndarray, labels: np.ndarray, seed: int) -> dict[str, float]:
    """One k-means (10 restarts) on the L2-normalised embeddings, so it works on cosine geometry."""
    x = normalize(x.astype(np.float64))
    pred = KMeans(n_clusters=np.unique(labels).size, n_init=10, random_state=seed).fit_predict(x)
    return {"v_measure": float(v_measure_score(labels, pred))}


class Clustering(TaskType):
    """`<split>.jsonl` {"text","label"} with task.json {"type": "clustering"} (the records look like
    classification's, so the type is never guessed)."""

    name = "clustering"
    main_score = "v_measure"
    query_prompt = document_prompt = "clustering"
    protocols = ("mteb", "legacy")

    def read(self, path: Path, split: str) -> dict:
        return {"test": readers.labelled(path / f"{split}.jsonl"), "train": None}

    def run(self, model, task: Task, view: View, cache: EmbeddingCache | None, options: RunOptions) -> dict[str, float]:
        rows = task.data["test"]
        x = encode(model, [t for t, _ in rows], self.query_prompt, view, cache)  # (n, d)
        labels = np.array([lab for _, lab in rows])
        if task.protocol.name == "legacy":
            return legacy_scores(x, labels, task.protocol.random_seed)
        return mteb_scores(x, labels, task.protocol)

    def texts(self, data: dict) -> list[str]:
        return [x for x, _ in data["test"]]
