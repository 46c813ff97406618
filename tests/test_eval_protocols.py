"""Classification, clustering and pair classification score as MTEB does (protocol "mteb", the default): moembed's
figures equal those of mteb's own task classes run by `mteb.evaluate` on the same embeddings. The "legacy" protocol
stays available from task.json.

The embeddings are synthetic (Gaussian clusters, one fixed vector per text through a lookup model), so both sides
see exactly the same vectors: this checks the scoring protocol, not a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mteb
import numpy as np
import pytest
from datasets import Dataset, DatasetDict
from mteb.abstasks.classification import AbsTaskClassification
from mteb.abstasks.clustering import AbsTaskClustering
from mteb.abstasks.pair_classification import AbsTaskPairClassification
from mteb.abstasks.task_metadata import TaskMetadata
from mteb.mocks.mock_tasks.classification import general_args
from sklearn.cluster import KMeans
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import average_precision_score, v_measure_score

from moembed.errors import MoembedError
from moembed.eval import evaluate, load_task
from moembed.eval.mteb_adapter import MtebEncoder
from moembed.eval.task import Protocol

DIM = 16


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    """Mini-batch k-means and the logistic regressions give the same results on one thread, much faster on a
    loaded machine."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        yield


class Lookup:
    """A model whose embedding of a text is a fixed vector from a table."""

    name, dim, prompts = "lookup", DIM, {}

    def __init__(self, table: dict[str, np.ndarray]):
        self.table = table

    def encode(self, texts, prompt_name=None, *, truncate_dim=None, precision="float32", batch_size=32, **kwargs):
        return np.stack([self.table[t] for t in texts]).astype(np.float32)


def _clusters(rng, prefix: str, labels: list[str], per_label: int, spread: float, centres) -> tuple[list, dict]:
    rows, table = [], {}
    for lab in labels:
        for i in range(per_label):
            text = f"{prefix} {lab} {i}"
            table[text] = centres[lab] + spread * rng.standard_normal(DIM)
            rows.append((text, lab))
    order = rng.permutation(len(rows))
    return [rows[i] for i in order], table


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    labels = ["alpha", "beta", "gamma", "delta"]
    centres = {lab: rng.standard_normal(DIM) for lab in labels}
    train, t1 = _clusters(rng, "train", labels, 30, 1.2, centres)
    test, t2 = _clusters(rng, "test", labels, 15, 1.2, centres)
    clu, t3 = _clusters(rng, "clu", labels, 25, 1.6, centres)
    pairs, t4 = [], {}
    for i in range(60):
        a = rng.standard_normal(DIM)
        same = i % 2
        b = a + (0.8 if same else 2.5) * rng.standard_normal(DIM)
        b = b * (1 + 0.5 * rng.random())  # scales differ, so cosine, dot and distances rank differently
        t4[f"s1 {i}"], t4[f"s2 {i}"] = a, b
        pairs.append((f"s1 {i}", f"s2 {i}", same))
    return {"train": train, "test": test, "clu": clu, "pairs": pairs, "model": Lookup({**t1, **t2, **t3, **t4})}


def _write(path: Path, rows: list[dict], spec: dict | None = None, name: str = "test.jsonl") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    if spec is not None:
        (path / "task.json").write_text(json.dumps(spec))
    return path


def _labelled(rows):
    return [{"text": t, "label": lab} for t, lab in rows]


def _meta(kind: str, name: str, main: str) -> TaskMetadata:
    return TaskMetadata(type=kind, name=name, main_score=main, **general_args)


def _mteb(model, task) -> dict:
    res = mteb.evaluate(MtebEncoder(model), [task], cache=None, show_progress_bar=False)
    return res.task_results[0].scores["test"][0]


class _Classification(AbsTaskClassification):
    metadata = _meta("Classification", "ParityClassification", "accuracy")
    rows: dict = {}

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        self.dataset = DatasetDict({k: Dataset.from_dict({"text": [t for t, _ in v], "label": [lab for _, lab in v]})
                                    for k, v in self.rows.items()})
        self.data_loaded = True


