"""Ranking metrics as trec_eval / MTEB define them (checked against pytrec_eval in the tests).

run: {query_id: {doc_id: score}}; qrels: {query_id: {doc_id: graded relevance}}. Documents are ranked by
score, descending; ties broken by doc id, descending, as trec_eval does. A document is relevant when its
grade is > 0. nDCG uses the grade itself as gain (trec_eval's ndcg_cut, which MTEB reports) and an ideal
ranking of all judged documents; queries without a relevant document are not averaged (BEIR convention).
"""

from __future__ import annotations

import math

import numpy as np


def ranked(scores: dict[str, float]) -> list[str]:
    """Doc ids by descending score, ties by descending id (trec_eval order)."""
    return [d for d, _ in sorted(scores.items(), key=lambda x: (x[1], x[0]), reverse=True)]


def ndcg_at_k(ranking: list[str], rel: dict[str, int], k: int) -> float:
    dcg = sum(max(rel.get(d, 0), 0) / math.log2(i + 2) for i, d in enumerate(ranking[:k]))
    ideal = sorted((g for g in rel.values() if g > 0), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def mrr_at_k(ranking: list[str], rel: dict[str, int], k: int) -> float:
    for i, d in enumerate(ranking[:k]):
        if rel.get(d, 0) > 0:
            return 1.0 / (i + 1)
    return 0.0


def recall_at_k(ranking: list[str], rel: dict[str, int], k: int) -> float:
    relevant = {d for d, g in rel.items() if g > 0}
    return len(relevant.intersection(ranking[:k])) / len(relevant) if relevant else 0.0


def retrieval_scores(run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]]) -> dict[str, float]:
    """Mean nDCG@{1,10}, MRR@10, Recall@{10,100} over queries with at least one relevant document."""
    keys = ("ndcg_at_1", "ndcg_at_10", "mrr_at_10", "recall_at_10", "recall_at_100")
    per: dict[str, list[float]] = {k: [] for k in keys}
    for qid, rel in qrels.items():
        if not any(g > 0 for g in rel.values()):
            continue
        r = ranked(run.get(qid, {}))
        per["ndcg_at_1"].append(ndcg_at_k(r, rel, 1))
        per["ndcg_at_10"].append(ndcg_at_k(r, rel, 10))
        per["mrr_at_10"].append(mrr_at_k(r, rel, 10))
        per["recall_at_10"].append(recall_at_k(r, rel, 10))
        per["recall_at_100"].append(recall_at_k(r, rel, 100))
    return {k: float(np.mean(v)) if v else 0.0 for k, v in per.items()}
