"""Hard-negative mining never returns a positive and respects Eq. 5 (whatever the sign of the positive's score);
FAISS and exact search agree; curation split across 2 real gloo ranks."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from typer.testing import CliRunner

from moembed import distributed
from moembed.cli.main import app
from moembed.data.corpora import read_dataset
from moembed.data.mining import MiningConfig, mine
from moembed.data.search import search, search_exact, search_faiss
from moembed.data.splits import clean_pairs
from moembed.data.teacher import embed


def _unit(x):
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_faiss_and_exact_search_agree():
    rng = np.random.default_rng(0)
    q, d = _unit(rng.normal(size=(300, 48))), _unit(rng.normal(size=(2500, 48)))
    s1, i1 = search_faiss(q, d, 10)
    s2, i2 = search_exact(q, d, 10, block=64)  # several blocks
    assert s1.shape == s2.shape == (300, 10)
    assert np.allclose(s1, s2, atol=1e-5) and (i1 == i2).mean() > 0.999  # continuous scores: no ties
    assert np.all(np.diff(s2, axis=1) <= 1e-7)  # best first
    assert np.allclose(s2, np.take_along_axis(q @ d.T, i2, axis=1), atol=1e-6)
    _, i3 = search(q, d[:4], 10, backend="exact")  # k larger than the corpus: clipped
    assert i3.shape == (300, 4) and set(i3[0]) == {0, 1, 2, 3}


def test_mining_excludes_positives_and_respects_margins():
    rng = np.random.default_rng(1)
    d = _unit(rng.normal(size=(200, 16)))
    # Queries near their documents; queries 0 and 1 are the same text with two positives (docs 0 and 1).
    own = np.array([0, 1, 2, 3, 4, 5])
    q = _unit(d[own] + 0.8 * rng.normal(size=(6, 16)))
    q[1] = q[0]
    positives = [{0, 1}, {0, 1}, {2}, {3}, {4}, {5}]
    # many near-duplicates of the positives: these are the candidates Eq. 5 must remove
    d[100:110] = _unit(d[0:10] + 0.05 * rng.normal(size=(10, 16)))
    for cfg in (MiningConfig(num_negatives=5), MiningConfig(num_negatives=5, margin=None, abs_margin=0.1),
                MiningConfig(num_negatives=5, margin=0.9, abs_margin=0.02)):
        idx, scores = mine(q, d, own, positives, cfg, backend="exact")
        pos = np.einsum("nd,nd->n", q, d[own])
        for i in range(6):
            assert 1 <= len(idx[i]) <= 5 and not set(idx[i]) & positives[i]
            assert all(b <= a + 1e-6 for a, b in zip(scores[i], scores[i][1:]))  # best first
            for j, s in zip(idx[i], scores[i]):
                assert abs(float(q[i] @ d[j]) - s) < 1e-5
                assert s <= cfg.threshold(pos[i : i + 1])[0] + 1e-6
    # without a margin the near-duplicates (false negatives) are the top candidates; with it they are gone
    q0 = _unit(d[:1] + 0.1 * rng.normal(size=(1, 16)))
    no_margin, _ = mine(q0, d, own[:1], [{0}], MiningConfig(num_negatives=3, margin=None), backend="exact")
    margin, _ = mine(q0, d, own[:1], [{0}], MiningConfig(num_negatives=3, margin=0.95), backend="exact")
    assert no_margin[0][0] == 100 and 100 not in margin[0] and len(margin[0]) == 3


def test_margin_keeps_negatives_below_a_negative_positive_score():
    # Eq. 5 for pos >= 0 (pos x 0.95); for pos < 0 the same gap of 5% of |pos| under the positive, never above it.
    cfg = MiningConfig(margin=0.95)
    pos = np.array([0.8, 0.0, -0.2, -1.0])
    np.testing.assert_allclose(cfg.threshold(pos), [0.76, 0.0, -0.21, -1.05])
    assert np.all(cfg.threshold(pos) <= pos)
    assert MiningConfig(margin=0.9, abs_margin=0.05).threshold(np.array([-0.2]))[0] == pytest.approx(-0.25)
    # End to end: the positive scores -0.6 (a poor teacher); the candidates at -0.1 and -0.58 rank above it and
    # must not be mined (pos x 0.95 = -0.57 would take -0.58); -0.7 is more than 5% of |pos| below it, -0.61 not.
    q = np.array([[1.0, 0.0]], np.float32)
    docs = _unit(np.array([[-0.6, 0.8], [-0.1, 0.995], [-0.58, 0.815], [-0.61, 0.792], [-0.7, 0.714]]))
    idx, scores = mine(q, docs, np.array([0]), [{0}], MiningConfig(num_negatives=4), backend="exact")
    assert idx == [[4]] and scores[0][0] == pytest.approx(-0.7, abs=1e-3)


def test_mine_command_output_format(tmp_path, make_tiny):
    model_dir = tmp_path / "model"
    make_tiny(seed=3).save(model_dir)
    pairs, _ = clean_pairs(read_dataset("chatterbot-english"))
    rows = [{"query": p.query, "document": p.document, "source": p.source, "lang": p.lang}
            for p in random.Random(0).sample(pairs, 80)]
    rows.append(dict(rows[0], document=rows[1]["document"]))  # a query with two positives
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(app, ["mine", str(data), "--teacher", str(model_dir), "--num-negatives", "4",
                                   "--margin", "0.95", "--out", str(tmp_path / "mined.jsonl")])
    assert res.exit_code == 0, res.output
    out = [json.loads(x) for x in (tmp_path / "mined.jsonl").read_text().splitlines()]
    assert len(out) == len(rows)  # no filtering asked
    positives = {}
    for r in rows:
        positives.setdefault(r["query"], set()).add(r["document"])
    from moembed.data.teacher import load_teacher

    teacher = load_teacher(model_dir)
    for r in out:
        assert set(r) == {"query", "document", "negatives", "negative_scores", "source", "lang"}
        assert len(r["negatives"]) <= 4 and len(r["negatives"]) == len(r["negative_scores"])
        assert not set(r["negatives"]) & positives[r["query"]]
    assert sum(len(r["negatives"]) for r in out) > len(out)  # a random teacher still finds some below Eq. 5
    r = max(out, key=lambda r: len(r["negatives"]))
    qv, dv = embed(teacher, [r["query"]], "query"), embed(teacher, [r["document"]] + r["negatives"], "document")
    scores = (qv @ dv.T)[0]
    assert np.allclose(scores[1:], r["negative_scores"], atol=1e-4) and np.all(scores[1:] <= 0.95 * scores[0] + 1e-5)


SPLIT_TEXTS = [f"sentence number {i} about topic {i % 3}" for i in range(7)]


def _curate_on_two_ranks(rank: int, world: int, port: int, model_dir: str, data: str, out: str) -> None:
    """One of 2 gloo ranks: embed SPLIT_TEXTS, then curate `data` (filter + mine); record what this rank embedded."""
    import os

    import torch

    from moembed.data.curate import CurateConfig, curate
    from moembed.model.embedder import Embedder

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    assert distributed.init_from_env(backend="gloo") and distributed.world_size() == 2 and distributed.rank() == rank
    try:
        emb = Embedder.load(model_dir)
        seen, real = [], emb.encode
        emb.encode = lambda texts, **kw: seen.extend(texts) or real(texts, **kw)
        x = embed(emb, SPLIT_TEXTS, "document")
        split_seen = list(seen)
        cfg = CurateConfig(shard_size=40, top_k=3, mining=MiningConfig(num_negatives=2))
        report = curate(data, f"{out}/kept.jsonl", emb, cfg, work_dir=f"{out}/work", show_progress=False)
        result = {"x": x.tolist(), "seen": split_seen, "curate_embedded": len(seen) - len(split_seen), "report": report}
        with open(f"{out}/rank{rank}.json", "w") as fh:
            json.dump(result, fh)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.dist
def test_curation_is_split_across_two_gloo_ranks(tmp_path, make_tiny):
    """On 2 real gloo ranks each rank embeds texts[rank::2]; the gathered embeddings, and the filtered and mined
    output rank 0 writes, equal those of one process doing everything."""
    import socket

    import torch.multiprocessing as mp

    from moembed.data.curate import CurateConfig, curate
    from moembed.model.embedder import Embedder

    model_dir = tmp_path / "model"
    make_tiny(seed=4).save(model_dir)
    emb = Embedder.load(model_dir)
    pairs, _ = clean_pairs(read_dataset("chatterbot-english"))
    rows = [{"query": p.query, "document": p.document, "source": p.source, "lang": p.lang}
            for p in random.Random(5).sample(pairs, 70)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen, real = [], emb.encode
    emb.encode = lambda texts, **kw: seen.extend(texts) or real(texts, **kw)
    full = embed(emb, SPLIT_TEXTS, "document")
    cfg = CurateConfig(shard_size=40, top_k=3, mining=MiningConfig(num_negatives=2))
    ref = curate(data, tmp_path / "ref.jsonl", emb, cfg, work_dir=tmp_path / "ref-work", show_progress=False)
    single_embedded = len(seen) - len(SPLIT_TEXTS)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ranks"
    out.mkdir()
    mp.spawn(_curate_on_two_ranks, args=(2, port, str(model_dir), str(data), str(out)), nprocs=2, join=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    for r, res in enumerate(ranks):
        assert res["seen"] == SPLIT_TEXTS[r::2]  # this rank embedded its slice only
        assert np.abs(np.array(res["x"], np.float32) - full).max() < 1e-5  # gathered in input order, on every rank
        assert 0 < res["curate_embedded"] < single_embedded
    assert ranks[0]["curate_embedded"] + ranks[1]["curate_embedded"] == single_embedded  # no text embedded twice
    report = ranks[0]["report"]  # rank 0 searches, writes and reports
    assert report["sources"] == ref["sources"] and report["kept"] == ref["kept"] and report["pairs"] == len(rows)
    got = [json.loads(x) for x in (out / "kept.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (tmp_path / "ref.jsonl").read_text().splitlines()]
    assert 0 < len(got) == len(want) < len(rows)
    for g, w in zip(got, want):
        drop = lambda r: {k: v for k, v in r.items() if k != "negative_scores"}  # noqa: E731
        assert drop(g) == drop(w)
        assert np.allclose(g["negative_scores"], w["negative_scores"], atol=1e-5)


def test_config_errors_name_the_key():
    from pydantic import ValidationError

    from moembed.data.curate import CurateConfig

    with pytest.raises(ValidationError, match="num_negatives"):
        MiningConfig(num_negatives=0)
    with pytest.raises(ValidationError, match="nothing to do"):
        CurateConfig(top_k=None, mining=None)
    with pytest.raises(ValidationError, match="backend"):
        CurateConfig(backend="annoy")
