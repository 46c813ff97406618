"""Pair classification: average precision of the similarity score for pairs labelled 1 (duplicate) vs 0.

MTEB reports the maximum AP over cosine, dot, Euclidean and Manhattan scores; moembed reports the AP of the
model's own similarity (cosine, or the model's `similarity`), which is what a user of the model would rank by.
Prefix: "classification" for both sentences (see sts.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.metrics import average_precision_score

from moembed.errors import MoembedError
from moembed.eval import readers
from moembed.eval.encoding import EmbeddingCache, View
from moembed.eval.task import RunOptions, SentencePairType, Task


def best_accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    """Accuracy at the best threshold on the scores (MTEB's cosine_accuracy)."""
    order = np.argsort(-scores, kind="stable")
    y = labels[order]
    pos_above = np.concatenate([[0], np.cumsum(y)])  # positives predicted positive when top-j are called positive
    neg_below = (len(y) - y.sum()) - np.concatenate([[0], np.cumsum(1 - y)])
    return float(((pos_above + neg_below) / len(y)).max())


class PairClassification(SentencePairType):
    """`<split>.jsonl` {"sentence1","sentence2","label"} (label 0 or 1)."""

    name = "pair_classification"
    main_score = "ap"
    query_prompt = document_prompt = "classification"
    detect_keys = frozenset({"sentence1", "sentence2", "label"})

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
        sims = self.similarities(model, task, view, cache)  # (n,)
        labels = np.array([r[2] for r in task.data["rows"]])
        return {"ap": float(average_precision_score(labels, sims)), "accuracy": best_accuracy(sims, labels)}
