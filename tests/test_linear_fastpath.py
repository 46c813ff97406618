"""`Linear`'s CPU inference paths: packed float32 equals `F.linear` and runs only at inference (never in a training
pass, GradCache's no-grad pass included); dynamic int8 stays close to float32, quantises each row on its own, and
covers every linear layer and MoE expert. Each path is a module swapped in for the plain layer (`moembed.model.fast`);
each test asserts the class that was swapped in and that its kernel ran (a spy on the function it calls, tests/spy.py).
Which paths a model takes is decided once, from its `Settings`, by `backends.use` and `quantize_int8`."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import moembed.model.fast.experts as fast_experts
import moembed.model.fast.int8 as fast_int8
import moembed.model.fast.packed as fast_packed
import moembed.model.linear as linear
from moembed.errors import MoembedError
from moembed.model import backends, cpu, kernels
from moembed.model.config import MoEConfig
from moembed.model.cpu import bf16_is_fast, int8_available
from moembed.model.fast import is_fast, swap
from moembed.model.fast.experts import Int8Experts
from moembed.model.fast.int8 import Int8Linear, int8_kernel, int8_linear, pack_int8
from moembed.model.fast.moe import InPlaceMoEBlock
from moembed.model.fast.packed import PackedLinear
from moembed.model.linear import Linear
from moembed.model.moe import MoEBlock
from moembed.model.quantize import is_int8, quantize_int8
from moembed.model.settings import Settings, UsesSettings
from spy import calls_of


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from sentences import news_sentences

    return news_sentences(32) + ["", "x"]


# A test of the packed path builds `PackedLinear` itself (what the "fast" backend swaps in wherever the build has
# it, whatever this CPU's default): skipped only where this torch build lacks oneDNN.
packed_only = pytest.mark.skipif(not cpu.has_packed(), reason="this torch build has no oneDNN packed linear")


@pytest.fixture
def packed_calls(monkeypatch) -> list:
    """The calls of the packed matmul (`fast.packed.packed_linear`): the packed path ran once per call."""
    return calls_of(monkeypatch, fast_packed, "packed_linear")


def packed(module: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Every `Linear` of `module` (or `module` itself) swapped for a `PackedLinear` of `dtype`."""
    return swap(module, lambda m: PackedLinear.from_plain(m, dtype) if isinstance(m, Linear) else None)
int8_only = pytest.mark.skipif(not int8_available(), reason="this torch build has no x86 quantised kernels")
# oneDNN's int8 kernel is correct only where VNNI sums u8 x s8 products into 32 bits (`int8_kernel`): its tests run
# on such CPUs (Zen 4 and 5, AMX Xeons), fbgemm's everywhere.
onednn_int8_only = pytest.mark.skipif(int8_kernel() != "onednn", reason="no VNNI or no oneDNN int8 kernel here")
KERNELS = [pytest.param("onednn", marks=onednn_int8_only), "fbgemm"]
COMPILED = kernels.available("rowquant")


@pytest.fixture(params=[pytest.param("compiled", marks=pytest.mark.skipif(not COMPILED, reason="no C compiler")),
                        "torch"])
