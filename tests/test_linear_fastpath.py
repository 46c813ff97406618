"""`Linear`'s CPU inference paths: packed float32 equals `F.linear` and runs only at inference (never in a training
pass, GradCache's no-grad pass included); dynamic int8 stays close to float32, quantises each row on its own, and
covers every linear layer and MoE expert. Each test asserts the path that actually ran (`last_path`)."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import moembed.model.linear as linear
from moembed.model import rowquant
from moembed.model.config import MoEConfig
from moembed.model.linear import (
    Linear,
    bf16_is_fast,
    fastpath_enabled,
    int8_available,
    int8_kernel,
    int8_linear,
    pack_int8,
    packing_pays,
    quantize_int8,
)
from moembed.model.moe import MoEBlock

@pytest.fixture(scope="module")
def sentences() -> list[str]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from sentences import news_sentences

    return news_sentences(32) + ["", "x"]


@pytest.fixture
def packing_on(monkeypatch):
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "0")  # on wherever the build has it, whatever this CPU's default


def packed_only(test):
    """A test of the packed path: packing switched on; skipped only where this torch build lacks oneDNN."""
    test = pytest.mark.usefixtures("packing_on")(test)
    return pytest.mark.skipif(not linear._HAS_PACKED, reason="this torch build has no oneDNN packed linear")(test)
int8_only = pytest.mark.skipif(not int8_available(), reason="this torch build has no x86 quantised kernels")
# oneDNN's int8 kernel is correct only where VNNI sums u8 x s8 products into 32 bits (`int8_kernel`): its tests run
# on such CPUs (Zen 4 and 5, AMX Xeons), fbgemm's everywhere.
onednn_int8_only = pytest.mark.skipif(int8_kernel() != "onednn", reason="no VNNI or no oneDNN int8 kernel here")
KERNELS = [pytest.param("onednn", marks=onednn_int8_only), "fbgemm"]
COMPILED = rowquant.load() is not None


@pytest.fixture(params=[pytest.param("compiled", marks=pytest.mark.skipif(not COMPILED, reason="no C compiler")),
                        "torch"])
def rows(request, monkeypatch):
    """The int8 path's per-row work: `rowquant`'s compiled loops (counted, so that tests know they ran) or torch ops."""
    calls = []
    if request.param == "torch":
        monkeypatch.setattr(linear, "fused_rows", lambda: None)
    else:
        for name in ("quantize_rows", "rescale_rows"):
            fn = getattr(rowquant, name)
            monkeypatch.setattr(rowquant, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    return request.param, calls


def _ran(rows, kernel: str = "onednn") -> None:
    """The compiled loops ran where asked for (the quantiser only with oneDNN's kernel); torch ops ran otherwise."""
    mode, calls = rows
    if mode == "torch":
        assert not calls
    else:
        assert "rescale_rows" in calls and ("quantize_rows" in calls) == (kernel == "onednn")


@packed_only
@pytest.mark.parametrize("shape", [(7, 32), (3, 5, 32), (1, 32)])
def test_packed_equals_plain(shape):
    torch.manual_seed(0)
    lin = Linear(32, 48).eval()
    x = torch.randn(*shape)
    with torch.inference_mode():
        fast = lin(x)
    assert lin.last_path == "packed"
    torch.testing.assert_close(fast, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


@packed_only
def test_gelu_fused_into_the_packed_matmul_equals_gelu_after_it():
    from moembed.model.encoder import GeluMLP

    torch.manual_seed(0)
    mlp = GeluMLP(32, 64).eval()
    x = torch.randn(9, 32)
    seen = []
    mlp.fc1.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))  # hooks still see the input
    with torch.inference_mode():
        fused = mlp(x)
    assert mlp.fc1.last_path == "packed" and seen == [x.shape]
    ref = F.linear(F.gelu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias)), mlp.fc2.weight, mlp.fc2.bias)
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        plain = mlp.fc1.train()(x, gelu=True)  # the unpacked path applies the same exact GELU
    assert mlp.fc1.last_path == "plain"
    torch.testing.assert_close(plain, F.gelu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias)))


