"""`moembed.model.kernels`' rowquant.c: the compiled per-row loops of the int8 path against the torch ops they replace: codes
to the bit, rescale and GELU to float32 rounding. (Their build: tests/test_native.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import moembed.model.fast.int8 as int8
from moembed.model import kernels
from moembed.model.settings import Settings

COMPILED = kernels.available("rowquant")
needs_compiler = pytest.mark.skipif(not COMPILED, reason=f"no compiled kernels here: {kernels.why_not('rowquant')}")


def _rows(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 10
    x[:, [1, 30]] *= 50.0  # outlier channels, far beyond the other channels' range
    x[2] = 0.0  # a row of zeros: its range is clamped, its codes the zero point
    return x


@needs_compiler
@pytest.mark.parametrize("shape", [(37, 96), (1, 384), (0, 64), (300, 1536)])
def test_quantize_rows_equals_torch_ops_to_the_bit(shape):
    x = _rows(max(shape[0], 3), shape[1])[: shape[0]]
    outliers = torch.tensor([1, 30])
    keep = torch.ones(shape[1]).index_fill_(0, outliers, 0.0)
    codes, m, xo = kernels.quantize_rows(x, keep, outliers, int8._ONEDNN_INV_STEP, 128.0)
    # torch: the range outside the outlier channels, the scaled rows, torch's quantiser on the fixed grid
    ref_m = x.abs().index_fill(1, outliers, 0.0).amax(1, keepdim=True).clamp_min(1e-12)
    xs = x / ref_m
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_codes = torch.quantize_per_tensor(xs, *int8.ONEDNN_GRID, torch.quint8).int_repr()
    assert torch.equal(m, ref_m)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(xo, xs[:, outliers])
    if shape[0] > 2:
        assert codes[2].eq(128).all()  # zero row: zero codes


@needs_compiler
@pytest.mark.parametrize("gelu", [False, True])
def test_rescale_rows_equals_rescale_bias_and_exact_gelu(gelu):
    g = torch.Generator().manual_seed(1)
    y = torch.randn(50, 1000, generator=g) * 4
    y[0, :9] = torch.tensor([-30.0, -10.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 10.0, 30.0])  # GELU's tails and its centre
    m, bias = torch.rand(50, 1, generator=g) + 0.5, torch.randn(1000, generator=g)
    ref = y * m + bias
    ref = F.gelu(ref) if gelu else ref
    got = kernels.rescale_rows(y.clone(), m, bias, gelu)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-6)  # erf within 1.5e-7 (Abramowitz and Stegun 7.1.26)


def test_fastpath_switch_turns_the_compiled_loops_off():
    assert not int8.fused_rows(Settings("off"))
    assert int8.fused_rows(Settings("auto")) == COMPILED