def rows(request, monkeypatch):
    """The int8 path's per-row work: the compiled loops (counted, so that tests know they ran) or torch ops (the
    compiled loops switched off in the settings of models built in the test, read when they are built, so that
    `quantize_int8` swaps in layers with `fused` off); (mode, calls, `fused` for `int8_linear`)."""
    calls = []
    if request.param == "torch":
        monkeypatch.setenv("MOEMBED_NO_FASTPATH", "1")
    else:
        for name in ("quantize_rows", "rescale_rows"):
            fn = getattr(kernels, name)
            monkeypatch.setattr(kernels, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    return request.param, calls, request.param == "compiled"


def _ran(rows, kernel: str = "onednn") -> None:
    """The compiled loops ran where asked for (the quantiser only with oneDNN's kernel); torch ops ran otherwise."""
    mode, calls, _ = rows
    if mode == "torch":
        assert not calls
    else:
        assert "rescale_rows" in calls and ("quantize_rows" in calls) == (kernel == "onednn")


@packed_only
@pytest.mark.parametrize("shape", [(7, 32), (3, 5, 32), (1, 32)])
def test_packed_equals_plain(shape, packed_calls):
    torch.manual_seed(0)
    lin = packed(Linear(32, 48).eval())
    x = torch.randn(*shape)
    with torch.inference_mode():
        fast = lin(x)
    assert isinstance(lin, PackedLinear) and len(packed_calls) == 1
    torch.testing.assert_close(fast, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


@packed_only
def test_gelu_fused_into_the_packed_matmul_equals_gelu_after_it(packed_calls):
    from moembed.model.encoder import GeluMLP

    torch.manual_seed(0)
    mlp = packed(GeluMLP(32, 64).eval())
    x = torch.randn(9, 32)
    seen = []
    mlp.fc1.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))  # hooks still see the input
    with torch.inference_mode():
        fused = mlp(x)
    assert isinstance(mlp.fc1, PackedLinear) and seen == [x.shape]
    assert [call[3] for call in packed_calls] == [True, False]  # fc1 with GELU as the kernel's post-op, then fc2
    ref = F.linear(F.gelu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias)), mlp.fc2.weight, mlp.fc2.bias)
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        plain = mlp.fc1.train()(x, gelu=True)  # the unpacked path applies the same exact GELU
    assert len(packed_calls) == 2
    torch.testing.assert_close(plain, F.gelu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias)))


@packed_only
def test_repacks_after_weight_update(monkeypatch, packed_calls):
    packs = calls_of(monkeypatch, fast_packed, "pack")
    lin = packed(Linear(8, 8).eval())
    x = torch.randn(4, 8)
    with torch.no_grad():
        lin(x)
        lin(x)
        assert len(packs) == 1  # packed once, then reused
        lin.weight.mul_(2.0)  # an optimizer step updates in place: the cache must notice
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    assert len(packs) == 2 and len(packed_calls) == 3


@pytest.mark.skipif(not cpu.has_packed(), reason="this torch build has no oneDNN packed linear")
def test_packing_is_the_default_only_where_it_pays(monkeypatch, packed_calls):
    # Packed weights beat the plain call where torch runs AVX-512 kernels and lose on AVX2 only.
    assert cpu.packing_pays("AVX512") and not cpu.packing_pays("AVX2") and not cpu.packing_pays("DEFAULT")
    monkeypatch.delenv("MOEMBED_NO_FASTPATH", raising=False)
    model, x = nn.Sequential(Linear(8, 8)).eval(), torch.randn(3, 8)
    assert model[0].settings == Settings("auto")
    # "auto" packs where it pays, "torch" never (even where it pays), "fast" always (even where it does not)
    for name, pays, path in (("auto", False, "plain"), ("auto", True, "packed"), ("torch", True, "plain"),
                             ("fast", False, "packed")):
        monkeypatch.setattr(cpu, "packing_pays", lambda level=None, pays=pays: pays)
        assert backends.use(model, name).path("linear") == path
        assert isinstance(model[0], PackedLinear) == (path == "packed")
        assert model[0].settings == Settings.for_backend(name)
        packed_calls.clear()
        with torch.no_grad():
            model(x)
        assert len(packed_calls) == (path == "packed")


def test_the_user_switch_is_read_once_when_the_model_is_built(monkeypatch, make_tiny):
    # MOEMBED_NO_FASTPATH becomes the encoder's settings when it is built; changing it later changes nothing, and
    # nothing here writes the environment.
    for value, switch in (("", "auto"), ("0", "on"), ("1", "off")):
        monkeypatch.setenv("MOEMBED_NO_FASTPATH", value)
        enc = make_tiny("bert").encoder
        assert {m.settings for m in enc.modules() if isinstance(m, UsesSettings)} == {Settings(switch)}
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "0")
    assert enc.settings == Settings("off")
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "yes")
    with pytest.raises(MoembedError, match="MOEMBED_NO_FASTPATH"):
        Settings.from_env()
    assert not hasattr(linear, "fastpath")  # the old process-wide switch is gone