@packed_only
def test_repacks_after_weight_update():
    lin = Linear(8, 8).eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        lin(x)
        lin.weight.mul_(2.0)  # an optimizer step updates in place: the cache must notice
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    assert lin.last_path == "packed"


@pytest.mark.skipif(not linear._HAS_PACKED, reason="this torch build has no oneDNN packed linear")
def test_packing_is_the_default_only_where_it_pays(monkeypatch):
    # Packed weights are about 2x the plain call where torch runs AVX-512 kernels and slower on AVX2 only.
    assert packing_pays("AVX512") and not packing_pays("AVX2") and not packing_pays("DEFAULT")
    lin, x = Linear(8, 8).eval(), torch.randn(3, 8)
    monkeypatch.delenv("MOEMBED_NO_FASTPATH", raising=False)
    for pays, path in ((False, "plain"), (True, "packed")):
        monkeypatch.setattr(linear, "_PACKING_PAYS", pays)
        with torch.no_grad():
            lin(x)
        assert lin.last_path == path
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "1")  # off even where it pays
    assert not fastpath_enabled()
    monkeypatch.setattr(linear, "_PACKING_PAYS", False)
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "0")  # on even where it does not
    assert fastpath_enabled()
    with linear.fastpath(False):  # the same switch for a block, restored after it
        assert not fastpath_enabled()
    assert os.environ["MOEMBED_NO_FASTPATH"] == "0"


def test_training_uses_autograd_path(monkeypatch):
    lin = Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    lin(x).sum().backward()
    assert lin.last_path == "plain" and lin.weight.grad is not None and x.grad is not None
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "1")
    assert not fastpath_enabled()
    with torch.no_grad():
        lin.eval()(x)
    assert lin.last_path == "plain"


@packed_only
def test_no_grad_training_pass_does_not_pack():
    # GradCache's first pass runs without gradient in training mode, and the optimizer changes the weights every
    # step: packing there would repack every weight every step for a single use.
    lin = Linear(16, 16).train()
    with torch.no_grad():
        lin(torch.randn(5, 16))
    assert lin.last_path == "plain"
    assert not any(k.startswith("packed") for k in lin.__dict__.get("_weight_cache", {}))


@packed_only
def test_a_used_model_deep_copies_without_its_packed_weights():
    lin = Linear(8, 8).eval()
    with torch.no_grad():
        lin(torch.randn(2, 8))
    assert "packed-torch.float32" in lin.__dict__["_weight_cache"]
    twin = copy.deepcopy(lin)  # oneDNN's packed tensors cannot be copied: the cache is rebuilt instead
    assert not twin.__dict__["_weight_cache"] and torch.equal(twin.weight, lin.weight)


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
    with_outliers = int8_linear(x, pack_int8(w, b, amax, kernel))
    without = int8_linear(x, pack_int8(w, b, None, kernel))
    cos = lambda y: F.cosine_similarity(y, ref).min().item()  # noqa: E731
    assert cos(with_outliers) > 0.999
    assert cos(with_outliers) > cos(without)  # the outlier channels are what int8 alone gets wrong
    # Only the outlier channels, in float32: exact up to float32 rounding.
    only = torch.zeros_like(x)
    only[:, [3, 17]] = x[:, [3, 17]]
    got = int8_linear(only, pack_int8(w, b, amax, kernel))
    torch.testing.assert_close(got, F.linear(only, w, b), atol=1e-4, rtol=1e-4)
    # GELU after the rescale (fused into it where compiled): exact GELU of the product, not an approximation.
    gelu = int8_linear(x, pack_int8(w, b, amax, kernel), gelu=True)
    torch.testing.assert_close(gelu, F.gelu(with_outliers), atol=1e-5, rtol=1e-5)
    _ran(rows, kernel)


