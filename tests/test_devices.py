"""Device selection from a name (`device: auto | cpu | cuda | mps`), and where the training run's collectives live:
the Trainer's constructor joins no process group and the MLM model's forward runs no collective."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moembed import distributed as dist
from moembed.devices import resolve_device
from moembed.errors import MoembedError
from spy import calls_of

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny"


def _machine(monkeypatch, cuda: int = 0, mps: bool = False) -> None:
    """Pretend this machine has `cuda` GPUs and (or not) Apple's MPS."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)


def test_auto_prefers_cuda_then_mps_then_cpu(monkeypatch):
    _machine(monkeypatch)
    assert resolve_device(None) == resolve_device("auto") == torch.device("cpu")
    _machine(monkeypatch, mps=True)
    assert resolve_device("auto") == torch.device("mps")
    _machine(monkeypatch, cuda=2, mps=True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1) and resolve_device("cpu") == torch.device("cpu")


def test_unknown_or_missing_devices_are_refused(monkeypatch):
    _machine(monkeypatch, cuda=1)
    with pytest.raises(MoembedError, match=r"device: unknown 'gpu'; choose one of auto, cpu, cuda, cuda:N, mps"):
        resolve_device("gpu")
    with pytest.raises(MoembedError, match=r"'cuda:3': this machine has 1 CUDA device"):
        resolve_device("cuda:3")
    with pytest.raises(MoembedError, match=r"'mps' asked for, but MPS is not available"):
        resolve_device("mps")
    _machine(monkeypatch)
    with pytest.raises(MoembedError, match=r"'cuda' asked for, but CUDA is not available"):
        resolve_device("cuda")


