"""Device selection from a name (`device: auto | cpu | cuda | mps`), and where the training run's collectives live:
the Trainer's constructor joins no process group and the MLM model's forward runs no collective."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moembed import distributed as dist
from moembed.devices import resolve_device
from moembed.errors import MoembedError

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
