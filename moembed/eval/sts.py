"""Semantic textual similarity: Spearman correlation of the model's similarity with gold scores (MTEB STS).

Both sentences get the "classification" prefix: STS is a symmetric task and nomic-embed-v1 §5.1 evaluates
non-retrieval MTEB tasks with the classification prefix; a model without that prompt gets no prefix.
"""

from __future__ import annotations

from pathlib import Path

from scipy.stats import pearsonr, spearmanr

from moembed.eval import readers
from moembed.eval.encoding import EmbeddingCache, View
from moembed.eval.task import RunOptions, SentencePairType, Task


class STS(SentencePairType):
    """`<split>.jsonl` {"sentence1","sentence2","score"} (score a number)."""

    name = "sts"
    main_score = "spearman"
    query_prompt = document_prompt = "classification"
    detect_keys = frozenset({"sentence1", "sentence2", "score"})

    def read(self, path: Path, split: str) -> dict:
        f = path / f"{split}.jsonl"
        rows = [
            (readers.string(f, i, r, "sentence1"), readers.string(f, i, r, "sentence2"), readers.number(f, i, r, "score"))
            for i, r in readers.records(f, ("sentence1", "sentence2", "score"))
        ]
        readers.nonempty(f, rows)
        return {"rows": rows}

    def run(self, model, task: Task, view: View, cache: EmbeddingCache | None, options: RunOptions) -> dict[str, float]:
        sims = self.similarities(model, task, view, cache)  # (n,)
        gold = [r[2] for r in task.data["rows"]]
        return {"spearman": float(spearmanr(sims, gold).statistic), "pearson": float(pearsonr(sims, gold).statistic)}
