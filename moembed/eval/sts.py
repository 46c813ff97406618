"""Semantic textual similarity: Spearman correlation of the model's similarity with gold scores (MTEB STS).

Both sentences get the "classification" prefix: STS is a symmetric task and nomic-embed-v1 §5.1 evaluates
non-retrieval MTEB tasks with the classification prefix; a model without that prompt gets no prefix.
"""

from __future__ import annotations

from scipy.stats import pearsonr, spearmanr

from moembed.eval.encoding import EmbeddingCache, View, encode, pairwise
from moembed.eval.task import Task

PROMPT = "classification"


def run_sts(model, task: Task, view: View, cache: EmbeddingCache | None = None) -> dict[str, float]:
    rows = task.data["rows"]
    a = encode(model, [r[0] for r in rows], PROMPT, view, cache)
    b = encode(model, [r[1] for r in rows], PROMPT, view, cache)
    sims = pairwise(model, a, b)  # (n,)
    gold = [r[2] for r in rows]
    return {"spearman": float(spearmanr(sims, gold).statistic), "pearson": float(pearsonr(sims, gold).statistic)}
