"""Attention's precision rule (`moembed.model.attention`): a bf16 call in training (train mode or recorded by
autograd), on a CPU without AMX, runs the kernel in float32 and equals float32 attention of the same bf16 inputs,
forward and backward, under autocast too; elsewhere (inference, AMX, every fast path off in the settings, float32
inputs) the input's dtype runs. The encoder records which one ran."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import moembed.model.attention as attention
from moembed.model import cpu, kernels
from moembed.model.attention import attend, compute_dtype
from moembed.model.encoder import Encoder
from moembed.model.presets import tiny_config
from moembed.model.settings import Settings, apply

ON = Settings("on")  # every fast path on wherever it exists, whatever this CPU's default
attend_on = functools.partial(attend, settings=ON)


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
    monkeypatch.setattr(cpu, "amx_bf16", lambda: False)
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
    assert compute_dtype(bf, settings=Settings("off")) == torch.bfloat16
    monkeypatch.setattr(cpu, "amx_bf16", lambda: True)  # an AMX CPU
    assert compute_dtype(bf) == torch.bfloat16


def test_upcast_rule_follows_amx(monkeypatch):
    monkeypatch.setattr(cpu, "flags", lambda: {"amx_bf16": True, "avx512_bf16": True})
    assert Settings().upcast_attention() is False
    monkeypatch.setattr(cpu, "flags", lambda: {"amx_bf16": False, "avx512_bf16": True})
    assert Settings().upcast_attention() is True


@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_runs_in_float32_forward_and_backward(upcast, autocast):
    q, k, v, mask = _inputs()
    mine = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    ref = [t.bfloat16().float().requires_grad_() for t in (q, k, v)]  # the same bf16 values, in float32
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, dtype, _ = attend(*mine, mask)
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
    monkeypatch.setattr(cpu, "amx_bf16", lambda: True)
    q, k, v, mask = (t.bfloat16().requires_grad_() if t.dtype == torch.float32 else t for t in _inputs())
    out, dtype, _ = attend(q, k, v, mask)
    assert dtype == torch.bfloat16
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_float32_unchanged(upcast):
    q, k, v, mask = _inputs()
    out, dtype, _ = attend(q, k, v, mask)
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


# ---- compiled attention (CPU inference) --------------------------------------------------------------------------

_no_compiler = pytest.mark.skipif(not kernels.available("attention"), reason="no C compiler builds attention.c here")


def needs_compiled(test):
    """A test of the compiled kernel: switched on (`ON`; MOEMBED_NO_FASTPATH=0 for encoders built in the test), so
    that it runs on every CPU with a C compiler, AVX2-only ones included, where it is off by default."""
    return _no_compiler(pytest.mark.usefixtures("compiled_on")(test))


@pytest.fixture
def compiled_on(monkeypatch):
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "0")


def _qkv_views(B, T, H, hd, seed=0):
    """q, k, v (B, H, T, hd) as the encoder has them: strided views into one (B, T, 3·H·hd) projection."""
    qkv = torch.randn(B, T, 3 * H * hd, generator=torch.Generator().manual_seed(seed))
    return qkv.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)


@needs_compiled
@pytest.mark.parametrize("hd", [32, 64])
@pytest.mark.parametrize("T", [1, 7, 31, 32, 33, 100])
def test_compiled_attention_is_the_equation_on_real_rows_and_zero_elsewhere(hd, T):
    q, k, v = _qkv_views(3, T, 2, hd)
    lengths = torch.tensor([T, max(T // 2, 1), 1])
    mask = (torch.arange(T) < lengths[:, None])[:, None, None, :]
    with torch.no_grad():
        out, dtype, kernel = attend_on(q, k, v, mask, lengths=lengths)
    assert kernel == "compiled" and dtype == torch.float32 and out.shape == q.shape
    real = mask[:, 0, 0, :, None].expand(-1, -1, hd)  # (B, T, hd): the real query rows
    exact = _equation(q, k, v, mask)
    for h in range(2):
        assert (out[:, h] - exact[:, h])[real].abs().max().item() < 2e-6
        assert out[:, h][~real].eq(0).all()
    torch_out, _, torch_kernel = attend_on(q, k, v, mask)  # no lengths: torch's kernel
    assert torch_kernel == "torch"
    assert (out - torch_out)[real[:, None].expand(-1, 2, -1, -1)].abs().max().item() < 2e-6


@needs_compiled
@pytest.mark.parametrize("length", [5, 16, 21])
def test_compiled_softmax_shifts_by_the_largest_real_score(length):
    # Every real score near -120 (below exp's range): the softmax must subtract the largest of the sequence's own
    # scores, not of the zero scores that padded key lanes of its tiles hold, or every weight would underflow alike.
    g = torch.Generator().manual_seed(7)
    q = torch.ones(1, 1, length, 32) * 4.0
    k = -torch.ones(1, 1, length, 32) * (120 * 32**0.5 / (4.0 * 32)) + 0.3 * torch.randn(1, 1, length, 32, generator=g)
    v = torch.randn(1, 1, length, 32, generator=g)
    with torch.no_grad():
        out, _, kernel = attend_on(q, k, v, None, lengths=torch.tensor([length]))
    scores = (q @ k.transpose(-1, -2)) * 32**-0.5
    assert kernel == "compiled" and scores.max() < -100
    assert (out - _equation(q, k, v, torch.ones(1, 1, 1, length, dtype=torch.bool))).abs().max().item() < 2e-5


@needs_compiled
def test_compiled_attention_of_an_empty_sequence_is_zero():
    q, k, v = _qkv_views(2, 5, 2, 32)
    with torch.no_grad():
        out = attention.compiled_attention(q, k, v, torch.tensor([5, 0]))
        packed = attention.packed_attention(torch.randn(3, 3 * 64), torch.tensor([0, 3, 3]), torch.tensor([3, 0, 0]), 2)
    assert out[1].eq(0).all() and out[0].abs().sum() > 0
    assert packed.isfinite().all()


@needs_compiled
def test_compiled_attention_does_not_depend_on_the_padding():
    # A sequence's result is computed over its own keys only: alone or padded into a longer batch, the same bits.
    q, k, v = _qkv_views(2, 40, 12, 32, seed=3)
    lengths = torch.tensor([40, 13])
    with torch.no_grad():
        batched, _, _ = attend_on(q, k, v, None, lengths=lengths)
        alone, _, _ = attend_on(q[1:, :, :13], k[1:, :, :13], v[1:, :, :13], None, lengths=lengths[1:])
    assert torch.equal(alone, batched[1:, :, :13])


@needs_compiled
def test_compiled_attention_only_for_inference_in_float32_or_bf16(monkeypatch):
    q, k, v = _qkv_views(2, 9, 2, 32)
    lengths = torch.tensor([9, 4])
    mask = (torch.arange(9) < lengths[:, None])[:, None, None, :]
    with torch.no_grad():
        assert attend_on(q, k, v, mask, lengths=lengths)[2] == "compiled"
        assert attend_on(q, k, v, mask, training=True, lengths=lengths)[2] == "torch"  # GradCache's first pass
        assert attend_on(q, k, v, mask, dropout_p=0.1, lengths=lengths)[2] == "torch"
        out16, dtype16, kernel16 = attend_on(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, lengths=lengths)
        assert kernel16 == "compiled" and dtype16 == torch.float32 and out16.dtype == torch.bfloat16  # widened
        want = _equation(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), mask)
        torch.testing.assert_close(out16.double()[0], want[0], atol=1e-4, rtol=2**-8)  # float32's, rounded once
        assert attend_on(q.half(), k.half(), v.half(), mask, lengths=lengths)[2] == "torch"
        q16, k16, v16 = _qkv_views(2, 9, 2, 16)
        assert attend_on(q16, k16, v16, mask, lengths=lengths)[2] == "torch"  # heads of 16: not specialised
        assert attend(q, k, v, mask, lengths=lengths, settings=Settings("off"))[2] == "torch"
        monkeypatch.setattr(cpu, "packing_pays", lambda level=None: True)  # "auto": where torch runs AVX-512 kernels
        assert attend(q, k, v, mask, lengths=lengths, settings=Settings("auto"))[2] == "compiled"
        monkeypatch.setattr(cpu, "packing_pays", lambda level=None: False)  # AVX2 only: off unless asked for
        assert attend(q, k, v, mask, lengths=lengths, settings=Settings("auto"))[2] == "torch"
        assert attend_on(q, k, v, mask, lengths=lengths)[2] == "compiled"
    assert attend_on(q, k, v, mask, lengths=lengths)[2] == "torch"  # gradient enabled


@needs_compiled
def test_packed_attention_equals_padded_and_does_not_depend_on_the_batch():
    # The packed rows (sequence after sequence, as the layers hold them) give what the padded layout gives on the
    # real rows, and a sequence's rows give the same bits alone as among others.
    H, hd = 3, 64
    lengths = torch.tensor([5, 33, 1, 20])
    T, N = int(lengths.max()), int(lengths.sum())
    qkv = torch.randn(N, 3 * H * hd, generator=torch.Generator().manual_seed(4))
    starts = torch.cumsum(lengths, 0) - lengths
    mask = torch.arange(T) < lengths[:, None]  # (B, T)
    padded = torch.zeros(4, T, 3 * H * hd)
    padded[mask] = qkv
    q, k, v = padded.view(4, T, 3, H, hd).permute(2, 0, 3, 1, 4)
    with torch.no_grad():
        packed = attention.packed_attention(qkv, starts, lengths, H)  # (N, H·hd)
        want = attention.compiled_attention(q, k, v, lengths).transpose(1, 2).reshape(4, T, H * hd)[mask]
        exact = _equation(q, k, v, mask[:, None, None, :]).transpose(1, 2).reshape(4, T, H * hd)[mask]
        alone = attention.packed_attention(qkv[5:38], torch.tensor([0]), lengths[1:2], H)
    assert torch.equal(packed, want)
    assert (packed.double() - exact).abs().max().item() < 2e-6
    assert torch.equal(alone, packed[5:38])


@needs_compiled
@pytest.mark.parametrize("family", ["bert", "nomic"])  # nomic: rotary positions applied to q and k first
def test_encoder_takes_compiled_attention_for_right_padding_only(family):
    torch.manual_seed(0)
    enc = Encoder(tiny_config(family, hidden_size=64, num_heads=2)).eval()  # heads of 32
    ids = torch.randint(5, 100, (3, 11))
    right = torch.ones(3, 11, dtype=torch.bool)
    right[1, 6:] = False
    right[2, 2:] = False
    left = right.flip(1)  # real tokens last: not a prefix, torch's kernel
    # without rotary positions the kernel reads the packed rows; with them, the padded (B, H, T, hd) layout
    expected = "packed" if family == "bert" else "compiled"
    with torch.no_grad():
        fast = enc(ids, right).packed_hidden
        assert all(layer.last_attention_kernel == expected for layer in enc.layers)
        enc(ids, left)
        assert all(layer.last_attention_kernel == "torch" for layer in enc.layers)
        slow = apply(enc, Settings("off"))(ids, right).packed_hidden
        assert all(layer.last_attention_kernel == "torch" for layer in enc.layers)
    torch.testing.assert_close(fast, slow, atol=2e-5, rtol=1e-5)
    enc.train()
    enc(ids, right)  # training never takes the compiled kernel
    assert all(layer.last_attention_kernel == "torch" for layer in enc.layers)
