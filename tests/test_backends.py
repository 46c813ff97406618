"""Backends and settings (`moembed.model.backends`, `moembed.model.settings`): a model's fast paths are chosen once,
when it is loaded (or built), recorded in a public frozen record, and give the plain torch layers' outputs."""

from __future__ import annotations

import dataclasses
import logging
import os
import typing

import numpy as np
import pytest
import torch

from moembed.errors import MoembedError
from moembed.model import cpu, kernels, native
from moembed.model.attention import Attention
from moembed.model.fast import attention as fast_attention
from moembed.model.fast.attention import CompiledAttention
from moembed.model.config import MoEConfig
from moembed.model.embedder import Embedder
from moembed.model.encoder import Encoder
from moembed.model.experts import Experts
from moembed.model.fast import packed
from moembed.model.fast.experts import GroupedExperts, PackedExperts
from moembed.model.fast.moe import InPlaceMoEBlock
from moembed.model.fast.packed import PackedLinear
from moembed.model.linear import Linear
from moembed.model.moe import MoEBlock
from moembed.model.presets import tiny_config
from moembed.model.settings import BACKENDS, Settings, UsesSettings
from moembed.model.tokenizer import TextTokenizer
from spy import calls_of

TEXTS = ["Experts are MLPs.", "A router picks two of them for every token.", "x", "Padding is never routed here."]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, minilm_path):
    """A saved tiny MoE model with heads of 32 (the compiled attention's), 2 layers, 4 experts top-2."""
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=30522, hidden_size=64, num_heads=2, moe=MoEConfig(num_experts=4, top_k=2))
    d = tmp_path_factory.mktemp("m") / "moe"
    Embedder(Encoder(cfg), TextTokenizer.from_dir(minilm_path, 32)).save(d)
    return d


def _layers(emb, cls):
    return [m for m in emb.modules() if isinstance(m, cls)]


def _types(emb, cls) -> set[type]:
    return {type(m) for m in _layers(emb, cls)}


EXPERTS = {"grouped": GroupedExperts, "loop": Experts, "packed-loop": PackedExperts}  # the record's "moe" path


def test_the_cli_offers_the_library_backends():
    from moembed.cli import options as o

    assert typing.get_args(o.Backend) == tuple(BACKENDS)


def test_load_records_the_backend_and_its_settings_reach_every_layer(moe_dir, caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="moembed"):
        emb = Embedder.load(moe_dir, backend="torch")
    assert emb.backend.name == "torch" and emb.backend.settings == Settings("off")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("backend")] == [str(emb.backend)]
    assert {m.settings for m in emb.modules() if isinstance(m, UsesSettings)} == {Settings("off")}
    with pytest.raises(dataclasses.FrozenInstanceError):
        emb.backend.name = "fast"  # a record, not a switch
    assert emb.backend.path("linear") == "plain" and _types(emb, Linear) == {Linear}
    assert _types(emb, MoEBlock) == {MoEBlock} and _types(emb, Experts) == {EXPERTS[emb.backend.path("moe")]}
    assert emb.backend.path("attention") == "torch" and _types(emb, Attention) == {Attention}
    fast = calls_of(monkeypatch, packed, "packed_linear")
    emb.encode(TEXTS)
    assert not fast  # no packed kernel ran


@pytest.mark.skipif(not cpu.has_packed() or native.load("attention") is None,
                    reason="no oneDNN packed kernels or no C compiler here")
def test_fast_backend_takes_every_fast_path_and_its_record_says_so(moe_dir, monkeypatch):
    emb = Embedder.load(moe_dir, backend="fast")
    assert (emb.backend.path("linear"), emb.backend.path("attention"), emb.backend.path("moe")) == (
        "packed", "compiled", "packed-loop")
    assert _types(emb, Linear) == {PackedLinear} and _types(emb, MoEBlock) == {InPlaceMoEBlock}
    assert _types(emb, Experts) == {PackedExperts} and _types(emb, Attention) == {CompiledAttention}
    dense, combined = calls_of(monkeypatch, packed, "packed_linear"), calls_of(monkeypatch, kernels, "combine_rows")
    attended = calls_of(monkeypatch, fast_attention, "packed_attention")
    emb.encode(TEXTS)
    # qkv, out and the dense MLP's fc1/fc2 of layer 0; qkv and out of layer 1 (its MLP is the MoE block)
    assert len(dense) == 6 and len(combined) == 1 and len(attended) == 2


