"""Run one loaded task on one model view and return a TaskResult."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from moembed.eval.encoding import EmbeddingCache, View
from moembed.eval.task import Task

# MTEB's main score per task type.
MAIN_SCORE = {
    "retrieval": "ndcg_at_10",
    "sts": "spearman",
    "classification": "accuracy",
    "clustering": "v_measure",
    "pair_classification": "ap",
    "reranking": "map",
}


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
    """Evaluate `model` on `task` with embeddings taken as `view` says."""
    from moembed.eval.classification import run_classification
    from moembed.eval.clustering import run_clustering
    from moembed.eval.pair_classification import run_pairs
    from moembed.eval.reranking import run_reranking
    from moembed.eval.retrieval import run_retrieval
    from moembed.eval.sts import run_sts

    t0 = time.perf_counter()
    if task.type == "retrieval":
        scores = run_retrieval(model, task, view, cache, chunk_size, query_block, use_faiss)
    else:
        fn = {"sts": run_sts, "classification": run_classification, "clustering": run_clustering,
              "pair_classification": run_pairs, "reranking": run_reranking}[task.type]
        scores = fn(model, task, view, cache)
    elapsed = time.perf_counter() - t0
    tok = getattr(model, "tokenizer", None)
    cfg = getattr(getattr(model, "encoder", None), "config", None)
    return TaskResult(
        task_name=task.name, task_type=task.type, split=task.split, scores=scores,
        main_score=scores[MAIN_SCORE[task.type]], evaluation_time=round(elapsed, 3),
        dim=view.dim or getattr(model, "dim", None), precision=view.precision,
        max_length=getattr(tok, "max_length", None),
        dynamic_ntk=getattr(cfg, "dynamic_ntk", None) if getattr(cfg, "position", None) == "rotary" else None,
    )
