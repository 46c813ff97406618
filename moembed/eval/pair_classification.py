"""Pair classification: average precision of a pair score for pairs labelled 1 (duplicate) vs 0.

Protocol "mteb" (the default; MTEB 2's AbsTaskPairClassification): the pair is scored by each of the model's own
similarity, cosine, dot product, Euclidean and Manhattan distance (distances rank in reverse); "ap" (the main
score) and "accuracy" are the maxima over these functions of the AP and of the best-threshold accuracy, and each
function's AP is reported as "<function>_ap". The best threshold never splits tied scores (as MTEB).
Protocol "legacy": the AP and best-threshold accuracy of the model's own similarity only (cosine, or the model's
`similarity`), what a user of the model would rank by; never above the "mteb" figure.
Prefix: "classification" for both sentences (see sts.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.metrics import average_precision_score
from sklearn.metrics.pairwise import paired_cosine_distances, paired_euclidean_distances, paired_manhattan_distances

from moembed.errors import MoembedError
from moembed.eval import readers
from moembed.eval.encoding import EmbeddingCache, View, encode, pairwise
from moembed.eval.task import RunOptions, SentencePairType, Task


def best_accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    """Accuracy at the best threshold on the scores, any cut of the ranking allowed (legacy protocol)."""
    order = np.argsort(-scores, kind="stable")
    y = labels[order]
    pos_above = np.concatenate([[0], np.cumsum(y)])  # positives predicted positive when top-j are called positive
    neg_below = (len(y) - y.sum()) - np.concatenate([[0], np.cumsum(1 - y)])
    return float(((pos_above + neg_below) / len(y)).max())


def threshold_accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    """Best accuracy of "positive iff score above a threshold", the threshold between two distinct consecutive
    scores of the ranking (so tied pairs are never split; 0 when all scores tie), as MTEB computes it."""
    order = np.argsort(-scores, kind="stable")
    s, y = scores[order], labels[order]
    cut = np.flatnonzero(s[:-1] != s[1:])  # (c,) positions i: the top i+1 are called positive
    if len(cut) == 0:
        return 0.0
    pos_above = np.cumsum(y)[cut]
    neg_below = (len(y) - y.sum()) - np.cumsum(1 - y)[cut]
    return float(((pos_above + neg_below) / len(y)).max())


def pair_scores(model, a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """Per function, (n,) scores of row i of a with row i of b, oriented so that higher means more similar."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return {
        "similarity": pairwise(model, a, b).astype(np.float64),
        "cosine": 1 - paired_cosine_distances(a, b),
        "manhattan": -paired_manhattan_distances(a, b),
        "euclidean": -paired_euclidean_distances(a, b),
        "dot": np.einsum("nd,nd->n", a64, b64),
    }


class PairClassification(SentencePairType):
    """`<split>.jsonl` {"sentence1","sentence2","label"} (label 0 or 1)."""

    name = "pair_classification"
    main_score = "ap"
    query_prompt = document_prompt = "classification"
    detect_keys = frozenset({"sentence1", "sentence2", "label"})
    protocols = ("mteb", "legacy")

    def read(self, path: Path, split: str) -> dict:
        f = path / f"{split}.jsonl"
        rows = []
        for i, r in readers.records(f, ("sentence1", "sentence2", "label")):
            label = r["label"]
            if label not in (0, 1) or isinstance(label, bool):
                raise MoembedError(f"{f}:{i}: 'label' must be 0 or 1, got {label!r}")
            rows.append((readers.string(f, i, r, "sentence1"), readers.string(f, i, r, "sentence2"), int(label)))
        readers.nonempty(f, rows)
        if len({r[2] for r in rows}) < 2:
            raise MoembedError(f"{f}: needs both labels 0 and 1 for average precision")
        return {"rows": rows}

    def run(self, model, task: Task, view: View, cache: EmbeddingCache | None, options: RunOptions) -> dict[str, float]:
        labels = np.array([r[2] for r in task.data["rows"]])
        if task.protocol.name == "legacy":
            sims = self.similarities(model, task, view, cache)  # (n,)
            return {"ap": float(average_precision_score(labels, sims)), "accuracy": best_accuracy(sims, labels)}
        rows = task.data["rows"]
        a = encode(model, [r[0] for r in rows], self.query_prompt, view, cache)  # (n, d)
        b = encode(model, [r[1] for r in rows], self.document_prompt, view, cache)  # (n, d)
        out: dict[str, float] = {}
        accuracy = []
        for fn, s in pair_scores(model, a, b).items():
            out[f"{fn}_ap"] = float(average_precision_score(labels, s))
            accuracy.append(threshold_accuracy(s, labels))
        return {"ap": max(out.values()), "accuracy": max(accuracy), **out}
