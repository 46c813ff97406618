"""Classification: logistic regression on embeddings, accuracy (MTEB Classification).

With a `train.jsonl` the classifier is fit on it and scored on the test split; otherwise stratified k-fold
(k = min(5, smallest class size), at least 2) over the test split, scores averaged over folds. Embeddings are
the model's `encode` output with the "classification" prefix; models with their own `similarity` are still
classified from those vectors (a classifier needs features, not pairwise scores).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, f1_score
from sklearn.model_selection import StratifiedKFold

from moembed.errors import MoembedError
from moembed.eval.encoding import EmbeddingCache, View, encode
from moembed.eval.task import Task

PROMPT = "classification"


def _fit_score(x_tr, y_tr, x_te, y_te, seed: int) -> tuple[float, float]:
    clf = LogisticRegression(max_iter=200, random_state=seed)  # MTEB: max_iter 100; 200 converges more often
    clf.fit(x_tr, y_tr)
    pred = clf.predict(x_te)
    return accuracy_score(y_te, pred), f1_score(y_te, pred, average="macro")


def run_classification(model, task: Task, view: View, cache: EmbeddingCache | None = None,
                       seed: int = 0) -> dict[str, float]:
    test = task.data["test"]
    x = encode(model, [t for t, _ in test], PROMPT, view, cache)
    y = np.array([lab for _, lab in test])
    if task.data["train"] is not None:
        train = task.data["train"]
        x_tr = encode(model, [t for t, _ in train], PROMPT, view, cache)
        acc, f1 = _fit_score(x_tr, np.array([lab for _, lab in train]), x, y, seed)
        return {"accuracy": float(acc), "f1": float(f1)}
    k = min(5, min(Counter(y.tolist()).values()))
    if k < 2:
        raise MoembedError(f"{task.path}: k-fold needs at least 2 examples of every label (or give train.jsonl)")
    folds = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(x, y)
    scores = np.array([_fit_score(x[tr], y[tr], x[te], y[te], seed) for tr, te in folds])  # (k, 2)
    return {"accuracy": float(scores[:, 0].mean()), "f1": float(scores[:, 1].mean()), "folds": k}