@pytest.mark.skipif(not cpu.has_packed(), reason="this torch build has no oneDNN packed linear")
def test_training_uses_autograd_path(packed_calls):
    model = packed(nn.Sequential(Linear(8, 4)))
    x = torch.randn(3, 8, requires_grad=True)
    model(x).sum().backward()  # a packed layer in training, with gradient: the plain forward
    assert isinstance(model[0], PackedLinear) and not packed_calls
    assert model[0].weight.grad is not None and x.grad is not None
    assert backends.use(model, "torch").path("linear") == "plain"  # the reference: back to the plain layer
    assert type(model[0]) is Linear
    with torch.no_grad():
        model.eval()(x)
    assert not packed_calls


@packed_only
def test_no_grad_training_pass_does_not_pack(packed_calls):
    # GradCache's first pass runs without gradient in training mode, and the optimizer changes the weights every
    # step: packing there would repack every weight every step for a single use.
    lin = packed(Linear(16, 16).train())
    with torch.no_grad():
        lin(torch.randn(5, 16))
    assert not packed_calls
    assert not any(k.startswith("packed") for k in lin.weight_cache)


@packed_only
def test_a_used_model_deep_copies_without_its_packed_weights(packed_calls):
    lin = packed(Linear(8, 8).eval())
    x = torch.randn(2, 8)
    with torch.no_grad():
        y = lin(x)
    assert "packed-torch.float32" in lin.weight_cache
    twin = copy.deepcopy(lin)  # oneDNN's packed tensors cannot be copied: the cache is rebuilt instead
    assert isinstance(twin, PackedLinear) and not twin.weight_cache and torch.equal(twin.weight, lin.weight)
    with torch.no_grad():
        assert torch.equal(twin(x), y)  # the copy packs its own weights on first use
    assert len(packed_calls) == 2 and "packed-torch.float32" in twin.weight_cache

# ---- int8 ------------------------------------------------------------------------------------------------------


def _with_outliers(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    x[:, [3, 17]] *= 40.0  # two channels far larger than the rest on every row, as in trained transformers
    return x


@int8_only
@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_linear_is_close_to_float_and_keeps_outlier_channels_exact(kernel, rows):
    torch.manual_seed(0)
    x, w, b = _with_outliers(64, 96), torch.randn(80, 96) * 0.05, torch.randn(80)
    ref = F.linear(x, w, b)
    amax = x.abs().amax(0)
    lib = rows[2]
    with_outliers = int8_linear(x, pack_int8(w, b, amax, kernel), fused=lib)
    without = int8_linear(x, pack_int8(w, b, None, kernel), fused=lib)
    cos = lambda y: F.cosine_similarity(y, ref).min().item()  # noqa: E731
    assert cos(with_outliers) > 0.999
    assert cos(with_outliers) > cos(without)  # the outlier channels are what int8 alone gets wrong
    # Only the outlier channels, in float32: exact up to float32 rounding.
    only = torch.zeros_like(x)
    only[:, [3, 17]] = x[:, [3, 17]]
    got = int8_linear(only, pack_int8(w, b, amax, kernel), fused=lib)
    torch.testing.assert_close(got, F.linear(only, w, b), atol=1e-4, rtol=1e-4)
    # GELU after the rescale (fused into it where compiled): exact GELU of the product, not an approximation.
    gelu = int8_linear(x, pack_int8(w, b, amax, kernel), gelu=True, fused=lib)
    torch.testing.assert_close(gelu, F.gelu(with_outliers), atol=1e-5, rtol=1e-5)
    _ran(rows, kernel)


@int8_only
def test_int8_fixed_grid_kernel_runs_and_equals_the_measured_range_kernel(monkeypatch):
    # The kernel that takes the [-1, 1] grid as given must give what the range-measuring kernel gives on the
    # same scaled rows (a fixed row pins its range), outlier channels beyond 1 included.
    assert fast_int8._fixed_grid_linear is not None  # this torch has it: the fast path is what runs
    x = _with_outliers(33, 96)
    w = pack_int8(torch.randn(80, 96) * 0.05, torch.randn(80), x.abs().amax(0), "fbgemm")
    calls = calls_of(monkeypatch, fast_int8, "_fixed_grid_linear")
    fixed = int8_linear(x, w)
    assert len(calls) == 1
    monkeypatch.setattr(fast_int8, "_fixed_grid_linear", None)
    torch.testing.assert_close(fixed, int8_linear(x, w), atol=0, rtol=0)


@int8_only
@onednn_int8_only
def test_onednn_int8_kernel_runs_and_computes_the_integer_product_exactly(monkeypatch, rows):
    # oneDNN's kernel against the equation it stands for, in float64: codes q = clamp(round(x_s / s) + 128, 0, 255)
    # of the scaled rows x_s = x / m on the full grid (s = 1/127), y = m * s * ((q - 128) @ Wqᵀ) * w_scale + b,
    # plus the outlier channels in float32. Integer sums are exact, so only float32 rounding may differ: a kernel
    # that saturated 16-bit pair sums (no VNNI) or ran another grid would be off by far more.
    g = torch.Generator().manual_seed(2)
    x = _with_outliers(37, 96)
    weight, bias = torch.randn(80, 96, generator=g) * 0.05, torch.randn(80, generator=g)
    w = pack_int8(weight, bias, x.abs().amax(0), "onednn")
    assert w.kernel == "onednn"
    calls = calls_of(monkeypatch, fast_int8, "_onednn_qlinear")
    got = int8_linear(x, w, fused=rows[2])
    assert len(calls) == 1  # the oneDNN kernel is what ran

    keep = torch.ones(96, dtype=torch.bool)
    keep[w.outliers] = False
    xd, wd = x.double(), weight.double()
    m = xd[:, keep].abs().amax(1, keepdim=True)  # (N, 1)
    step, zero = fast_int8.ONEDNN_GRID
    codes = (torch.round((xd / m).float() / step) + zero).clamp(0, 255).double() - zero  # (N, k), outliers clamped
    codes[:, ~keep] = 0  # their int8 weights are 0
    w_scale = (wd[:, keep].float().abs().amax(1) / 127).double()  # (n,)
    wq = torch.round((wd.float() / w_scale.float()[:, None])).double() * keep  # (n, k)
    ref = m * step * (codes @ wq.t()) * w_scale + bias.double() + xd[:, ~keep] @ wd[:, ~keep].t()
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-5)
    _ran(rows)


