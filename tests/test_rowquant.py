"""`moembed.model.rowquant`: the compiled per-row loops of the int8 path against the torch ops they replace (codes
to the bit, rescale and GELU to float32 rounding), and the build: cached, rebuilt when the cached file is broken,
atomic, and refused cleanly (torch ops run instead) without a compiler or when the build fails."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import moembed.model.linear as linear
from moembed.model import rowquant

COMPILED = rowquant.load() is not None
needs_compiler = pytest.mark.skipif(not COMPILED, reason=f"no compiled kernels here: {rowquant.why_not}")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """`rowquant.load` with an empty cache folder of its own; the process's own kernels are restored after."""
    monkeypatch.setenv("MOEMBED_KERNEL_CACHE", str(tmp_path / "kernels"))
    rowquant.load.cache_clear()
    yield tmp_path / "kernels"
    rowquant.load.cache_clear()


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
    codes, m, xo = rowquant.quantize_rows(rowquant.load(), x, keep, outliers, linear._ONEDNN_INV_STEP, 128.0)
    # torch: the range outside the outlier channels, the scaled rows, torch's quantiser on the fixed grid
    ref_m = x.abs().index_fill(1, outliers, 0.0).amax(1, keepdim=True).clamp_min(1e-12)
    xs = x / ref_m
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_codes = torch.quantize_per_tensor(xs, *linear.ONEDNN_GRID, torch.quint8).int_repr()
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
    got = rowquant.rescale_rows(rowquant.load(), y.clone(), m, bias, gelu)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-6)  # erf within 1.5e-7 (Abramowitz and Stegun 7.1.26)


def test_without_a_compiler_int8_runs_in_torch_ops(fresh_cache, monkeypatch, make_tiny):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert rowquant.load() is None
    assert "no C compiler (no-such-compiler-here)" in rowquant.why_not
    assert "per-row quantisation in torch ops (no C compiler" in linear.int8_path()
    if linear.int8_available():
        emb = linear.quantize_int8(make_tiny("bert"))
        assert emb.encode(["a text", "another"]).shape[0] == 2
        assert emb.encoder.layers[0].qkv.last_path == "int8"
    assert not fresh_cache.exists() or not any(fresh_cache.iterdir())  # nothing half-built left behind


def test_a_failing_build_is_reported_and_leaves_no_file(fresh_cache, monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'rowquant.c:1: error: no vectors today' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert rowquant.load() is None
    assert "failed on rowquant.c" in rowquant.why_not and "no vectors today" in rowquant.why_not
    assert list(fresh_cache.iterdir()) == []  # the temporary file was removed, no .so was published


@needs_compiler
def test_built_once_then_loaded_from_the_cache(fresh_cache, monkeypatch):
    built = []
    build = rowquant.build
    monkeypatch.setattr(rowquant, "build", lambda *a: built.append(a[0]) or build(*a))
    assert rowquant.load() is not None and len(built) == 1
    assert list(fresh_cache.iterdir()) == built  # published under its final name only, no temporary left
    rowquant.load.cache_clear()
    assert rowquant.load() is not None and len(built) == 1  # found in the cache, not built again


@needs_compiler
def test_a_broken_cached_file_is_rebuilt(fresh_cache, monkeypatch):
    target = rowquant.library_path(rowquant._compiler())
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\x7fELF cut short")  # a copy cut short, a disk that filled up
    built = []
    build = rowquant.build
    monkeypatch.setattr(rowquant, "build", lambda *a: built.append(a[0]) or build(*a))
    lib = rowquant.load()
    assert lib is not None and built == [target]
    y = rowquant.rescale_rows(lib, torch.ones(2, 3), torch.full((2, 1), 2.0), torch.zeros(3), False)
    assert y.eq(2.0).all()


def test_fastpath_switch_turns_the_compiled_loops_off(monkeypatch):
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "1")
    assert linear.fused_rows() is None