@pytest.mark.parametrize("backend", ["auto", "fast"])
def test_each_backend_equals_the_plain_layers(moe_dir, backend):
    # "torch" is the reference: plain torch layers, as training runs them. Float32 fast paths run other kernels
    # (packed GEMMs, attention.c), so they agree to float32 rounding; int8 to int8's.
    ref = Embedder.load(moe_dir, backend="torch").encode(TEXTS)
    got = Embedder.load(moe_dir, backend=backend).encode(TEXTS)
    np.testing.assert_allclose(got, ref, atol=2e-6, rtol=0)
    if cpu.int8_available():
        q_ref = Embedder.load(moe_dir, backend="torch", dtype="int8")
        q = Embedder.load(moe_dir, backend=backend, dtype="int8")
        assert q_ref.backend.path("linear") == q.backend.path("linear") == "int8"
        assert (q.encode(TEXTS) * q_ref.encode(TEXTS)).sum(1).min() > 0.999
        assert (q.encode(TEXTS) * ref).sum(1).min() > 0.99


def test_an_unknown_backend_is_refused_before_the_weights_are_read(tmp_path):
    with pytest.raises(MoembedError, match="backend: expected one of auto, torch, fast, got 'onnx'"):
        Embedder.load(tmp_path / "no-such-model", backend="onnx")


def test_auto_reads_the_user_switch_once_and_nothing_writes_the_environment(moe_dir, monkeypatch):
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "1")
    before = dict(os.environ)
    emb = Embedder.load(moe_dir)  # backend "auto": MOEMBED_NO_FASTPATH=1 means every fast path off
    assert emb.backend.name == "auto" and emb.backend.settings == Settings("off")
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "0")  # too late: the model keeps what it was loaded with
    fast = calls_of(monkeypatch, packed, "packed_linear")
    emb.encode(TEXTS)
    assert _types(emb, Linear) == {Linear} and not fast
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "1")
    assert dict(os.environ) == before


def test_two_models_in_one_process_keep_their_own_settings(moe_dir):
    # Settings belong to a model, not to the process: a server's model and another one never switch each other.
    plain, auto = Embedder.load(moe_dir, backend="torch"), Embedder.load(moe_dir, backend="auto")
    a = plain.encode(TEXTS)
    auto.encode(TEXTS)
    np.testing.assert_array_equal(plain.encode(TEXTS), a)
    assert {m.settings for m in _layers(plain, Linear)} == {Settings("off")}
    assert {m.settings for m in _layers(auto, Linear)} == {Settings.from_env()}


def test_settings_are_validated_on_construction():
    with pytest.raises(MoembedError, match="fastpath: expected one of auto, on, off"):
        Settings("sometimes")
    with pytest.raises(MoembedError, match="MOEMBED_NO_FASTPATH: expected 0"):
        Settings.from_env({"MOEMBED_NO_FASTPATH": "true"})
    assert Settings.from_env({}) == Settings("auto") and Settings.for_backend("fast", {}) == Settings("on")
    assert Settings.for_backend("auto", {"MOEMBED_NO_FASTPATH": "0"}) == Settings("on")


def test_eval_loads_with_the_backend_asked_for(moe_dir):
    from moembed.cli.eval import _load_model

    emb, _ = _load_model(moe_dir, None, "cpu", "float32", None, "torch")
    assert emb.backend.name == "torch"
    with pytest.raises(MoembedError, match="--backend"):
        _load_model(moe_dir, 1.0, "cpu", "float32", None, "fast")


def test_encode_and_serve_load_with_the_backend_asked_for(moe_dir, tmp_path):
    """`moembed encode --backend` (each --nproc rank too) and `moembed serve --backend` reach `Embedder.load`."""
    from moembed.cli.encode import _worker_argv
    from moembed.recipes.corpus_input import CorpusInput
    from moembed.recipes.encode_corpus import EncodeJob, load_model
    from moembed.serve.config import ServeConfig
    from moembed.serve.engine import EmbedderEngine

    (tmp_path / "in.txt").write_text("a text\n")
    job = EncodeJob(model=str(moe_dir), input=CorpusInput.open(tmp_path / "in.txt", "text", None, None),
                    out=tmp_path / "o.npy", device="cpu", backend="torch")
    assert load_model(job).backend.name == "torch"
    assert _worker_argv(str(moe_dir), tmp_path / "in.txt", job, None, True)[-3:-1] == ["--backend", "torch"]
    assert EmbedderEngine.load(str(moe_dir), device="cpu", backend="torch").emb.backend.name == "torch"
    assert ServeConfig.from_flags(model=str(moe_dir), backend="fast").backend == "fast"
    with pytest.raises(MoembedError, match="--backend: unknown backend 'nope'"):
        ServeConfig.from_flags(model=str(moe_dir), backend="nope")
