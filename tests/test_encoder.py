"""Encoder: parity with transformers' BertModel on real weights, RoPE / Dynamic NTK, padding invariance."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moembed.model.config import EncoderConfig, MoEConfig, pad_vocab
from moembed.model.presets import nomic_config, tiny_config
from moembed.model.encoder import Encoder
from moembed.model.rope import apply_rope, ntk_base, rope_cos_sin

TEXTS = [
    "The Senate confirmed the nominee after a tie-breaking vote.",
    "Sparse mixture-of-experts layers route each token to two of eight experts.",
    "",
    "a",
]


@pytest.mark.real
def test_bert_parity_with_transformers(minilm_path, minilm):
    from transformers import AutoTokenizer, BertModel

    ref = BertModel.from_pretrained(str(minilm_path), attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(str(minilm_path))
    b = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = ref(**b).last_hidden_state
        got = minilm.encoder(b["input_ids"], b["attention_mask"], b["token_type_ids"]).last_hidden_state
    mask = b["attention_mask"].bool()
    assert (want[mask] - got[mask]).abs().max().item() < 1e-5
    assert got[~mask].abs().max().item() == 0.0  # padding positions are zeros, never computed


@pytest.mark.real
def test_bert_gradients_match_transformers(minilm_path):
    """Backward parity on real weights: transformers' BertModel gradients, renamed by the converter, equal moembed's
    (the fused qkv projection's included, and the packed layout's: padding removed before every linear layer)."""
    from transformers import AutoTokenizer, BertModel

    from moembed.model.embedder import Embedder
    from moembed.model.families.bert import CONVERTER

    ref = BertModel.from_pretrained(str(minilm_path), attn_implementation="eager", add_pooling_layer=False).eval()
    emb = Embedder.load(minilm_path)  # its own copy: the session's `minilm` must not collect gradients
    emb.encoder.eval()
    b = AutoTokenizer.from_pretrained(str(minilm_path))(TEXTS, padding=True, return_tensors="pt")
    mask = b["attention_mask"].bool()
    want = ref(**b).last_hidden_state
    got = emb.encoder(b["input_ids"], b["attention_mask"], b["token_type_ids"]).last_hidden_state
    r = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want[mask] * r[mask]).sum().backward()
    (got[mask] * r[mask]).sum().backward()
    theirs = CONVERTER.weights_from_hf({n: p.grad for n, p in ref.named_parameters()}, emb.config)
    mine = {n: p.grad for n, p in emb.encoder.named_parameters()}
    assert set(mine) <= set(theirs)
    for n, g in mine.items():
        scale = theirs[n].abs().max().item()  # float32 sums over the batch: relative to the largest entry
        torch.testing.assert_close(g, theirs[n], atol=1e-5 * scale, rtol=1e-4, msg=n)


def _reference_rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half RoPE written from the definition: channel j pairs with j + D/2, angle t · base^(-2j/D)."""
    B, H, T, D = x.shape
    out = torch.empty_like(x)
    for t in range(T):
        for j in range(D // 2):
            theta = t * base ** (-2 * j / D)
            c, s = math.cos(theta), math.sin(theta)
            a, b = x[..., t, j], x[..., t, j + D // 2]
            out[..., t, j] = a * c - b * s
            out[..., t, j + D // 2] = a * s + b * c
    return out


def test_rope_matches_definition():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 7, 8, dtype=torch.float64)
    cos, sin = rope_cos_sin(7, 8, 10_000.0, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, cos, sin), _reference_rope(x, 10_000.0))


def test_rope_relative_position_property():
    # <R_m q, R_n k> depends only on m - n: the reason rotary positions generalise.
    torch.manual_seed(0)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    cos, sin = rope_cos_sin(20, 8, 10_000.0, dtype=torch.float64)
    rot = lambda v, t: apply_rope(v.view(1, 1, 1, 8), cos[t : t + 1], sin[t : t + 1]).flatten()  # noqa: E731
    assert torch.allclose(rot(q, 3) @ rot(k, 1), rot(q, 12) @ rot(k, 10))


def test_dynamic_ntk_formula():
    # nomic-embed-v1 Eq. 5: b' = b * ((α s) − (α − 1))^(D / (D − 2)), s = l / L; unchanged for l <= L.
    assert ntk_base(10_000.0, 64, 2048, 2048, 2.0) == 10_000.0
    assert ntk_base(10_000.0, 64, 100, 2048, 2.0) == 10_000.0
    s = 8192 / 2048
    assert ntk_base(10_000.0, 64, 8192, 2048, 2.0) == pytest.approx(10_000.0 * (2 * s - 1) ** (64 / 62))


def test_dynamic_ntk_applies_only_at_inference_beyond_trained_length():
    cfg = tiny_config("nomic", max_position=8)
    enc = Encoder(cfg)
    enc.eval()
    full = lambda n: torch.ones(1, n, dtype=torch.bool)  # noqa: E731
    cos_short, _ = enc.batch_rotary_tables(full(8), torch.float32)
    cos_long, _ = enc.batch_rotary_tables(full(16), torch.float32)
    want_long, _ = rope_cos_sin(16, cfg.head_dim, ntk_base(cfg.rope_base, cfg.head_dim, 16, 8, cfg.ntk_alpha))
    torch.testing.assert_close(cos_short, rope_cos_sin(8, cfg.head_dim, cfg.rope_base)[0])
    torch.testing.assert_close(cos_long[0, 0], want_long)
    enc.train()  # training never rescales
    plain, _ = rope_cos_sin(16, cfg.head_dim, cfg.rope_base)
    torch.testing.assert_close(enc.batch_rotary_tables(full(16), torch.float32)[0], plain)
    enc.eval()
    ids = torch.randint(1, cfg.vocab_size, (2, 16))
    assert enc(ids).last_hidden_state.shape == (2, 16, cfg.hidden_size)  # longer than trained: still runs


def _sharp_nomic(make_tiny):
    """A tiny NomicBERT-style (rotary) embedder trained to 16 positions, its attention sharpened: positions matter."""
    emb = make_tiny("nomic", max_position=16, max_length=64)
    d = emb.config.hidden_size
    with torch.no_grad():
        for layer in emb.encoder.layers:
            layer.qkv.weight[: 2 * d] *= 15.0  # q and k rows (std 0.3): attention logits x225
            layer.qkv.weight[2 * d :] *= 10.0  # v rows, and the output projection: attention outweighs the residual
            layer.out.weight *= 3.0
    return emb


def test_dynamic_ntk_base_is_per_sequence(make_tiny):
    """nomic-embed-v1 Eq. 5 with l = the text's own length: batch-mates longer than L must not change a text."""
    emb = _sharp_nomic(make_tiny)
    short, medium = "sparse experts route tokens", " ".join(["the history of science"] * 5)  # 7 and 22 tokens
    long = " ".join(["computers were once rooms full of valves"] * 6)  # longer still
    tok, enc = emb.tokenizer, emb.encoder
    lengths = [int(tok([t]).attention_mask.sum()) for t in (short, medium, long)]
    assert lengths[0] <= 16 < lengths[1] < lengths[2]
    batch = tok([short, medium, long])
    with torch.no_grad():
        together = enc(batch.input_ids, batch.attention_mask).last_hidden_state
        for row, text in enumerate((short, medium, long)):
            alone = enc(tok([text]).input_ids).last_hidden_state[0]
            torch.testing.assert_close(together[row, : lengths[row]], alone, rtol=1e-5, atol=1e-5)
        # the test can fail: in this model the short text is far from itself under a rescaled base (as if L were 4)
        emb.config.max_position = 4
        try:
            rescaled = enc(tok([short]).input_ids).last_hidden_state[0]
        finally:
            emb.config.max_position = 16
        assert (rescaled - together[0, : lengths[0]]).abs().max() > 1e-2
    vecs = emb.encode([short, medium, long], batch_size=3)
    for i, text in enumerate((short, medium, long)):
        np.testing.assert_allclose(emb.encode([text])[0], vecs[i], atol=1e-5)


def test_training_positions_are_never_rescaled(make_tiny):
    """Dynamic NTK is off in training: a batch longer than L sees the trained base, as with dynamic_ntk off."""
    emb = _sharp_nomic(make_tiny)
    enc = emb.encoder
    batch = emb.tokenizer(["sparse experts route tokens", " ".join(["computers were once rooms of valves"] * 6)])
    assert batch.input_ids.shape[1] > 16
    enc.train()
    trained = enc(batch.input_ids, batch.attention_mask).last_hidden_state
    enc.eval()
    enc.config.dynamic_ntk = False
    try:
        with torch.no_grad():
            plain = enc(batch.input_ids, batch.attention_mask).last_hidden_state
    finally:
        enc.config.dynamic_ntk = True
    torch.testing.assert_close(trained.detach(), plain, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert (enc(batch.input_ids, batch.attention_mask).last_hidden_state - plain).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["bert", "nomic"])
def test_padding_does_not_change_outputs(family):
    torch.manual_seed(0)
    cfg = tiny_config(family)
    enc = Encoder(cfg).eval()
    ids = torch.randint(1, cfg.vocab_size, (1, 5))
    alone = enc(ids).last_hidden_state[0]
    padded = torch.cat([ids, torch.zeros(1, 6, dtype=torch.long)], 1)
    other = torch.randint(1, cfg.vocab_size, (1, 11))
    batch = torch.cat([padded, other])
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[0, 5:] = False
    together = enc(batch, mask).last_hidden_state[0, :5]
    torch.testing.assert_close(alone, together, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["bert", "nomic"])
def test_attention_padding_copies_of_real_rows_change_nothing(family, monkeypatch):
    """Attention's padded positions hold copies of real rows (`_Context.pad_keys`), not zeros: outputs and
    gradients are those of zero padding, bit for bit, and the copies really are there (not zeros)."""
    from moembed.model import encoder as encoder_module

    torch.manual_seed(0)
    enc = Encoder(tiny_config(family)).eval()
    ids = torch.randint(1, enc.config.vocab_size, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[0, 4:], mask[2, 7:] = False, False

    def run():
        enc.zero_grad(set_to_none=True)
        out = enc(ids, mask).packed_hidden
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), [p.grad.clone() for p in enc.parameters() if p.grad is not None]

    ctx = encoder_module._Context(mask)
    x = torch.randn(int(mask.sum()), 6)
    padded = ctx.pad_keys(x)
    assert torch.equal(padded[mask], x) and (padded[~mask] != 0).all()
    copies, copies_grads = run()
    monkeypatch.setattr(encoder_module._Context, "pad_keys", encoder_module._Context.pad)  # zeros at padding
    zeros, zeros_grads = run()
    assert torch.equal(copies, zeros)
    assert len(copies_grads) == len(zeros_grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(copies_grads, zeros_grads))


def test_nomic_family_shape_and_backward():
    cfg = nomic_config(vocab_size=1000, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, max_position=16)
    assert cfg.vocab_size == pad_vocab(1000) == 1024  # padded to a multiple of 64
    assert (cfg.position, cfg.mlp, cfg.bias, cfg.hidden_dropout) == ("rotary", "swiglu", False, 0.0)
    enc = Encoder(cfg)
    assert enc.embeddings.position is None
    assert enc.layers[0].mlp.fc1.weight.shape == (2 * 48, 32)
    out = enc(torch.randint(0, 1000, (2, 6)), torch.tensor([[1] * 6, [1] * 3 + [0] * 3]))
    out.packed_hidden.sum().backward()
    assert all(p.grad is not None for n, p in enc.named_parameters() if "token_type" not in n)


def test_config_errors_name_the_key():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="hidden_size"):
        EncoderConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValidationError, match="no_such_key"):
        EncoderConfig(no_such_key=1)
    with pytest.raises(ValidationError, match="top_k"):
        MoEConfig(num_experts=2, top_k=3)
    assert MoEConfig().layer_indices(6) == [1, 3, 5]  # every second layer from the second (Nomic v2)


