"""Reading task files: JSONL records and BEIR qrels, validated, every error naming the file and line.

Each task type's `read` (one module per type) is built from these helpers."""

from __future__ import annotations

import math
from pathlib import Path

from moembed.errors import MoembedError
from moembed.fileio import iter_jsonl, read_text_lines


def require(path: Path) -> Path:
    if not path.exists():
        raise MoembedError(f"{path}: missing file")
    return path


def records(path: Path, keys: tuple[str, ...]):
    """Yield (line, record) for JSON objects that have all `keys`."""
    for i, rec in iter_jsonl(require(path)):
        if not isinstance(rec, dict):
            raise MoembedError(f"{path}:{i}: expected a JSON object")
        for k in keys:
            if k not in rec:
                raise MoembedError(f"{path}:{i}: missing key {k!r}")
        yield i, rec


def string(path: Path, i: int, rec: dict, key: str) -> str:
    v = rec[key]
    if not isinstance(v, str):
        raise MoembedError(f"{path}:{i}: {key!r} must be a string, got {type(v).__name__}")
    return v


def number(path: Path, i: int, rec: dict, key: str) -> float:
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise MoembedError(f"{path}:{i}: {key!r} must be a number, got {v!r}")
    return float(v)


def nonempty(path: Path, items) -> None:
    if not items:
        raise MoembedError(f"{path}: empty task (no records)")


def id_texts(path: Path, with_title: bool) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, rec in records(path, ("_id", "text")):
        did = str(rec["_id"])
        if did in out:
            raise MoembedError(f"{path}:{i}: duplicate _id {did!r}")
        body = string(path, i, rec, "text")
        title = rec.get("title") or "" if with_title else ""
        if not isinstance(title, str):
            raise MoembedError(f"{path}:{i}: 'title' must be a string")
        out[did] = f"{title} {body}".strip() if title else body  # BEIR convention: title and body joined
    nonempty(path, out)
    return out


def labelled(f: Path) -> list[tuple[str, str]]:
    rows = []
    for i, r in records(f, ("text", "label")):
        label = r["label"]
        if not isinstance(label, (str, int)) or isinstance(label, bool):
            raise MoembedError(f"{f}:{i}: 'label' must be a string or integer, got {label!r}")
        rows.append((string(f, i, r, "text"), str(label)))
    nonempty(f, rows)
    return rows


def read_qrels(path: Path) -> list[tuple[int, str, str, int]]:
    """Rows (line, query-id, corpus-id, score) of a BEIR qrels TSV with a header line."""
    if not path.exists():
        raise MoembedError(f"{path}: missing file")
    lines = read_text_lines(path)
    if not lines or lines[0].split("\t")[0].strip().lower() not in ("query-id", "query_id", "qid"):
        raise MoembedError(f"{path}:1: expected the header 'query-id<TAB>corpus-id<TAB>score'")
    rows = []
    for i, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            raise MoembedError(f"{path}:{i}: expected 3 tab-separated columns, got {len(parts)}")
        try:
            score = int(float(parts[2]))
        except ValueError:
            raise MoembedError(f"{path}:{i}: score {parts[2]!r} is not a number") from None
        rows.append((i, parts[0], parts[1], score))
    return rows
