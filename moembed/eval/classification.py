"""Classification: logistic regression on embeddings, accuracy (MTEB Classification).

With a `train.jsonl` the classifier is fit on it and scored on the test split; otherwise stratified k-fold
(k = min(5, smallest class size), at least 2) over the test split, scores averaged over folds. Embeddings are
the model's `encode` output with the "classification" prefix; models with their own `similarity` are still
classified from those vectors (a classifier needs features, not pairwise scores).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, f1_score
from sklearn.model_selection import StratifiedKFold

from moembed.errors import MoembedError
from moembed.eval import readers
from moembed.eval.encoding import EmbeddingCache, View, encode
from moembed.eval.task import RunOptions, Task, TaskType


def _fit_score(x_tr, y_tr, x_te, y_te, seed: int) -> tuple[float, float]:
    clf = LogisticRegression(max_iter=200, random_state=seed)  # MTEB: max_iter 100; 200 converges more often
    clf.fit(x_tr, y_tr)
    pred = clf.predict(x_te)
    return accuracy_score(y_te, pred), f1_score(y_te, pred, average="macro")


class Classification(TaskType):
    """`<split>.jsonl` {"text","label"} and optionally `train.jsonl` (else stratified k-fold)."""

    name = "classification"
    main_score = "accuracy"
    query_prompt = document_prompt = "classification"
    detect_keys = frozenset({"text", "label"})  # clustering has the same records: it must say so in task.json

    def read(self, path: Path, split: str) -> dict:
        test = readers.labelled(path / f"{split}.jsonl")
        train_file = path / "train.jsonl"
        train = readers.labelled(train_file) if train_file.exists() and split != "train" else None
        if len({lab for _, lab in test}) < 2:
            raise MoembedError(f"{path / f'{split}.jsonl'}: needs at least two labels")
        return {"test": test, "train": train}

    def run(self, model, task: Task, view: View, cache: EmbeddingCache | None, options: RunOptions,
            seed: int = 0) -> dict[str, float]:
        test = task.data["test"]
        x = encode(model, [t for t, _ in test], self.query_prompt, view, cache)
        y = np.array([lab for _, lab in test])
        if task.data["train"] is not None:
            train = task.data["train"]
            x_tr = encode(model, [t for t, _ in train], self.query_prompt, view, cache)
            acc, f1 = _fit_score(x_tr, np.array([lab for _, lab in train]), x, y, seed)
            return {"accuracy": float(acc), "f1": float(f1)}
        k = min(5, min(Counter(y.tolist()).values()))
        if k < 2:
            raise MoembedError(f"{task.path}: k-fold needs at least 2 examples of every label (or give train.jsonl)")
        folds = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(x, y)
        scores = np.array([_fit_score(x[tr], y[tr], x[te], y[te], seed) for tr, te in folds])  # (k, 2)
        return {"accuracy": float(scores[:, 0].mean()), "f1": float(scores[:, 1].mean()), "folds": k}

    def texts(self, data: dict) -> list[str]:
        return [x for x, _ in data["test"]]
