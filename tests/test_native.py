"""`moembed.model.native`: the package's C loops built once per machine and cached, rebuilt when the cached file is
broken, published atomically, and refused cleanly without a compiler or when the build fails — in which case
int8, attention and the MoE combine run torch ops instead, and say so."""

from __future__ import annotations

import pytest
import torch

from moembed.errors import MoembedError

import moembed.model.fast.int8 as int8
from moembed.model import backends, cpu, kernels, native
from moembed.model.attention import Attention
from moembed.model.fast import is_fast
from moembed.model.fast.int8 import Int8Linear
from moembed.model.quantize import quantize_int8
from moembed.model.settings import Settings
from spy import calls_of

COMPILED = native.load("rowquant") is not None and native.load("attention") is not None
needs_compiler = pytest.mark.skipif(not COMPILED, reason=f"no C compiler builds the loops here: {native.why_not('rowquant')}")


def _clear():
    native.built.cache_clear()
    kernels._lib.cache_clear()


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """Loading with an empty cache folder of its own; the process's own libraries are loaded again after."""
    monkeypatch.setenv("MOEMBED_KERNEL_CACHE", str(tmp_path / "kernels"))
    _clear()
    yield tmp_path / "kernels"
    _clear()


@pytest.fixture
def counted_builds(monkeypatch):
    built = []
    build = native.build
    monkeypatch.setattr(native, "build", lambda *a: built.append(a[1]) or build(*a))
    return built


def test_without_a_compiler_int8_and_attention_run_torch_ops(fresh_cache, monkeypatch, make_tiny):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert not any(kernels.available(name) for name in ("rowquant", "attention", "combine"))
    assert kernels.why_not("rowquant") == "no C compiler (no-such-compiler-here) on PATH"
    assert kernels.why_not("combine") == kernels.why_not("rowquant")
    with pytest.raises(MoembedError, match="rowquant.c is not built here"):  # called anyway: refused, not a crash
        kernels.rescale_rows(torch.ones(2, 3), torch.ones(2, 1), torch.zeros(3), False)
    assert "per-row quantisation in torch ops (no C compiler" in int8.int8_path(Settings())
    emb = make_tiny("bert")
    if cpu.int8_available():
        quantize_int8(emb)
    assert backends.use(emb, "fast").path("attention") == "torch"  # asked for, not built
    ran = calls_of(monkeypatch, int8, "int8_linear")
    assert emb.encode(["a text", "another, longer text"]).shape[0] == 2
    layer = emb.encoder.layers[0]
    assert type(layer.core) is Attention  # the plain module: nothing swapped in
    if cpu.int8_available():  # int8 matmuls, their per-row work in torch ops (`fused` off: nothing compiled)
        assert isinstance(layer.qkv, Int8Linear) and not layer.qkv.fused
        assert ran and not any(call[3] for call in ran)
    else:
        assert not is_fast(layer.qkv) and not ran
    assert not fresh_cache.exists()  # nothing was built, nothing half-built left behind


def test_a_failing_build_is_reported_and_leaves_no_file(fresh_cache, monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'rowquant.c:1: error: no vectors today' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert native.load("rowquant") is None
    assert "failed on rowquant.c" in native.why_not("rowquant") and "no vectors today" in native.why_not("rowquant")
    assert list(fresh_cache.iterdir()) == []  # the temporary file was removed, no library was published


@needs_compiler
def test_built_once_then_loaded_from_the_cache(fresh_cache, counted_builds):
    assert native.load("rowquant") is not None and native.load("attention") is not None
    assert sorted(fresh_cache.iterdir()) == sorted(counted_builds)  # final names only, no temporary left
    assert [p.name.split("-")[0] for p in counted_builds] == ["rowquant", "attention"]
    native.built.cache_clear()
    assert native.load("rowquant") is not None and len(counted_builds) == 2  # found in the cache, not rebuilt


@needs_compiler
def test_a_broken_cached_file_is_rebuilt(fresh_cache, counted_builds):
    target = native.library_path("rowquant", native.compiler())
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\x7fELF cut short")  # a copy cut short, a disk that filled up
    assert kernels.available("rowquant") and counted_builds == [target]
    y = kernels.rescale_rows(torch.ones(2, 3), torch.full((2, 1), 2.0), torch.zeros(3), False)
    assert y.eq(2.0).all()


@needs_compiler
def test_the_cache_key_follows_the_source(fresh_cache, monkeypatch, tmp_path):
    # An edited source (a new release) gets a file of its own instead of loading the old build.
    before = native.library_path("rowquant", native.compiler())
    edited = tmp_path / "rowquant.c"
    edited.write_text(native.source("rowquant").read_text() + "\n/* edited */\n")
    monkeypatch.setattr(native, "source", lambda name: edited)
    assert native.library_path("rowquant", native.compiler()) != before
