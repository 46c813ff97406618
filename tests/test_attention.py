"""Attention (`moembed.model.attention`) and its compiled CPU inference module (`moembed.model.fast.attention`).

The precision rule: a bf16 call in training (train mode or recorded by autograd), on a CPU without AMX, runs the
kernel in float32 and equals float32 attention of the same bf16 inputs, forward and backward, under autocast too;
elsewhere (inference, AMX, every fast path off in the settings, float32 inputs) the input's dtype runs. A spy on
`attention_in` sees which one ran. The compiled kernel is the equation; `CompiledAttention` runs it (a counting
spy on the function it calls sees it) on the calls it takes and the plain forward on every other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moembed.model.attention as attention
import moembed.model.fast.attention as fast
from moembed.errors import MoembedError
from moembed.model import backends, cpu, kernels
from moembed.model.attention import Attention, attend, compute_dtype
from moembed.model.encoder import Encoder, _Context
from moembed.model.fast.attention import CompiledAttention, use_compiled
from moembed.model.presets import tiny_config
from moembed.model.settings import Settings


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


def _spy(monkeypatch, module, name: str, record, calls: list | None = None) -> list:
    """Replace `module.name` by a wrapper that appends `record(*args)` to `calls` (a new list by default), then
    calls it; returns `calls`."""
    calls, real = [] if calls is None else calls, getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(record(*args))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.fixture
def kernel_dtypes(monkeypatch):
    """(the dtype it ran in, q's dtype) of every fused-kernel call the plain attention makes (`attention_in`)."""
    return _spy(monkeypatch, attention, "attention_in", lambda dtype, q, *rest: (dtype, q.dtype))


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
def test_bf16_runs_in_float32_forward_and_backward(upcast, autocast, kernel_dtypes):
    q, k, v, mask = _inputs()
    mine = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    ref = [t.bfloat16().float().requires_grad_() for t in (q, k, v)]  # the same bf16 values, in float32
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = attend(*mine, mask)
    assert kernel_dtypes == [(torch.float32, torch.bfloat16)] and out.dtype == torch.bfloat16
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


def test_native_dtype_where_upcast_does_not_pay(monkeypatch, kernel_dtypes):
    monkeypatch.setattr(cpu, "amx_bf16", lambda: True)
    q, k, v, mask = (t.bfloat16().requires_grad_() if t.dtype == torch.float32 else t for t in _inputs())
    out = attend(q, k, v, mask)
    assert kernel_dtypes == [(torch.bfloat16, torch.bfloat16)]
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_float32_unchanged(upcast, kernel_dtypes):
    q, k, v, mask = _inputs()
    out = attend(q, k, v, mask)
    assert kernel_dtypes == [(torch.float32, torch.float32)]
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_encoder_attention_computes_in_float32_when_training_in_bf16(upcast, kernel_dtypes):
    torch.manual_seed(0)
    enc = Encoder(tiny_config()).train()
    layers = len(enc.layers)
    ids = torch.randint(5, 100, (4, 9))
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[1, 5:] = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        out = enc(ids, mask).packed_hidden
    assert kernel_dtypes == [(torch.float32, torch.bfloat16)] * layers  # bf16 q, k, v computed in float32
    out.float().sum().backward()
    assert all(layer.qkv.weight.grad is not None and layer.qkv.weight.grad.abs().sum() > 0 for layer in enc.layers)
    torch.manual_seed(1)
    full = enc(ids, mask).packed_hidden  # float32 throughout, same dropout masks
    assert kernel_dtypes[layers:] == [(torch.float32, torch.float32)] * layers
    assert torch.nn.functional.cosine_similarity(out.float(), full, dim=-1).min().item() > 0.99
    del kernel_dtypes[:]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        enc(ids, mask)  # GradCache's first pass: no gradient, still training
    assert kernel_dtypes == [(torch.float32, torch.bfloat16)] * layers
    enc.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        enc(ids, mask)
    assert kernel_dtypes[layers:] == [(torch.bfloat16, torch.bfloat16)] * layers  # inference: bf16 kernel


# ---- compiled attention (CPU inference) --------------------------------------------------------------------------

needs_compiled = pytest.mark.skipif(not kernels.available("attention"), reason="no C compiler builds attention.c here")


def _qkv_views(B, T, H, hd, seed=0):
    """q, k, v (B, H, T, hd) as the encoder has them: strided views into one (B, T, 3·H·hd) projection."""
    qkv = torch.randn(B, T, 3 * H * hd, generator=torch.Generator().manual_seed(seed))
    return qkv.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every call `CompiledAttention` makes to attention.c: "packed" (`packed_attention`) or "padded"."""
    calls = _spy(monkeypatch, fast, "packed_attention", lambda *a: "packed")
    return _spy(monkeypatch, fast, "compiled_attention", lambda *a: "padded", calls)


@needs_compiled
@pytest.mark.parametrize("hd", [32, 64])
@pytest.mark.parametrize("T", [1, 7, 31, 32, 33, 100])
def test_compiled_attention_is_the_equation_on_real_rows_and_zero_elsewhere(hd, T):
    q, k, v = _qkv_views(3, T, 2, hd)
    lengths = torch.tensor([T, max(T // 2, 1), 1])
    mask = (torch.arange(T) < lengths[:, None])[:, None, None, :]
    with torch.no_grad():
        out = fast.compiled_attention(q, k, v, lengths)
        torch_out = attend(q, k, v, mask)  # the plain module's kernel
    assert out.shape == q.shape and out.dtype == q.dtype
    real = mask[:, 0, 0, :, None].expand(-1, -1, hd)  # (B, T, hd): the real query rows
    exact = _equation(q, k, v, mask)
    for h in range(2):
        assert (out[:, h] - exact[:, h])[real].abs().max().item() < 2e-6
        assert out[:, h][~real].eq(0).all()
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
        out = fast.compiled_attention(q, k, v, torch.tensor([length]))
    scores = (q @ k.transpose(-1, -2)) * 32**-0.5
    assert scores.max() < -100
    assert (out - _equation(q, k, v, torch.ones(1, 1, 1, length, dtype=torch.bool))).abs().max().item() < 2e-5


@needs_compiled
def test_compiled_attention_of_an_empty_sequence_is_zero():
    q, k, v = _qkv_views(2, 5, 2, 32)
    with torch.no_grad():
        out = fast.compiled_attention(q, k, v, torch.tensor([5, 0]))
        packed = fast.packed_attention(torch.randn(3, 3 * 64), torch.tensor([0, 3, 3]), torch.tensor([3, 0, 0]), 2)
    assert out[1].eq(0).all() and out[0].abs().sum() > 0
    assert packed.isfinite().all()


@needs_compiled
def test_compiled_attention_does_not_depend_on_the_padding():
    # A sequence's result is computed over its own keys only: alone or padded into a longer batch, the same bits.
    q, k, v = _qkv_views(2, 40, 12, 32, seed=3)
    lengths = torch.tensor([40, 13])
    with torch.no_grad():
        batched = fast.compiled_attention(q, k, v, lengths)
        alone = fast.compiled_attention(q[1:, :, :13], k[1:, :, :13], v[1:, :, :13], lengths[1:])
    assert torch.equal(alone, batched[1:, :, :13])


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
        packed = fast.packed_attention(qkv, starts, lengths, H)  # (N, H·hd)
        want = fast.compiled_attention(q, k, v, lengths).transpose(1, 2).reshape(4, T, H * hd)[mask]
        exact = _equation(q, k, v, mask[:, None, None, :]).transpose(1, 2).reshape(4, T, H * hd)[mask]
        alone = fast.packed_attention(qkv[5:38], torch.tensor([0]), lengths[1:2], H)
    assert torch.equal(packed, want)
    assert (packed.double() - exact).abs().max().item() < 2e-6
    assert torch.equal(alone, packed[5:38])


def _rows(lengths, H, hd, seed=0, right=True):
    """Packed rows qkv (N, 3·H·hd) and their layout for sequences of `lengths`, right (or left) padded."""
    T = max(lengths)
    mask = torch.arange(T) < torch.tensor(lengths)[:, None]  # (B, T)
    mask = mask if right else mask.flip(1)
    qkv = torch.randn(int(mask.sum()), 3 * H * hd, generator=torch.Generator().manual_seed(seed))
    return qkv, _Context(mask)


@needs_compiled
def test_compiled_module_runs_the_kernel_for_inference_in_float32_or_bf16_only(monkeypatch, kernel_calls):
    plain = Attention(2, 32, dropout=0.1).eval()
    core = CompiledAttention.from_plain(plain)
    qkv, ctx = _rows([9, 4], 2, 32)
    with torch.no_grad():
        out = core(qkv, ctx)
        assert kernel_calls == ["packed"]  # eval mode: no dropout, the kernel
        torch.testing.assert_close(out, plain(qkv, ctx), atol=2e-6, rtol=1e-5)
        out16 = core(qkv.bfloat16(), ctx)
        assert kernel_calls == ["packed"] * 2 and out16.dtype == torch.bfloat16  # widened to float32 inside
        torch.testing.assert_close(out16, plain(qkv.bfloat16().float(), ctx).bfloat16(), atol=1e-4, rtol=2**-8)
        core(qkv.half(), ctx)  # float16: not compiled
        core(*_rows([9, 4], 2, 32, right=False))  # left padding: no prefix lengths
        CompiledAttention(4, 16)(*_rows([9, 4], 4, 16))  # heads of 16: not specialised
        core.train()
        torch.manual_seed(0)
        trained = core(qkv, ctx)  # training (GradCache's first pass), with dropout
        torch.manual_seed(0)
        assert torch.equal(trained, plain.train()(qkv, ctx))  # the plain forward, the same dropout
        core.eval()
        with monkeypatch.context() as m:
            m.setattr(fast, "COMPILED_MAX_LENGTH", 8)
            core(qkv, ctx)  # longer than the kernel's longest
        core(qkv, ctx)
    assert kernel_calls == ["packed"] * 3  # the spy still counts
    core(qkv, ctx)  # gradient enabled
    monkeypatch.setattr(kernels, "available", lambda name: False)
    with torch.no_grad():
        core(qkv, ctx)  # not built here
    assert kernel_calls == ["packed"] * 3


def test_swaps_keep_the_configuration_and_the_state_dict(monkeypatch):
    torch.manual_seed(0)
    enc = Encoder(tiny_config(num_layers=3)).eval()
    keys = list(enc.state_dict())
    before = [(c.num_heads, c.head_dim, c.dropout, c.settings) for c in (layer.core for layer in enc.layers)]
    assert use_compiled(enc, True) == 3 and use_compiled(enc, True) == 0  # once each
    assert all(type(layer.core) is CompiledAttention and not layer.core.training for layer in enc.layers)
    assert [(c.num_heads, c.head_dim, c.dropout, c.settings) for c in (layer.core for layer in enc.layers)] == before
    assert list(enc.state_dict()) == keys
    enc.train()
    assert use_compiled(enc, False) == 3 and use_compiled(enc, False) == 0
    assert all(type(layer.core) is Attention and layer.core.training for layer in enc.layers)
    assert list(enc.state_dict()) == keys


def test_the_layer_attention_dropout_is_its_cores():
    # finetuning sets layer.attention_dropout (moembed.recipes.training): it must reach the module that drops
    enc = Encoder(tiny_config(attention_dropout=0.1))
    layer = enc.layers[0]
    assert (layer.attention_dropout, layer.core.dropout) == (0.1, 0.1)
    layer.attention_dropout = 0.0
    assert layer.core.dropout == 0.0 and CompiledAttention.from_plain(layer.core).dropout == 0.0
    with pytest.raises(MoembedError, match="dropout 1.0"):
        Attention(2, 32, dropout=1.0)


@needs_compiled
@pytest.mark.parametrize(("switch", "pays", "compiled"), [("auto", True, True), ("auto", False, False),
                                                          ("on", False, True), ("off", True, False)])
def test_the_backend_record_swaps_in_the_compiled_module_where_it_says_so(monkeypatch, switch, pays, compiled):
    monkeypatch.setattr(cpu, "packing_pays", lambda level=None: pays)  # "auto": where torch runs AVX-512 kernels
    enc = Encoder(tiny_config(hidden_size=64, num_heads=2)).eval()
    record = backends.setup(enc, "test", Settings(switch))
    assert record.path("attention") == ("compiled" if compiled else "torch")
    assert {type(layer.core) for layer in enc.layers} == {CompiledAttention if compiled else Attention}
    assert backends.setup(enc, "test", Settings("off")).path("attention") == "torch"  # and back
    assert {type(layer.core) for layer in enc.layers} == {Attention}
    with torch.autocast("cpu", dtype=torch.float16):
        assert backends.setup(enc, "test", Settings("on"), torch.float16).path("attention") == "torch"
    assert {type(layer.core) for layer in enc.layers} == {Attention}


@needs_compiled
@pytest.mark.parametrize("family", ["bert", "nomic"])  # nomic: rotary positions applied to q and k first
def test_encoder_takes_compiled_attention_for_right_padding_only(family, kernel_calls):
    torch.manual_seed(0)
    enc = Encoder(tiny_config(family, hidden_size=64, num_heads=2)).eval()  # heads of 32
    layers = len(enc.layers)
    ids = torch.randint(5, 100, (3, 11))
    right = torch.ones(3, 11, dtype=torch.bool)
    right[1, 6:] = False
    right[2, 2:] = False
    left = right.flip(1)  # real tokens last: not a prefix, the plain forward
    # without rotary positions the kernel reads the packed rows; with them, the padded (B, H, T, hd) layout
    expected = "packed" if family == "bert" else "padded"
    with torch.no_grad():
        slow = enc(ids, right).packed_hidden
        assert kernel_calls == []  # the plain module as built
        assert use_compiled(enc, True) == layers
        fast_out = enc(ids, right).packed_hidden
        assert kernel_calls == [expected] * layers
        enc(ids, left)
        assert kernel_calls == [expected] * layers
    torch.testing.assert_close(fast_out, slow, atol=2e-5, rtol=1e-5)
    enc.train()
    enc(ids, right)  # training never takes the compiled kernel
    assert kernel_calls == [expected] * layers
