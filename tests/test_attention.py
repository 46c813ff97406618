"""Attention's precision rule (`moembed.model.attention`): a bf16 call in training (train mode or recorded by
autograd), on a CPU without AMX, runs the kernel in float32 and equals float32 attention of the same bf16 inputs,
forward and backward, under autocast too; elsewhere (inference, AMX, MOEMBED_NO_FASTPATH=1, float32 inputs) the
input's dtype runs. The encoder records which one ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moembed.model.attention as attention
from moembed.model.attention import attend, compute_dtype
from moembed.model.encoder import Encoder
from moembed.model.presets import tiny_config


def _inputs(B=3, H=2, T=7, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, hd, generator=g) for _ in range(3))
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
    mask[1, ..., 4:] = False  # a padded sequence
    mask[2, ..., 1:] = False  # a one-token sequence
    return q, k, v, mask


def _equation(q, k, v, mask):
    """softmax(q kᵀ / √hd + mask) v, the definition (Vaswani et al. 2017, Eq. 1), in float64."""
    s = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v.double()


@pytest.fixture
def upcast(monkeypatch):
    monkeypatch.setattr(attention, "_UPCAST_PAYS", True)
    monkeypatch.delenv("MOEMBED_NO_FASTPATH", raising=False)


def test_compute_dtype_rule(monkeypatch, upcast):
    bf = torch.zeros(1, dtype=torch.bfloat16, requires_grad=True)
    assert compute_dtype(bf) == torch.float32
    assert compute_dtype(bf.detach()) == torch.bfloat16  # inference keeps bf16
    assert compute_dtype(bf.detach(), training=True) == torch.float32  # GradCache's no-grad pass, as its replay
    with torch.no_grad():
        assert compute_dtype(bf * 1) == torch.bfloat16
    assert compute_dtype(torch.zeros(1)) == torch.float32
    assert compute_dtype(torch.zeros(1, dtype=torch.float16, requires_grad=True)) == torch.float16  # not measured
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "1")
    assert compute_dtype(bf) == torch.bfloat16
    monkeypatch.delenv("MOEMBED_NO_FASTPATH")
    monkeypatch.setattr(attention, "_UPCAST_PAYS", False)  # an AMX CPU
    assert compute_dtype(bf) == torch.bfloat16


def test_upcast_rule_follows_amx(monkeypatch):
    monkeypatch.setattr(attention, "cpu_flags", lambda: {"amx_bf16": True, "avx512_bf16": True})
    assert attention._upcast_pays() is False
    monkeypatch.setattr(attention, "cpu_flags", lambda: {"amx_bf16": False, "avx512_bf16": True})
    assert attention._upcast_pays() is True


@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_runs_in_float32_forward_and_backward(upcast, autocast):
    q, k, v, mask = _inputs()
    mine = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    ref = [t.bfloat16().float().requires_grad_() for t in (q, k, v)]  # the same bf16 values, in float32
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, dtype = attend(*mine, mask)
    assert dtype == torch.float32 and out.dtype == torch.bfloat16
    want = F.scaled_dot_product_attention(*ref, attn_mask=mask)
    assert torch.equal(out, want.bfloat16())  # the float32 kernel's result, rounded once
    out.backward(g)
    want.backward(g.float())
    for a, b in zip(mine, ref, strict=True):
        assert a.grad.dtype == torch.bfloat16
        assert torch.equal(a.grad, b.grad.bfloat16())
    # and the float32 kernel is the equation, on the real (unmasked) query rows
    exact = _equation(*ref, mask)
    assert (want.double() - exact).abs().max().item() < 1e-5


def test_native_dtype_where_upcast_does_not_pay(monkeypatch):
    monkeypatch.setattr(attention, "_UPCAST_PAYS", False)
    q, k, v, mask = (t.bfloat16().requires_grad_() if t.dtype == torch.float32 else t for t in _inputs())
    out, dtype = attend(q, k, v, mask)
    assert dtype == torch.bfloat16
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_float32_unchanged(upcast):
    q, k, v, mask = _inputs()
    out, dtype = attend(q, k, v, mask)
    assert dtype == torch.float32
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_encoder_records_the_precision_and_matches_float32(upcast):
    torch.manual_seed(0)
    enc = Encoder(tiny_config()).train()
    ids = torch.randint(5, 100, (4, 9))
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[1, 5:] = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        out = enc(ids, mask).packed_hidden
    assert all(layer.last_attention_dtype == torch.float32 for layer in enc.layers)
    out.float().sum().backward()
    assert all(layer.qkv.weight.grad is not None and layer.qkv.weight.grad.abs().sum() > 0 for layer in enc.layers)
    torch.manual_seed(1)
    full = enc(ids, mask).packed_hidden  # float32 throughout, same dropout masks
    assert all(layer.last_attention_dtype == torch.float32 for layer in enc.layers)
    assert torch.nn.functional.cosine_similarity(out.float(), full, dim=-1).min().item() > 0.99
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        enc(ids, mask)  # GradCache's first pass: no gradient, still training
    assert all(layer.last_attention_dtype == torch.float32 for layer in enc.layers)
    enc.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        enc(ids, mask)
    assert all(layer.last_attention_dtype == torch.bfloat16 for layer in enc.layers)  # inference: bf16 kernel
