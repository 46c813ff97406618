"""Reranking: mean average precision (MAP) of each query's candidates ranked by similarity (MTEB Reranking).

Prefixes as in retrieval: "search_query" for the query, "search_document" for the candidates.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.metrics import average_precision_score

from moembed.errors import MoembedError
from moembed.eval import readers
from moembed.eval.encoding import EmbeddingCache, View, encode, similarity
from moembed.eval.task import RunOptions, Task, TaskType


class Reranking(TaskType):
    """`<split>.jsonl` {"query","positive":[...],"negative":[...]}."""

    name = "reranking"
    main_score = "map"
    query_prompt, document_prompt = "search_query", "search_document"
    detect_keys = frozenset({"query", "positive"})

    def read(self, path: Path, split: str) -> dict:
        f = path / f"{split}.jsonl"
        rows = []
        for i, r in readers.records(f, ("query", "positive", "negative")):
            lists = []
            for key in ("positive", "negative"):
                v = r[key]
                if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
                    raise MoembedError(f"{f}:{i}: {key!r} must be a list of strings")
                lists.append(v)
            if lists[0]:  # a query without positives has no defined average precision (MTEB skips it too)
                rows.append((readers.string(f, i, r, "query"), lists[0], lists[1]))
        readers.nonempty(f, rows)
        return {"rows": rows}

    def run(self, model, task: Task, view: View, cache: EmbeddingCache | None, options: RunOptions) -> dict[str, float]:
        rows = task.data["rows"]
        docs = [d for _, pos, neg in rows for d in pos + neg]
        q = encode(model, [r[0] for r in rows], self.query_prompt, view, cache)
        d = encode(model, docs, self.document_prompt, view, cache)
        aps, rrs, start = [], [], 0
        for i, (_, pos, neg) in enumerate(rows):
            n = len(pos) + len(neg)
            s = similarity(model, q[i : i + 1], d[start : start + n])[0]  # (n,)
            labels = np.array([1] * len(pos) + [0] * len(neg))
            aps.append(average_precision_score(labels, s) if neg else 1.0)
            first = np.flatnonzero(labels[np.argsort(-s, kind="stable")][:10])
            rrs.append(1.0 / (first[0] + 1) if len(first) else 0.0)
            start += n
        return {"map": float(np.mean(aps)), "mrr_at_10": float(np.mean(rrs))}

    def texts(self, data: dict) -> list[str]:
        return [x for r in data["rows"] for x in r[1] + r[2]]