class _CrossValidation(_Classification):
    metadata = _meta("Classification", "ParityCrossValidation", "accuracy")
    is_cross_validation = True
    train_split = "test"


def test_classification_equals_mteb_with_a_training_set(data, tmp_path):
    d = _write(tmp_path / "cls", _labelled(data["test"]))
    _write(d, _labelled(data["train"]), name="train.jsonl")
    ours = evaluate(data["model"], [d])[0]
    task = _Classification()
    task.rows = {"train": data["train"], "test": data["test"]}
    theirs = _mteb(data["model"], task)
    assert ours.extra["protocol"] == "mteb"
    for key in ("accuracy", "f1", "f1_weighted"):
        assert ours.scores[key] == pytest.approx(theirs[key], abs=1e-9), key
    assert 0.3 < ours.main_score < 1.0  # a score that can differ between protocols


def test_classification_equals_mteb_cross_validation_without_a_training_set(data, tmp_path):
    rows = data["train"][:100]
    d = _write(tmp_path / "cv", _labelled(rows))
    ours = evaluate(data["model"], [d])[0]
    task = _CrossValidation()
    task.rows = {"test": rows}
    theirs = _mteb(data["model"], task)
    assert ours.scores["folds"] == 5
    for key in ("accuracy", "f1"):
        assert ours.scores[key] == pytest.approx(theirs[key], abs=1e-9), key


def test_classification_settings_and_legacy_protocol(data, tmp_path):
    d = _write(tmp_path / "cls", _labelled(data["test"]), {"type": "classification", "samples_per_label": 20,
                                                           "n_experiments": 3, "seed": 5})
    _write(d, _labelled(data["train"]), name="train.jsonl")
    task = _Classification(seed=5)
    task.samples_per_label, task.n_experiments = 20, 3
    task.rows = {"train": data["train"], "test": data["test"]}
    assert evaluate(data["model"], [d])[0].main_score == pytest.approx(_mteb(data["model"], task)["accuracy"], abs=1e-9)

    (d / "task.json").write_text(json.dumps({"type": "classification", "protocol": "legacy"}))
    legacy = evaluate(data["model"], [d])[0]
    x_tr = data["model"].encode([t for t, _ in data["train"]])
    x_te = data["model"].encode([t for t, _ in data["test"]])
    clf = LogisticRegression(max_iter=200, random_state=0).fit(x_tr, [lab for _, lab in data["train"]])
    expected = float(np.mean(clf.predict(x_te) == np.array([lab for _, lab in data["test"]])))
    assert legacy.extra["protocol"] == "legacy" and legacy.main_score == pytest.approx(expected, abs=1e-12)


class _Clustering(AbsTaskClustering):
    metadata = _meta("Clustering", "ParityClustering", "v_measure")
    max_fraction_of_documents_to_embed = None  # embed every text, as moembed does with a task directory
    rows: list = []

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        self.dataset = DatasetDict({"test": Dataset.from_dict({"sentences": [t for t, _ in self.rows],
                                                               "labels": [lab for _, lab in self.rows]})})
        self.data_loaded = True


def test_clustering_equals_mteb_bootstrapped_kmeans(data, tmp_path):
    # Bootstrap samples of 2,048 texts instead of 16,384 keep the test short; the defaults are checked below.
    d = _write(tmp_path / "clu", _labelled(data["clu"]), {"type": "clustering", "cluster_sample_size": 2048})
    ours = evaluate(data["model"], [d])[0]
    task = _Clustering()
    task.rows, task.max_documents_per_cluster = data["clu"], 2048
    theirs = _mteb(data["model"], task)
    assert ours.extra["protocol"] == "mteb"
    assert ours.scores["v_measure"] == pytest.approx(theirs["v_measure"], abs=1e-9)
    assert ours.scores["ami"] == pytest.approx(theirs["ami"], abs=1e-9)
    assert ours.scores["v_measure_std"] == pytest.approx(theirs["v_measure_std"], abs=1e-9)
    assert 0.2 < ours.main_score < 0.95  # clusters that overlap: a score with room to differ


