"""Evaluation on local task directories: MTEB task types, Matryoshka/precision sweeps, long context, reports.

    >>> from moembed.eval import evaluate
    >>> results = evaluate(model, ["data/dev/test"])          # list[TaskResult]
    >>> results[0].main_score                                 # nDCG@10 for a retrieval task

See docs/evaluation.md for the task layouts, metrics and prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from moembed.eval.encoding import EmbeddingCache, View
from moembed.eval.registry import TASK_TYPES, load_task
from moembed.eval.runner import TaskResult, run_task
from moembed.eval.task import Task


def evaluate(
    model,
    tasks: Sequence[str | Path | Task],
    dim: int | None = None,
    precision: str = "float32",
    batch_size: int = 32,
    cache_dir: str | Path | None = None,
    use_faiss: bool = False,
    chunk_size: int = 10_000,
    query_block: int = 256,
) -> list[TaskResult]:
    """Evaluate `model` (a `moembed.model.protocol.EmbeddingModel`) on task directories (or loaded Tasks); one
    TaskResult per task, in order.

    dim: Matryoshka truncation (None: full); precision: float32 | int8 | binary — for int8 a model without
    calibration is calibrated in place on the tasks' texts; cache_dir: reuse embeddings across runs;
    use_faiss: exact FAISS search for retrieval; chunk_size / query_block: corpus chunk and query block sizes
    of the bounded-memory retrieval search.
    """
    loaded = [t if isinstance(t, Task) else load_task(t) for t in tasks]
    cache = EmbeddingCache(cache_dir) if cache_dir else None
    if precision == "int8":
        from moembed.eval.encoding import MemoryCache
        from moembed.eval.sweep import ensure_int8

        # int8 ranges from the task texts when the model has none; the scoring reuses those embeddings
        cache = cache if cache is not None else MemoryCache()
        ensure_int8(model, loaded, cache, batch_size)
    view = View(dim, precision, batch_size)
    return [run_task(model, t, view, cache, use_faiss, chunk_size, query_block) for t in loaded]


__all__ = ["TASK_TYPES", "EmbeddingCache", "Task", "TaskResult", "View", "evaluate", "load_task"]
