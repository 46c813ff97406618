"""The task types, and loading a task directory: read task.json, recognise the type, read and validate the files.

`TASK_TYPES` is the one list of task types; everything that depends on the type (reading, scoring, the main
score, prompts, int8 calibration texts) asks the type's class. Its order is the order of recognition: a
directory without `task.json` "type" gets the first type whose files are present (retrieval), else the first
whose record keys the first record of `<split>.jsonl` has. Clustering records look like classification's, so a
clustering task says so in task.json. Every error names the file and line at fault.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from moembed.errors import MoembedError
from moembed.eval.classification import Classification
from moembed.eval.clustering import Clustering
from moembed.eval.pair_classification import PairClassification
from moembed.eval.reranking import Reranking
from moembed.eval.retrieval import Retrieval
from moembed.eval.sts import STS
from moembed.eval.task import Protocol, Task, TaskType
from moembed.fileio import iter_jsonl

TASK_TYPES: dict[str, TaskType] = {
    t.name: t for t in (Retrieval(), STS(), PairClassification(), Reranking(), Classification(), Clustering())
}


_PROTOCOL_KEYS = {"protocol", "seed", "n_experiments", "samples_per_label", "cluster_sample_size"}
_PROTOCOL_KEYS_OF = {  # the settings each type's "mteb" protocol reads
    "classification": {"n_experiments", "samples_per_label"},
    "clustering": {"n_experiments", "cluster_sample_size"},
}


def task_type(name: str) -> TaskType:
    if name not in TASK_TYPES:
        raise MoembedError(f"task type: unknown {name!r}; choose one of {', '.join(TASK_TYPES)}")
    return TASK_TYPES[name]


class TaskSpec(BaseModel):
    """The optional `task.json` of a task directory; the protocol keys apply to the types with `protocols`
    (classification, clustering, pair classification; see `moembed.eval.task.Protocol`)."""

    model_config = ConfigDict(extra="forbid")
    type: str | None = None
    name: str | None = None
    split: str = "test"
    protocol: Literal["mteb", "legacy"] | None = None
    seed: int | None = None
    n_experiments: int | None = Field(None, ge=1)
    samples_per_label: int | None = Field(None, ge=1)
    cluster_sample_size: int | None = Field(None, ge=1)

    def to_protocol(self, f: Path, kind: TaskType) -> Protocol:
        """The scoring protocol of a task of type `kind`; keys that do not apply are refused, naming the key."""
        given = {k: v for k, v in self.model_dump(include=_PROTOCOL_KEYS).items() if v is not None}
        if given and not kind.protocols:
            raise MoembedError(f"{f}: key {sorted(given)[0]!r}: task type {kind.name} has no scoring protocol")
        applies = _PROTOCOL_KEYS_OF.get(kind.name, set()) | {"protocol", "seed"}
        name = given.get("protocol", Protocol().name)
        for key in sorted(given):
            if key not in applies or (name == "legacy" and key not in ("protocol", "seed")):
                raise MoembedError(f"{f}: key {key!r}: does not apply to {kind.name} with protocol {name!r}")
        return Protocol(name=name, **{k: v for k, v in given.items() if k != "protocol"})

    @field_validator("type")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None and v not in TASK_TYPES:
            raise ValueError(f"unknown task type {v!r}; choose one of {', '.join(TASK_TYPES)}")
        return v


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
    for t in TASK_TYPES.values():
        if any((path / f).exists() for f in t.detect_files):
            return t.name
    f = path / f"{split}.jsonl"
    if not f.exists():
        by_files = "; ".join(f"{'/'.join(t.detect_files)} for {t.name}" for t in TASK_TYPES.values() if t.detect_files)
        raise MoembedError(f"{path}: missing file {f.name} (or {by_files})")
    keys = set(_first_record(f))
    for t in TASK_TYPES.values():
        if t.detect_keys is not None and t.detect_keys <= keys:
            return t.name
    raise MoembedError(f"{f}:1: cannot tell the task type from keys {sorted(keys)}; add task.json with a 'type'")


def load_task(path: str | Path) -> Task:
    """Read a task directory (type from task.json or detected), validating every record."""
    path = Path(path)
    if not path.is_dir():
        raise MoembedError(f"{path}: not a task directory")
    spec = _spec(path)
    name = spec.type or detect_type(path, spec.split)
    protocol = spec.to_protocol(path / "task.json", TASK_TYPES[name])
    return Task(spec.name or path.name, name, spec.split, path, TASK_TYPES[name].read(path, spec.split), protocol)