@int8_only
def test_int8_fixed_grid_kernel_runs_and_equals_the_measured_range_kernel(monkeypatch):
    # The kernel that takes the [-1, 1] grid as given must give what the range-measuring kernel gives on the
    # same scaled rows (a fixed row pins its range), outlier channels beyond 1 included.
    assert linear._fixed_grid_linear is not None  # this torch has it: the fast path is what runs
    x = _with_outliers(33, 96)
    w = pack_int8(torch.randn(80, 96) * 0.05, torch.randn(80), x.abs().amax(0), "fbgemm")
    calls = []
    kernel = linear._fixed_grid_linear
    monkeypatch.setattr(linear, "_fixed_grid_linear", lambda *a: calls.append(1) or kernel(*a))
    fixed = int8_linear(x, w)
    assert calls == [1]
    monkeypatch.setattr(linear, "_fixed_grid_linear", None)
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
    calls = []
    kernel = linear._onednn_qlinear
    monkeypatch.setattr(linear, "_onednn_qlinear", lambda *a: calls.append(1) or kernel(*a))
    got = int8_linear(x, w)
    assert calls == [1]  # the oneDNN kernel is what ran

    keep = torch.ones(96, dtype=torch.bool)
    keep[w.outliers] = False
    xd, wd = x.double(), weight.double()
    m = xd[:, keep].abs().amax(1, keepdim=True)  # (N, 1)
    step, zero = linear.ONEDNN_GRID
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
    expected = "onednn" if linear._HAS_ONEDNN_INT8 else "fbgemm"
    for vnni in ("avx512_vnni", "avx_vnni", "amx_int8"):
        assert int8_kernel({**flags, vnni: True}) == expected
    with pytest.raises(ValueError, match="int8 kernel"):
        quantize_int8(torch.nn.Linear(2, 2), kernel="vnni")


@int8_only
def test_onednn_int8_is_refused_without_vnni(make_tiny, monkeypatch):
    # Asked for by name on a CPU without VNNI, oneDNN's kernel would overflow silently: refused, and nothing switched.
    emb = make_tiny("bert")
    monkeypatch.setattr(linear, "_VNNI", False)
    assert int8_kernel() == "fbgemm"
    with pytest.raises(RuntimeError, match="VNNI"):
        quantize_int8(emb, kernel="onednn")
    assert not any(m.__dict__.get("int8") for m in emb.modules())


@int8_only
@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_rows_are_quantised_each_on_its_own(kernel, rows):
    # A row's result must not depend on the other rows of the call (embeddings never depend on the batch):
    # a dynamic range over the whole input would make a small row's grid coarser next to a large one.
    x = _with_outliers(10, 64)
    x[5:] *= 100.0
    g = torch.Generator().manual_seed(1)
    w = pack_int8(torch.randn(32, 64, generator=g) * 0.1, torch.randn(32, generator=g), x.abs().amax(0), kernel)
    batched = int8_linear(x, w)
    for i in range(10):
        # float32 rounding only (the outlier channels' float GEMM runs other kernels for 1 row than for 10); a
        # grid shared with the large rows would be 100x coarser for the small ones, an error of whole percents
        torch.testing.assert_close(int8_linear(x[i : i + 1], w), batched[i : i + 1], atol=1e-5, rtol=1e-5)
    _ran(rows, kernel)


