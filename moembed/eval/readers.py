"""Readers of each task type's files into validated in-memory data (see task.py for the layouts)."""

from __future__ import annotations

import math
from pathlib import Path

from moembed.errors import MoembedError
from moembed.fileio import iter_jsonl


def _require(path: Path) -> Path:
    if not path.exists():
        raise MoembedError(f"{path}: missing file")
    return path


def _records(path: Path, keys: tuple[str, ...]):
    """Yield (line, record) for JSON objects that have all `keys`."""
    for i, rec in iter_jsonl(_require(path)):
        if not isinstance(rec, dict):
            raise MoembedError(f"{path}:{i}: expected a JSON object")
        for k in keys:
            if k not in rec:
                raise MoembedError(f"{path}:{i}: missing key {k!r}")
        yield i, rec


def _text(path: Path, i: int, rec: dict, key: str) -> str:
    v = rec[key]
    if not isinstance(v, str):
        raise MoembedError(f"{path}:{i}: {key!r} must be a string, got {type(v).__name__}")
    return v


def _number(path: Path, i: int, rec: dict, key: str) -> float:
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise MoembedError(f"{path}:{i}: {key!r} must be a number, got {v!r}")
    return float(v)


def _nonempty(path: Path, items) -> None:
    if not items:
        raise MoembedError(f"{path}: empty task (no records)")


def _id_texts(path: Path, with_title: bool) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, rec in _records(path, ("_id", "text")):
        did = str(rec["_id"])
        if did in out:
            raise MoembedError(f"{path}:{i}: duplicate _id {did!r}")
        text = _text(path, i, rec, "text")
        title = rec.get("title") or "" if with_title else ""
        if not isinstance(title, str):
            raise MoembedError(f"{path}:{i}: 'title' must be a string")
        out[did] = f"{title} {text}".strip() if title else text  # BEIR convention: title and body joined
    _nonempty(path, out)
    return out


def read_retrieval(path: Path, split: str) -> dict:
    from moembed.eval.task import read_qrels

    corpus = _id_texts(path / "corpus.jsonl", with_title=True)
    queries = _id_texts(path / "queries.jsonl", with_title=False)
    qfile = path / "qrels" / f"{split}.tsv"
    qrels: dict[str, dict[str, int]] = {}
    for i, qid, did, score in read_qrels(qfile):
        if qid not in queries:
            raise MoembedError(f"{qfile}:{i}: unknown query-id {qid!r} (not in queries.jsonl)")
        if did not in corpus:
            raise MoembedError(f"{qfile}:{i}: unknown corpus-id {did!r} (not in corpus.jsonl)")
        qrels.setdefault(qid, {})[did] = score
    qrels = {q: d for q, d in qrels.items() if any(s > 0 for s in d.values())}
    if not qrels:
        raise MoembedError(f"{qfile}: empty task (no query has a relevant document)")
    return {"corpus": corpus, "queries": queries, "qrels": qrels}


def read_sts(path: Path, split: str) -> dict:
    f = path / f"{split}.jsonl"
    rows = [
        (_text(f, i, r, "sentence1"), _text(f, i, r, "sentence2"), _number(f, i, r, "score"))
        for i, r in _records(f, ("sentence1", "sentence2", "score"))
    ]
    _nonempty(f, rows)
    return {"rows": rows}


def read_pairs(path: Path, split: str) -> dict:
    f = path / f"{split}.jsonl"
    rows = []
    for i, r in _records(f, ("sentence1", "sentence2", "label")):
        label = r["label"]
        if label not in (0, 1) or isinstance(label, bool):
            raise MoembedError(f"{f}:{i}: 'label' must be 0 or 1, got {label!r}")
        rows.append((_text(f, i, r, "sentence1"), _text(f, i, r, "sentence2"), int(label)))
    _nonempty(f, rows)
    if len({r[2] for r in rows}) < 2:
        raise MoembedError(f"{f}: needs both labels 0 and 1 for average precision")
    return {"rows": rows}


def _labelled(f: Path) -> list[tuple[str, str]]:
    rows = []
    for i, r in _records(f, ("text", "label")):
        label = r["label"]
        if not isinstance(label, (str, int)) or isinstance(label, bool):
            raise MoembedError(f"{f}:{i}: 'label' must be a string or integer, got {label!r}")
        rows.append((_text(f, i, r, "text"), str(label)))
    _nonempty(f, rows)
    return rows


def read_classification(path: Path, split: str) -> dict:
    test = _labelled(path / f"{split}.jsonl")
    train_file = path / "train.jsonl"
    train = _labelled(train_file) if train_file.exists() and split != "train" else None
    if len({lab for _, lab in test}) < 2:
        raise MoembedError(f"{path / f'{split}.jsonl'}: needs at least two labels")
    return {"test": test, "train": train}


def read_clustering(path: Path, split: str) -> dict:
    rows = _labelled(path / f"{split}.jsonl")
    return {"test": rows, "train": None}


def read_reranking(path: Path, split: str) -> dict:
    f = path / f"{split}.jsonl"
    rows = []
    for i, r in _records(f, ("query", "positive", "negative")):
        lists = []
        for key in ("positive", "negative"):
            v = r[key]
            if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
                raise MoembedError(f"{f}:{i}: {key!r} must be a list of strings")
            lists.append(v)
        if lists[0]:  # a query without positives has no defined average precision (MTEB skips it too)
            rows.append((_text(f, i, r, "query"), lists[0], lists[1]))
    _nonempty(f, rows)
    return {"rows": rows}


READERS = {
    "retrieval": read_retrieval,
    "sts": read_sts,
    "pair_classification": read_pairs,
    "classification": read_classification,
    "clustering": read_clustering,
    "reranking": read_reranking,
}