@int8_only
@onednn_int8_only
def test_onednn_full_grid_is_more_precise_than_fbgemm_reduced_range():
    # The full 8-bit grid (VNNI CPUs) has about half the rounding step of fbgemm's 7-bit one: a smaller error
    # against float32 on the same layer.
    g = torch.Generator().manual_seed(3)
    x = _with_outliers(256, 384)
    weight, bias = torch.randn(384, 384, generator=g) / 384**0.5, torch.randn(384, generator=g)
    ref = F.linear(x, weight, bias)
    err = {k: ((int8_linear(x, pack_int8(weight, bias, x.abs().amax(0), k)) - ref).norm() / ref.norm()).item()
           for k in ("onednn", "fbgemm")}
    assert err["onednn"] < 0.75 * err["fbgemm"], err


def test_int8_kernel_needs_vnni():
    # Full-range u8 x s8 products overflow 16-bit pair sums: oneDNN's kernel only where VNNI or AMX sum into 32 bits.
    flags = {"avx2": True, "avx512_f": True}
    assert int8_kernel(flags) == "fbgemm"
    expected = "onednn" if cpu.onednn_int8() else "fbgemm"
    for vnni in ("avx512_vnni", "avx_vnni", "amx_int8"):
        assert int8_kernel({**flags, vnni: True}, Settings()) == expected
        assert Settings("off").int8_kernel({**flags, vnni: True}) == "fbgemm"  # every fast path off: fbgemm
    with pytest.raises(ValueError, match="int8 kernel"):
        quantize_int8(torch.nn.Linear(2, 2), kernel="vnni")


@int8_only
def test_onednn_int8_is_refused_without_vnni(make_tiny, monkeypatch):
    # Asked for by name on a CPU without VNNI, oneDNN's kernel would overflow silently: refused, and nothing switched.
    emb = make_tiny("bert")
    monkeypatch.setattr(cpu, "vnni", lambda: False)
    assert int8_kernel(settings=Settings()) == "fbgemm"
    with pytest.raises(RuntimeError, match="VNNI"):
        quantize_int8(emb, kernel="onednn")
    assert not is_int8(emb)


