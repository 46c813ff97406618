"""Run one loaded task on one model view and return a TaskResult."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from moembed.eval.encoding import EmbeddingCache, View
from moembed.eval.registry import TASK_TYPES
from moembed.eval.task import RunOptions, Task
from moembed.model.embedder import Embedder


@dataclass
class TaskResult:
    """Scores of one model on one task split under one setting (dim, precision, max length, Dynamic NTK)."""

    task_name: str
    task_type: str
    split: str
    scores: dict[str, float]
    main_score: float
    evaluation_time: float  # seconds, encoding included
    dim: int | None = None
    precision: str = "float32"
    max_length: int | None = None
    dynamic_ntk: bool | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def run_task(model, task: Task, view: View, cache: EmbeddingCache | None = None, use_faiss: bool = False,
             chunk_size: int = 10_000, query_block: int = 256) -> TaskResult:
    """Evaluate `model` (an `EmbeddingModel`) on `task` with embeddings taken as `view` says."""
    kind = TASK_TYPES[task.type]
    t0 = time.perf_counter()
    scores = kind.run(model, task, view, cache, RunOptions(use_faiss, chunk_size, query_block))
    elapsed = time.perf_counter() - t0
    # The length settings of moembed's own encoders are part of the result (long-context sweeps vary them).
    own = model if isinstance(model, Embedder) else None
    return TaskResult(
        task_name=task.name, task_type=task.type, split=task.split, scores=scores,
        main_score=scores[kind.main_score], evaluation_time=round(elapsed, 3),
        dim=view.dim or model.dim, precision=view.precision,
        max_length=own.max_length if own is not None else None,
        dynamic_ntk=own.config.dynamic_ntk if own is not None and own.config.position == "rotary" else None,
        extra={"protocol": task.protocol.name} if kind.protocols else {},
    )
