"""Evaluation metrics against reference libraries (pytrec_eval, sklearn) and blockwise search vs brute force."""

from __future__ import annotations

import numpy as np
import pytest
import pytrec_eval

from moembed.eval.metrics import retrieval_scores
from moembed.eval.pair_classification import best_accuracy
from moembed.eval.retrieval import search


def _random_case(seed: int, n_q: int = 12, n_d: int = 150):
    rng = np.random.default_rng(seed)
    run, qrels = {}, {}
    for q in range(n_q):
        scores = rng.permutation(n_d * 3)[:n_d] / 7.0  # distinct scores
        run[f"q{q}"] = {f"d{d}": float(s) for d, s in enumerate(scores)}
        rel = rng.choice(n_d, size=rng.integers(1, 8), replace=False)
        qrels[f"q{q}"] = {f"d{d}": int(rng.integers(0, 3)) for d in rel}  # graded, some 0 (judged non-relevant)
        qrels[f"q{q}"][f"d{rel[0]}"] = 2  # at least one relevant per query
    return run, qrels


def _top(run, k):
    return {q: dict(sorted(d.items(), key=lambda x: -x[1])[:k]) for q, d in run.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_retrieval_metrics_match_pytrec_eval(seed):
    run, qrels = _random_case(seed)
    ours = retrieval_scores(run, qrels)
    ev = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.1,10", "recall.10,100"})
    ref = ev.evaluate(run)
    # MRR@10 is trec_eval's reciprocal rank over the run cut to its top 10
    rr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(_top(run, 10))
    for ours_key, ref_key, res in [
        ("ndcg_at_10", "ndcg_cut_10", ref),
        ("ndcg_at_1", "ndcg_cut_1", ref),
        ("recall_at_100", "recall_100", ref),
        ("recall_at_10", "recall_10", ref),
        ("mrr_at_10", "recip_rank", rr),
    ]:
        expected = np.mean([res[q][ref_key] for q in qrels])
        assert ours[ours_key] == pytest.approx(expected, abs=1e-9), ours_key
    assert 0 < ours["ndcg_at_10"] < 1


def test_ties_follow_trec_eval_order():
    run = {"q": {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.5}}
    for rel_doc in "abcd":
        qrels = {"q": {rel_doc: 1}}
        ref = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recip_rank"}).evaluate(run)["q"]
        ours = retrieval_scores(run, qrels)
        assert ours["ndcg_at_10"] == pytest.approx(ref["ndcg_cut_10"])
        assert ours["mrr_at_10"] == pytest.approx(ref["recip_rank"])


def _chunks(d, size):
    return [(s, d[s : s + size]) for s in range(0, len(d), size)]


class _Cos:
    dim = 16


@pytest.mark.parametrize("chunk,block,k", [(7, 3, 5), (50, 64, 100), (1000, 1, 20)])
def test_blockwise_search_equals_brute_force(chunk, block, k):
    rng = np.random.default_rng(0)
    q, d = rng.normal(size=(23, 16)).astype(np.float32), rng.normal(size=(137, 16)).astype(np.float32)
    qn, dn = q / np.linalg.norm(q, axis=1, keepdims=True), d / np.linalg.norm(d, axis=1, keepdims=True)
    full = qn @ dn.T  # (23, 137)
    ref_i = np.argsort(-full, axis=1, kind="stable")[:, :k]
    s, i = search(_Cos(), q, _chunks(d, chunk), k=k, query_block=block)
    assert s.shape == (23, min(k, 137)) and i.shape == s.shape
    np.testing.assert_array_equal(i, ref_i)
    np.testing.assert_allclose(s, np.take_along_axis(full, ref_i, 1), rtol=1e-5, atol=1e-6)
    fs, fi = search(_Cos(), q, _chunks(d, chunk), k=k, use_faiss=True)
    np.testing.assert_array_equal(fi, ref_i)


def test_search_uses_model_similarity():
    class Neg:
        def similarity(self, a, b):
            return -(a @ b.T)

    rng = np.random.default_rng(1)
    q, d = rng.normal(size=(4, 8)), rng.normal(size=(30, 8))
    _, i = search(Neg(), q, _chunks(d, 9), k=3, query_block=2)
    np.testing.assert_array_equal(i, np.argsort(q @ d.T, axis=1, kind="stable")[:, :3])


def test_best_accuracy_matches_threshold_scan():
    rng = np.random.default_rng(3)
    s, y = rng.normal(size=60), rng.integers(0, 2, size=60)
    ref = max(((s >= t) == y).mean() for t in np.concatenate([s, [np.inf]]))
    assert best_accuracy(s, y) == pytest.approx(ref)
