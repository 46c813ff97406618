"""Classification: logistic regression on embeddings, accuracy (MTEB Classification).

Protocol "mteb" (the default; MTEB 2's AbsTaskClassification): `n_experiments` (10) experiments, each fitting
`LogisticRegression(max_iter=100, random_state=seed)` on an undersampled training set — the training texts in
a shuffled order, keeping the first `samples_per_label` (8) of each label — and scoring the whole test split;
scores are averaged over experiments. The order of experiment i is that of experiment i-1 shuffled again by a
NumPy RandomState(seed) (MTEB's chain, so the sets match MTEB's own). Without `train.jsonl`, MTEB's
cross-validation: KFold(5, shuffled, seed) over the split, each fold's training part undersampled the same way.

Protocol "legacy": one logistic regression (max_iter 200) on the whole `train.jsonl`, or stratified k-fold
(k = min(5, smallest class size), at least 2) over the test split, scores averaged over folds.

Embeddings are the model's `encode` output with the "classification" prefix; models with their own `similarity`
are still classified from those vectors (a classifier needs features, not pairwise scores).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, f1_score
from sklearn.model_selection import KFold, StratifiedKFold

from moembed.errors import MoembedError
from moembed.eval import readers
from moembed.eval.encoding import EmbeddingCache, View, encode
from moembed.eval.task import Protocol, RunOptions, Task, TaskType


def _fit_score(x_tr, y_tr, x_te, y_te, seed: int, max_iter: int) -> dict[str, float]:
    clf = LogisticRegression(max_iter=max_iter, random_state=seed)
    clf.fit(x_tr, y_tr)
    pred = clf.predict(x_te)
    return {"accuracy": float(accuracy_score(y_te, pred)), "f1": float(f1_score(y_te, pred, average="macro")),
            "f1_weighted": float(f1_score(y_te, pred, average="weighted"))}


def _mean(scores: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([s[k] for s in scores])) for k in scores[0]}


def undersample(labels: np.ndarray, order: list[int], per_label: int, seed: int) -> list[int]:
    """Shuffle `order` in place with RandomState(seed), then keep the first `per_label` positions of each label.

    Called once per experiment on the same list, so each experiment reshuffles the previous one's order (MTEB)."""
    np.random.RandomState(seed).shuffle(order)
    taken: dict[str, int] = defaultdict(int)
    kept = []
    for i in order:
        if taken[labels[i]] < per_label:
            kept.append(i)
            taken[labels[i]] += 1
    return kept


def mteb_scores(x_tr: np.ndarray | None, y_tr: np.ndarray | None, x: np.ndarray, y: np.ndarray,
                p: Protocol) -> dict[str, float]:
    """MTEB's protocol on embeddings: with a training set (x_tr (n_tr, d), y_tr), n_experiments undersampled fits
    scored on (x (n, d), y); without one (None), 5-fold cross-validation over (x, y)."""
    seed = p.random_seed
    scores = []
    if x_tr is not None:
        order = list(range(len(y_tr)))
        for _ in range(p.n_experiments):
            keep = undersample(y_tr, order, p.samples_per_label, seed)
            scores.append(_fit_score(x_tr[keep], y_tr[keep], x, y, seed, max_iter=100))
        return _mean(scores)
    order = None
    for tr, te in KFold(n_splits=5, shuffle=True, random_state=seed).split(x):
        order = list(range(len(tr))) if order is None else order  # chained across folds, as MTEB does
        keep = undersample(y[tr], order, p.samples_per_label, seed)
        scores.append(_fit_score(x[tr][keep], y[tr][keep], x[te], y[te], seed, max_iter=100))
    return {**_mean(scores), "folds": 5}


def legacy_scores(x_tr: np.ndarray | None, y_tr: np.ndarray | None, x: np.ndarray, y: np.ndarray, seed: int,
                  where: Path) -> dict[str, float]:
    if x_tr is not None:
        return _fit_score(x_tr, y_tr, x, y, seed, max_iter=200)
    k = min(5, min(Counter(y.tolist()).values()))
    if k < 2:
        raise MoembedError(f"{where}: k-fold needs at least 2 examples of every label (or give train.jsonl)")
    folds = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(x, y)
    return {**_mean([_fit_score(x[tr], y[tr], x[te], y[te], seed, max_iter=200) for tr, te in folds]), "folds": k}


class Classification(TaskType):
    """`<split>.jsonl` {"text","label"} and optionally `train.jsonl` (else cross-validation on the split)."""

    name = "classification"
    main_score = "accuracy"
    query_prompt = document_prompt = "classification"
    detect_keys = frozenset({"text", "label"})  # clustering has the same records: it must say so in task.json
    protocols = ("mteb", "legacy")

    def read(self, path: Path, split: str) -> dict:
        test = readers.labelled(path / f"{split}.jsonl")
        train_file = path / "train.jsonl"
        train = readers.labelled(train_file) if train_file.exists() and split != "train" else None
        if len({lab for _, lab in test}) < 2:
            raise MoembedError(f"{path / f'{split}.jsonl'}: needs at least two labels")
        return {"test": test, "train": train}

    def run(self, model, task: Task, view: View, cache: EmbeddingCache | None, options: RunOptions) -> dict[str, float]:
        test = task.data["test"]
        x = encode(model, [t for t, _ in test], self.query_prompt, view, cache)  # (n, d)
        y = np.array([lab for _, lab in test])
        x_tr = y_tr = None
        if task.data["train"] is not None:
            train = task.data["train"]
            x_tr = encode(model, [t for t, _ in train], self.query_prompt, view, cache)  # (n_tr, d)
            y_tr = np.array([lab for _, lab in train])
        p = task.protocol
        if p.name == "legacy":
            return legacy_scores(x_tr, y_tr, x, y, p.random_seed, task.path)
        if x_tr is None and len(y) < 5:
            raise MoembedError(f"{task.path}: 5-fold cross-validation needs at least 5 texts (or give train.jsonl)")
        return mteb_scores(x_tr, y_tr, x, y, p)

    def texts(self, data: dict) -> list[str]:
        return [x for x, _ in data["test"]]
