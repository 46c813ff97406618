"""Task directories: detect the task type, read and validate the files, refuse empty tasks.

Layouts (one directory per task; `task.json` {"type", "name", "split"} is optional except for clustering):
- retrieval: BEIR layout — `corpus.jsonl` {"_id","title","text"}, `queries.jsonl` {"_id","text"},
  `qrels/<split>.tsv` with header `query-id  corpus-id  score`.
- sts: `<split>.jsonl` {"sentence1","sentence2","score"} (score a number).
- pair_classification: `<split>.jsonl` {"sentence1","sentence2","label"} (label 0 or 1).
- classification: `<split>.jsonl` {"text","label"} and optionally `train.jsonl` (else stratified k-fold).
- clustering: `<split>.jsonl` {"text","label"} with task.json {"type": "clustering"}.
- reranking: `<split>.jsonl` {"query","positive":[...],"negative":[...]}.
Every error names the file and line at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from moembed.errors import MoembedError
from moembed.fileio import iter_jsonl, read_text_lines

TaskType = Literal["retrieval", "sts", "classification", "clustering", "pair_classification", "reranking"]
TASK_TYPES: tuple[str, ...] = ("retrieval", "sts", "classification", "clustering", "pair_classification", "reranking")


class TaskSpec(BaseModel):
    """The optional `task.json` of a task directory."""

    model_config = ConfigDict(extra="forbid")
    type: TaskType | None = None
    name: str | None = None
    split: str = "test"


@dataclass
class Task:
    """A loaded task. `data` holds the validated content, by type:

    retrieval: corpus {id: text}, queries {id: text}, qrels {qid: {did: int}};
    sts / pair_classification: rows [(s1, s2, score_or_label)];
    classification / clustering: test [(text, label)], train [(text, label)] or None;
    reranking: rows [(query, positives, negatives)].
    """

    name: str
    type: str
    split: str
    path: Path
    data: dict[str, Any] = field(default_factory=dict)


def _spec(path: Path) -> TaskSpec:
    f = path / "task.json"
    if not f.exists():
        return TaskSpec()
    try:
        return TaskSpec(**json.loads(f.read_text(encoding="utf-8")))
    except json.JSONDecodeError as e:
        raise MoembedError(f"{f}:{e.lineno}: invalid JSON ({e.msg})") from None
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err["loc"]) or "task.json"
        raise MoembedError(f"{f}: key {key!r}: {err['msg']}") from None
    except TypeError:
        raise MoembedError(f"{f}: expected a JSON object") from None


def _first_record(path: Path) -> dict:
    for i, rec in iter_jsonl(path):
        if not isinstance(rec, dict):
            raise MoembedError(f"{path}:{i}: expected a JSON object")
        return rec
    raise MoembedError(f"{path}: empty task (no records)")


def detect_type(path: Path, split: str) -> str:
    """Guess the task type from the files present and the keys of the first record."""
    if (path / "corpus.jsonl").exists() or (path / "queries.jsonl").exists() or (path / "qrels").exists():
        return "retrieval"
    f = path / f"{split}.jsonl"
    if not f.exists():
        raise MoembedError(f"{path}: missing file {f.name} (or corpus.jsonl/queries.jsonl/qrels for retrieval)")
    keys = set(_first_record(f))
    if {"sentence1", "sentence2", "score"} <= keys:
        return "sts"
    if {"sentence1", "sentence2", "label"} <= keys:
        return "pair_classification"
    if {"query", "positive"} <= keys:
        return "reranking"
    if {"text", "label"} <= keys:
        return "classification"  # clustering has the same records: it must say so in task.json
    raise MoembedError(f"{f}:1: cannot tell the task type from keys {sorted(keys)}; add task.json with a 'type'")


def load_task(path: str | Path) -> Task:
    """Read a task directory (type from task.json or detected), validating every record."""
    path = Path(path)
    if not path.is_dir():
        raise MoembedError(f"{path}: not a task directory")
    spec = _spec(path)
    ttype = spec.type or detect_type(path, spec.split)
    task = Task(spec.name or path.name, ttype, spec.split, path)
    from moembed.eval import readers

    task.data = readers.READERS[ttype](path, spec.split)
    return task


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