@int8_only
@pytest.mark.parametrize("kernel", KERNELS)
def test_quantize_int8_covers_linear_layers_and_experts(make_tiny, sentences, kernel, rows):
    emb = make_tiny("bert", moe=MoEConfig(num_experts=4, top_k=2, every=1, offset=0))
    ref = emb.encode(sentences[:16])
    q = quantize_int8(copy.deepcopy(emb), kernel=kernel)
    got = q.encode(sentences[:16])
    assert (ref * got).sum(1).min() > 0.99
    linears = [m for m in q.modules() if isinstance(m, Linear)]
    blocks = [m for m in q.modules() if isinstance(m, MoEBlock)]
    assert linears and blocks
    assert all(m.last_path == ("int8-fused" if rows[0] == "compiled" else "int8") for m in linears)
    assert all(b.last_dispatch == "int8-loop" for b in blocks)
    _ran(rows, kernel)
    import moembed.model.moe as moe  # the experts' int8 outputs combined by combine.c, as torch ops would
    assert moe.combiner() is not None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "combiner", lambda: None)
        np.testing.assert_allclose(q.encode(sentences[:16]), got, atol=1e-6)
    assert all(m.__dict__.get("int8_amax") is not None for m in linears)  # outlier channels were measured
    packed = [m.__dict__["_weight_cache"]["int8"][1] for m in linears + [b.experts for b in blocks]]
    assert {w.kernel for ws in packed for w in ws} == {kernel}  # every layer and expert ran the kernel asked for
    # Alone or batched, the same text gets (up to rounding) the same embedding.
    alone = np.stack([q.encode([t])[0] for t in sentences[:6]])
    assert (alone * got[:6]).sum(1).min() > 0.9999
    # Training passes never see int8, and switching back restores float32 inference.
    q.train()
    batch = q.tokenizer(sentences[:2])
    q(batch.input_ids, batch.attention_mask)
    assert all(m.last_path == "plain" for m in linears)
    quantize_int8(q, enabled=False)
    np.testing.assert_allclose(q.encode(sentences[:16]), ref, atol=1e-5)


@int8_only
@pytest.mark.real
def test_int8_minilm_is_close_to_float32(minilm, sentences):
    q = quantize_int8(copy.deepcopy(minilm))
    assert (minilm.encode(sentences) * q.encode(sentences)).sum(1).min() >= 0.99


# ---- bf16 ------------------------------------------------------------------------------------------------------


bf16_native = pytest.mark.skipif(not linear.bf16_packing_enabled(),
                                 reason="bf16 matmuls are emulated on this CPU (no AVX-512 BF16 / AMX)")


@bf16_native
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_autocast_inference_runs_packed_bf16_weights(bias):
    torch.manual_seed(0)
    lin = Linear(64, 96, bias=bias).eval()
    x = torch.randn(5, 7, 64)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        fast = lin(x)
        assert lin.last_path == "packed-bf16"
        ref = F.linear(x, lin.weight, lin.bias)  # what autocast runs: weight and input cast to bf16 per call
    assert fast.dtype == ref.dtype == torch.bfloat16 and fast.shape == ref.shape
    # Both multiply the same bf16 operands with float32 accumulation; they differ by bf16 rounding of the output.
    torch.testing.assert_close(fast.float(), ref.float(), atol=2e-2, rtol=2e-2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lin.weight.mul_(-1.0)  # a weight update repacks
        torch.testing.assert_close(lin(x).float(), F.linear(x, lin.weight, lin.bias).float(), atol=2e-2, rtol=2e-2)


@bf16_native
def test_bf16_packing_only_at_inference(monkeypatch):
    lin, x = Linear(16, 16), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x)  # training mode, with gradient: autocast's own path, whose backward autograd knows
        assert lin.last_path == "plain"
        with torch.no_grad():
            lin(x)  # GradCache's no-grad training pass: the weights change every step, packing would not pay
            assert lin.last_path == "plain"
            lin.eval()(x)
            assert lin.last_path == "packed-bf16"
            monkeypatch.setenv("MOEMBED_NO_FASTPATH", "1")
            lin(x)
            assert lin.last_path == "plain"


def test_bf16_packing_is_off_where_bf16_is_emulated(monkeypatch):
    monkeypatch.setattr(linear, "_BF16_NATIVE", False)
    lin = Linear(16, 16).eval()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        lin(torch.randn(3, 16))
    assert lin.last_path == "plain"


def test_bf16_is_fast_follows_the_cpu_flags():
    flags = torch._C._cpu._get_cpu_capability()
    assert bf16_is_fast("cpu") == bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))
    assert bf16_is_fast("cuda") == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