@int8_only
@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_rows_are_quantised_each_on_its_own(kernel, rows):
    # A row's result must not depend on the other rows of the call (embeddings never depend on the batch):
    # a dynamic range over the whole input would make a small row's grid coarser next to a large one.
    x = _with_outliers(10, 64)
    x[5:] *= 100.0
    g = torch.Generator().manual_seed(1)
    w = pack_int8(torch.randn(32, 64, generator=g) * 0.1, torch.randn(32, generator=g), x.abs().amax(0), kernel)
    batched = int8_linear(x, w, fused=rows[2])
    for i in range(10):
        # float32 rounding only (the outlier channels' float GEMM runs other kernels for 1 row than for 10); a
        # grid shared with the large rows would be 100x coarser for the small ones, an error of whole percents
        torch.testing.assert_close(int8_linear(x[i : i + 1], w, fused=rows[2]), batched[i : i + 1], atol=1e-5,
                                   rtol=1e-5)
    _ran(rows, kernel)


@int8_only
@pytest.mark.parametrize("kernel", KERNELS)
def test_quantize_int8_covers_linear_layers_and_experts(make_tiny, sentences, kernel, rows, monkeypatch):
    emb = make_tiny("bert", moe=MoEConfig(num_experts=4, top_k=2, every=1, offset=0))
    ref = emb.encode(sentences[:16])
    q = quantize_int8(copy.deepcopy(emb), kernel=kernel)
    assert is_int8(q) and not is_int8(emb)
    int8_calls = {owner: calls_of(monkeypatch, owner, "int8_linear") for owner in (fast_int8, fast_experts)}
    combined = calls_of(monkeypatch, kernels, "combine_rows")
    got = q.encode(sentences[:16])
    assert (ref * got).sum(1).min() > 0.99
    linears = [m for m in q.modules() if isinstance(m, Linear)]
    blocks = [m for m in q.modules() if isinstance(m, MoEBlock)]
    assert linears and blocks
    fused = rows[0] == "compiled"  # chosen when quantize_int8 swapped the layers in, from their settings
    assert all(isinstance(m, Int8Linear) and m.fused == fused for m in linears)
    assert all(isinstance(b, InPlaceMoEBlock) and isinstance(b.experts, Int8Experts) and b.experts.fused == fused
               for b in blocks)
    for calls in int8_calls.values():  # the int8 matmuls of the linear layers and of the experts ran
        assert calls and all(call[3] == fused for call in calls)
    _ran(rows, kernel)
    # the experts' int8 outputs combined by combine.c (with the compiled loops on), as torch ops would
    if fused:
        assert kernels.available("combine") and all(b.compiled for b in blocks) and len(combined) == len(blocks)
    combined.clear()
    with pytest.MonkeyPatch.context() as mp:
        for b in blocks:
            mp.setattr(b, "compiled", False)
        np.testing.assert_allclose(q.encode(sentences[:16]), got, atol=1e-6)
    assert not combined  # torch ops combined that pass
    assert all(m.setup.amax is not None for m in linears)  # outlier channels were measured
    packed = [m.weight_cache["int8"][1] for m in linears + [b.experts for b in blocks]]
    assert {w.kernel for ws in packed for w in ws} == {kernel}  # every layer and expert ran the kernel asked for
    # Alone or batched, the same text gets (up to rounding) the same embedding.
    alone = np.stack([q.encode([t])[0] for t in sentences[:6]])
    assert (alone * got[:6]).sum(1).min() > 0.9999
    # Training passes never see int8, and switching back restores float32 inference.
    q.train()
    batch = q.tokenizer(sentences[:2])
    for calls in int8_calls.values():
        calls.clear()
    q(batch.input_ids, batch.attention_mask)
    assert not any(int8_calls.values())
    quantize_int8(q, enabled=False)
    assert not is_int8(q) and not any(is_fast(m) for m in q.modules())
    np.testing.assert_allclose(q.encode(sentences[:16]), ref, atol=1e-5)
    assert not any(int8_calls.values())