def test_protocol_defaults_are_mtebs():
    p, cls = Protocol(), AbsTaskClassification
    assert (p.name, p.random_seed) == ("mteb", _Classification().seed)
    assert (p.n_experiments, p.samples_per_label) == (cls.n_experiments, cls.samples_per_label)
    assert cls.evaluator_model.get_params()["max_iter"] == 100
    assert (p.n_experiments, p.cluster_sample_size) == (AbsTaskClustering.n_clusters,
                                                         AbsTaskClustering.max_documents_per_cluster)
    assert AbsTaskClustering.k_mean_batch_size == 512
    assert Protocol(name="legacy").random_seed == 0


def test_clustering_legacy_protocol_is_kmeans_on_normalised_vectors(data, tmp_path):
    d = _write(tmp_path / "clu", _labelled(data["clu"]), {"type": "clustering", "protocol": "legacy"})
    legacy = evaluate(data["model"], [d])[0]
    x = data["model"].encode([t for t, _ in data["clu"]]).astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    pred = KMeans(n_clusters=4, n_init=10, random_state=0).fit_predict(x)
    assert legacy.main_score == pytest.approx(v_measure_score([lab for _, lab in data["clu"]], pred), abs=1e-12)


class _Pairs(AbsTaskPairClassification):
    metadata = _meta("PairClassification", "ParityPairs", "max_ap")
    rows: list = []

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        cols = {"sentence1": [r[0] for r in self.rows], "sentence2": [r[1] for r in self.rows],
                "labels": [r[2] for r in self.rows]}
        self.dataset = DatasetDict({"test": Dataset.from_dict(cols)})
        self.data_loaded = True


def test_pair_classification_is_the_max_over_similarity_functions_as_mteb(data, tmp_path):
    rows = [{"sentence1": a, "sentence2": b, "label": y} for a, b, y in data["pairs"]]
    d = _write(tmp_path / "pairs", rows)
    ours = evaluate(data["model"], [d])[0]
    task = _Pairs()
    task.rows = data["pairs"]
    theirs = _mteb(data["model"], task)
    assert ours.main_score == pytest.approx(theirs["max_ap"], abs=1e-9)
    assert ours.scores["accuracy"] == pytest.approx(theirs["max_accuracy"], abs=1e-9)
    for fn in ("cosine", "dot", "euclidean", "manhattan", "similarity"):
        assert ours.scores[f"{fn}_ap"] == pytest.approx(theirs[f"{fn}_ap"], abs=1e-9), fn
    # The functions disagree here, so the maximum is a real choice (and above cosine's AP).
    assert ours.main_score > ours.scores["cosine_ap"]

    (d / "task.json").write_text(json.dumps({"protocol": "legacy"}))
    legacy = evaluate(data["model"], [d])[0]
    assert legacy.main_score == pytest.approx(ours.scores["cosine_ap"], abs=1e-9)
    labels = [y for _, _, y in data["pairs"]]
    a = data["model"].encode([r[0] for r in data["pairs"]])
    b = data["model"].encode([r[1] for r in data["pairs"]])
    cos = np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert legacy.main_score == pytest.approx(average_precision_score(labels, cos), abs=1e-6)


@pytest.mark.parametrize("spec, key", [
    ({"type": "clustering", "protocol": "mteb2"}, "protocol"),
    ({"type": "clustering", "samples_per_label": 4}, "samples_per_label"),
    ({"type": "classification", "protocol": "legacy", "n_experiments": 3}, "n_experiments"),
    ({"type": "classification", "samples_per_label": 0}, "samples_per_label"),
    ({"type": "sts", "protocol": "mteb"}, "protocol"),
])
def test_protocol_keys_that_do_not_apply_are_refused(tmp_path, spec, key):
    if spec["type"] == "sts":
        rows = [{"sentence1": "a", "sentence2": "b", "score": 1.0}, {"sentence1": "c", "sentence2": "d", "score": 2.0}]
    else:
        rows = [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}]
    d = _write(tmp_path / "t", rows, spec)
    with pytest.raises(MoembedError, match=rf"task\.json: key '{key}'"):
        load_task(d)