def test_train_device_under_torchrun_takes_the_local_rank(monkeypatch):
    from moembed.train.loop import train_device

    _machine(monkeypatch, cuda=4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert train_device("cuda") == train_device("auto") == torch.device("cuda", 3)
    assert train_device("cpu") == torch.device("cpu")


def _pairs(tmp_path: Path) -> Path:
    from train_helpers import chatterbot_pairs, write_pairs

    return write_pairs(tmp_path / "a.jsonl", chatterbot_pairs()[:64], negatives=1)


def test_device_is_a_config_value_and_the_trainer_joins_no_group(tmp_path, minilm_path, monkeypatch):
    from moembed.train.config import load_config
    from moembed.train.loop import Trainer, train

    base = [f"tokenizer={minilm_path}", f"data.0.path={_pairs(tmp_path)}", f"output_dir={tmp_path / 'run'}", "steps=1"]
    with pytest.raises(MoembedError, match=r"device: Input should be 'auto', 'cpu', 'cuda' or 'mps'"):
        load_config(TINY / "contrastive.yaml", base + ["device=gpu"])
    joined = []
    monkeypatch.setattr(dist, "init_from_env", lambda backend=None: joined.append(backend) or False)
    t = Trainer(load_config(TINY / "contrastive.yaml", base + ["device=cpu"]), progress=False)
    assert t.device == torch.device("cpu") and next(t.module.parameters()).device.type == "cpu"
    assert joined == []  # building a Trainer joins no process group
    train(load_config(TINY / "contrastive.yaml", base + ["device=cpu"]), progress=False)
    assert joined == ["gloo"]  # the train() entry does, once
    if not torch.cuda.is_available():
        with pytest.raises(MoembedError, match="CUDA is not available"):
            Trainer(load_config(TINY / "contrastive.yaml", base + ["device=cuda"]), progress=False)


def test_mlm_forward_runs_no_collective_and_the_step_does(make_tiny, monkeypatch):
    from moembed.train.mlm import IGNORE, MLMModel
    from moembed.train.stages import mlm_loss

    emb = make_tiny("bert", moe={"num_experts": 2, "top_k": 1, "layers": [1]})
    model = MLMModel(emb, aux_loss_coef=0.1)
    ids = torch.randint(1000, 2000, (2, 12))
    labels = torch.where(torch.rand(ids.shape) < 0.5, ids, torch.full_like(ids, IGNORE))
    local = model.loss(model(ids, labels))
    calls = []
    real = dist.all_reduce_sum
    monkeypatch.setattr(dist, "all_reduce_sum", lambda t: calls.append(t.shape) or real(t))
    out = model(ids, labels)
    assert calls == []  # the forward: no collective
    stepped = mlm_loss(model, out)
    assert calls == [(1, 2)]  # the step: the routing counts of one MoE layer, summed over ranks
    assert torch.equal(stepped.aux, local.aux) and torch.equal(stepped.loss.detach(), local.loss.detach())


def test_checkpoint_meta_names_the_stage(tmp_path, minilm_path):
    from moembed.train.config import load_config
    from moembed.train.loop import train

    pairs = _pairs(tmp_path)
    cfg = load_config(TINY / "finetune.yaml", [f"tokenizer={minilm_path}", f"data.0.path={pairs}",
                                               f"data.1.path={pairs}", f"output_dir={tmp_path / 'run'}", "steps=1"])
    train(cfg, progress=False)
    (ckpt,) = (tmp_path / "run" / "checkpoints").iterdir()
    assert json.loads((ckpt / "state.json").read_text())["meta"]["stage"] == "finetune"


# ---- --device on the commands that embed, and the Embedder's device / dtype -------------------------------------


def _invoke(*args):
    from typer.testing import CliRunner

    from moembed.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_commands_default_to_auto_and_pass_the_device_on(monkeypatch, tmp_path, make_tiny):
    """eval, moee, filter and mine take --device (default auto: the accelerator when there is one)."""
    import moembed.data.curate as curate_mod
    from moembed.model.embedder import Embedder

    seen = []

    def fake_load(cls, path, max_length=None, device="cpu", dtype="float32", pooling=None, backend="auto"):
        seen.append(device)
        raise MoembedError("stop here")

    monkeypatch.setattr(Embedder, "load", classmethod(fake_load))
    monkeypatch.setattr(curate_mod, "curate", lambda data, out, teacher, cfg, **kw: seen.append(cfg.device) or {})
    monkeypatch.setattr("moembed.cli.data._print_report", lambda report: None)
    monkeypatch.setattr("moembed.eval.load_task", lambda d: None)  # eval reads its tasks before the model
    make_tiny("bert", moe={"num_experts": 2, "top_k": 1, "layers": [1]}).save(tmp_path / "m")
    (tmp_path / "in.txt").write_text("a\n")
    (tmp_path / "p.jsonl").write_text('{"query": "q", "document": "d"}\n')
    for device in (None, "cpu"):
        extra = [] if device is None else ["--device", device]
        seen.clear()
        _invoke("eval", tmp_path / "m", tmp_path, "--out", tmp_path / "res", *extra)
        _invoke("moee", tmp_path / "m", tmp_path / "in.txt", "-o", tmp_path / "o.npy", "--plain", *extra)
        for cmd in ("filter", "mine"):
            r = _invoke(cmd, tmp_path / "p.jsonl", "--teacher", tmp_path / "m", "--out", tmp_path / "o.jsonl", *extra)
            assert r.exit_code == 0, r.output
        assert seen == [device or "auto"] * 4


def test_commands_name_the_device_choices(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"query": "q", "document": "d"}\n')
    for cmd in ("filter", "mine"):
        r = _invoke(cmd, tmp_path / "p.jsonl", "--teacher", tmp_path / "m", "--out", tmp_path / "o.jsonl", "--device", "gpu")
        assert "device: unknown 'gpu'; choose one of auto, cpu, cuda, cuda:N, mps" in str(r.exception)


def test_embedder_load_device_and_dtype(make_tiny, tmp_path, monkeypatch):
    from moembed.devices import resolve_dtype
    from moembed.model.embedder import Embedder

    make_tiny("bert").save(tmp_path / "m")
    plain = Embedder.load(tmp_path / "m")
    assert plain.autocast is None and next(plain.parameters()).device.type == "cpu"
    bf16 = Embedder.load(tmp_path / "m", device="cpu", dtype="bfloat16")
    assert bf16.autocast == torch.bfloat16
    texts = ["a short text", "another somewhat longer text about embeddings"]
    a, b = plain.encode(texts), bf16.encode(texts)
    assert not np.array_equal(a, b) and (a * b).sum(1).min() > 0.99  # bf16 ran, and is close
    np.testing.assert_array_equal(bf16.encode(texts), plain.encode(texts, bf16=True))
    with pytest.raises(MoembedError, match="dtype: unknown 'half'; choose one of auto, float32"):
        Embedder.load(tmp_path / "m", dtype="half")
    with pytest.raises(MoembedError, match="device: unknown 'gpu'; choose one of"):
        Embedder.load(tmp_path / "m", device="gpu")
    with pytest.raises(MoembedError, match="device: unknown 'tpu'"):
        plain.encode(texts, device="tpu")
    assert resolve_dtype("auto", torch.device("cpu")) is None
    assert resolve_dtype("auto", torch.device("cuda")) == resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("fp16", torch.device("cuda")) == torch.float16


def test_embedder_load_int8_and_the_compute_in_the_cache_key(make_tiny, tmp_path, monkeypatch):
    """dtype="int8": the model's int8 layers on (no autocast), refused off the CPU before any weight is read; a
    compute other than float32 is part of `settings_key` (eval's cache key), float32's key unchanged."""
    from moembed.devices import resolve_dtype
    from moembed.model.embedder import Embedder
    import moembed.model.fast.int8 as int8_module
    from moembed.model.cpu import int8_available
    from moembed.model.fast.int8 import Int8Linear, fused_rows

    make_tiny("bert").save(tmp_path / "m")
    plain = Embedder.load(tmp_path / "m")
    built = Embedder.from_parts(plain.parts())  # never loaded with a dtype
    assert plain.compute == "float32" and plain.settings_key() == built.settings_key()
    bf16 = Embedder.load(tmp_path / "m", dtype="bf16")
    assert bf16.compute == "bfloat16" and bf16.settings_key() != plain.settings_key()
    assert resolve_dtype("int8", torch.device("cpu")) is None
    with pytest.raises(MoembedError, match=r"dtype: 'int8' \(dynamic int8\) runs on the CPU only; the device is cuda"):
        resolve_dtype("int8", torch.device("cuda"))
    with pytest.raises(MoembedError, match="choose one of auto, float32, .*, int8"):
        resolve_dtype("int4", torch.device("cpu"))
    if not int8_available():
        return
    int8 = Embedder.load(tmp_path / "m", dtype="int8")
    assert int8.compute == "int8" and int8.autocast is None
    assert len({plain.settings_key(), bf16.settings_key(), int8.settings_key()}) == 3
    texts = ["a short text", "another somewhat longer text about embeddings"]
    ran = calls_of(monkeypatch, int8_module, "int8_linear")
    a, b = plain.encode(texts), int8.encode(texts)
    assert not np.array_equal(a, b) and (a * b).sum(1).min() > 0.99
    assert int8.backend.path("linear") == "int8" and plain.backend.path("linear") != "int8"
    qkv = int8.encoder.layers[0].qkv
    assert isinstance(qkv, Int8Linear) and qkv.fused == fused_rows(qkv.settings)
    assert ran and all(call[3] == qkv.fused for call in ran)  # int8 matmuls ran, for int8's encode only