def test_absolute_positions_refuse_overlong_input():
    enc = Encoder(tiny_config("bert", max_position=8))
    with pytest.raises(ValueError, match="max_position"):
        enc(torch.ones(1, 9, dtype=torch.long))


# ---- built for a checkpoint: no random initial values ------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "nomic"])
def test_for_weights_draws_no_random_values(family):
    # Encoder(config) draws its initial weights from torch's generator; for_weights, whose every weight a checkpoint
    # overwrites, draws none, on the CPU or on the meta device, and leaves the initialisers working afterwards.
    cfg = tiny_config(family, moe=MoEConfig(num_experts=4, top_k=2, layers=[1]))
    state = torch.random.get_rng_state()
    Encoder(cfg)
    assert not torch.equal(torch.random.get_rng_state(), state)
    state = torch.random.get_rng_state()
    built = Encoder.for_weights(cfg)
    with torch.device("meta"):
        meta = Encoder.for_weights(cfg)
    assert torch.equal(torch.random.get_rng_state(), state)
    shapes = [{k: v.shape for k, v in m.state_dict().items()} for m in (built, meta, Encoder(cfg))]
    assert shapes[0] == shapes[1] == shapes[2]
    assert not torch.equal(torch.random.get_rng_state(), state)


def test_for_weights_skips_initialisers_in_its_own_thread_only():
    import threading

    from moembed.model.encoder import _NoRandomInit

    drew = []

    def build():  # another thread, while this one is inside the mode: initialised as usual
        before = torch.random.get_rng_state()
        torch.nn.Linear(8, 8)
        drew.append(not torch.equal(torch.random.get_rng_state(), before))

    with _NoRandomInit():
        state = torch.random.get_rng_state()
        torch.nn.Linear(8, 8)
        assert torch.equal(torch.random.get_rng_state(), state)
        t = threading.Thread(target=build)
        t.start()
        t.join()
    assert drew == [True]