@int8_only
def test_with_every_fast_path_off_int8_experts_are_combined_by_torch_ops(make_tiny, monkeypatch):
    # `Settings.compiled_loops` covers the int8 per-row loops and the MoE combine loop: "off" (MOEMBED_NO_FASTPATH=1,
    # the "torch" backend) runs neither compiled.
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "1")
    q = quantize_int8(make_tiny("bert", moe=MoEConfig(num_experts=4, top_k=2, every=1, offset=0)))
    combined = calls_of(monkeypatch, kernels, "combine_rows")
    q.encode(["a text", "another, longer text"])
    blocks = [m for m in q.modules() if isinstance(m, InPlaceMoEBlock)]
    assert blocks and not any(b.experts.fused for b in blocks)
    assert not any(b.compiled for b in blocks) and not combined
    assert "combined by torch ops (fast paths off)" in backends.describe("torch", Settings("off"), torch.device("cpu"),
                                                                          None, True, True).why("moe")


@int8_only
@pytest.mark.real
def test_int8_minilm_is_close_to_float32(minilm, sentences):
    q = quantize_int8(copy.deepcopy(minilm))
    assert (minilm.encode(sentences) * q.encode(sentences)).sum(1).min() >= 0.99


# ---- bf16 ------------------------------------------------------------------------------------------------------


bf16_native = pytest.mark.skipif(not Settings().bf16_packing(),
                                 reason="bf16 matmuls are emulated on this CPU (no AVX-512 BF16 / AMX)")


@bf16_native
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_autocast_inference_runs_packed_bf16_weights(bias, monkeypatch, packed_calls):
    torch.manual_seed(0)
    model = nn.Sequential(Linear(64, 96, bias=bias)).eval()
    assert backends.use(model, "auto", torch.bfloat16).path("linear") == "packed-bf16"
    lin = model[0]
    assert isinstance(lin, PackedLinear) and torch.bfloat16 in lin.dtypes
    packs = calls_of(monkeypatch, fast_packed, "pack")
    x = torch.randn(5, 7, 64)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        fast = lin(x)
        assert len(packed_calls) == 1 and packs[0][1] == torch.bfloat16
        ref = F.linear(x, lin.weight, lin.bias)  # what autocast runs: weight and input cast to bf16 per call
    assert fast.dtype == ref.dtype == torch.bfloat16 and fast.shape == ref.shape
    # Both multiply the same bf16 operands with float32 accumulation; they differ by bf16 rounding of the output.
    torch.testing.assert_close(fast.float(), ref.float(), atol=2e-2, rtol=2e-2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lin.weight.mul_(-1.0)  # a weight update repacks
        torch.testing.assert_close(lin(x).float(), F.linear(x, lin.weight, lin.bias).float(), atol=2e-2, rtol=2e-2)
    assert len(packs) == 2 and len(packed_calls) == 2


@bf16_native
def test_bf16_packing_only_at_inference(packed_calls):
    model, x = packed(nn.Sequential(Linear(16, 16)), torch.bfloat16), torch.randn(4, 16)
    lin = model[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x)  # training mode, with gradient: autocast's own path, whose backward autograd knows
        assert not packed_calls
        with torch.no_grad():
            lin(x)  # GradCache's no-grad training pass: the weights change every step, packing would not pay
            assert not packed_calls
            lin.eval()(x)
            assert len(packed_calls) == 1
            assert backends.use(model, "torch", torch.bfloat16).path("linear") == "plain"
            assert type(model[0]) is Linear
            model(x)
            assert len(packed_calls) == 1


def test_bf16_packing_is_off_where_bf16_is_emulated(monkeypatch, packed_calls):
    monkeypatch.setattr(cpu, "bf16_native", lambda: False)
    model = nn.Sequential(Linear(16, 16)).eval()
    backend = backends.use(model, "fast", torch.bfloat16)  # every fast path on, bf16 packing still not
    assert backend.path("linear") == "plain" and "emulated" in backend.why("linear")
    assert type(model[0]) is Linear
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(3, 16))
    assert not packed_calls


def test_bf16_is_fast_follows_the_cpu_flags():
    flags = torch._C._cpu._get_cpu_capability()
    assert bf16_is_fast("cpu") == bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))
    assert bf16_is_fast("cuda") == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
