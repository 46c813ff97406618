"""A NaN on one rank stops (or skips) the step on every rank together, in every stage, on 2 gloo CPU processes.

Each run injects a non-finite value on rank 1 only, at its second step: an MLM loss (which is rank-local), a
contrastive gradient behind a finite loss, a finetuning loss with a skip budget. Every rank must end the same
way at the same step with identical, finite weights; a hang fails the test by its timeout.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp
from net_helpers import free_port
from train_helpers import chatterbot_pairs, write_pairs, write_texts

from moembed.errors import MoembedError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny"
BAD_STEP = 2  # the step (1-based) whose values are made non-finite on rank 1
TIMEOUT_S = 420
COLLECTIVE_TIMEOUT_S = 90


class _NanGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss whose gradient is not (an overflow in backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


@contextmanager
def _nan_mlm_loss(rank: int, bad_steps: tuple[int, ...] = (BAD_STEP,)):
    """Rank 1's MLM loss is NaN at `bad_steps` (and so are its gradients)."""
    from moembed.train.mlm import MLMModel

    real, calls = MLMModel.forward, []

    def forward(self, *a, **k):
        out = real(self, *a, **k)
        calls.append(1)
        if rank == 1 and len(calls) in bad_steps:
            out.mlm = out.mlm * float("nan")
        return out

    with mock.patch.object(MLMModel, "forward", forward):
        yield


@contextmanager
def _nan_contrastive(rank: int, gradient_only: bool):
    """Rank 1's contrastive objective at step BAD_STEP: a NaN loss, or a finite loss with a NaN gradient."""
    import moembed.train.step as step_mod

    real, calls = step_mod._objective, []

    def objective(enc, *a, **k):
        calls.append(1)
        if rank == 1 and len(calls) == BAD_STEP:
            if gradient_only:
                enc.embeddings[0] = _NanGradient.apply(enc.embeddings[0])
            else:
                total, (logged, *rest) = real(enc, *a, **k)  # logged: the detached losses, total first
                return total * float("nan"), (logged * float("nan"), *rest)
        return real(enc, *a, **k)

    with mock.patch.object(step_mod, "_objective", objective):
        yield


def _runs(data: dict, out: Path, minilm: str) -> dict:
    """name → (config, overrides, injection)."""
    common = [f"tokenizer={minilm}", "steps=3", "checkpoint.every=1", "checkpoint.keep_last=3", "log_every=1"]
    return {
        "mlm": (TINY / "mlm.yaml", [f"data.0.path={data['en']}", f"data.1.path={data['de']}"],
                lambda r: _nan_mlm_loss(r)),
        "contrastive": (TINY / "contrastive.yaml", [f"data.0.path={data['pairs']}"],
                        lambda r: _nan_contrastive(r, gradient_only=True)),
        "finetune": (TINY / "finetune.yaml",
                     [f"data.0.path={data['a']}", f"data.1.path={data['b']}", "skip_nonfinite=1"],
                     lambda r: _nan_contrastive(r, gradient_only=False)),
    }, common


def _worker(rank: int, world: int, port: int, out: str, data: dict, minilm: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from moembed import distributed as dist
    from moembed.train import loop
    from moembed.train.config import load_config

    # A collective left waiting (a rank that stopped alone) fails after COLLECTIVE_TIMEOUT_S instead of hanging.
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    assert dist.init_from_env("gloo") and dist.world_size() == world
    trainers = []
    real_init = loop.Trainer.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        trainers.append(self)

    results: dict = {}
    runs, common = _runs(data, Path(out), minilm)
    try:
        with mock.patch.object(loop.Trainer, "__init__", init):
            for name, (config, overrides, inject) in runs.items():
                error = None
                with inject(rank):
                    try:
                        cfg = load_config(config, common + overrides + [f"output_dir={Path(out) / name}"])
                        loop.train(cfg, progress=False)
                    except MoembedError as e:
                        error = str(e)
                t = trainers[-1] if trainers else None
                results[name] = {
                    "error": error,
                    "step": None if t is None else t.step,
                    "weights": None if t is None else {k: v.detach().clone() for k, v in t.module.state_dict().items()},
                }
                trainers.clear()
                torch.save(results, os.path.join(out, f"rank{rank}.pt"))  # after every run: a hang keeps the rest
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, minilm_path):
    """What each of 2 gloo ranks ended with, per run; fails (never hangs) when a rank does not finish in time."""
    d = tmp_path_factory.mktemp("nonfinite")
    pairs = chatterbot_pairs()
    texts = [a for _, a in pairs]
    data = {
        "en": write_texts(d / "en.jsonl", texts[:300]), "de": write_texts(d / "de.jsonl", texts[300:600]),
        "pairs": write_pairs(d / "pairs.jsonl", pairs[:300]),
        "a": write_pairs(d / "a.jsonl", pairs[:300], negatives=2), "b": write_pairs(d / "b.jsonl", pairs[300:600], negatives=2),
    }
    data = {k: str(v) for k, v in data.items()}
    ctx = mp.start_processes(_worker, args=(2, free_port(), str(d), data, str(minilm_path)), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                break
    except Exception as e:  # a worker raised (not a MoembedError): report what it said
        pytest.fail(f"a rank failed: {e}")
    finally:
        alive = [p for p in ctx.processes if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
    saved = [torch.load(d / f"rank{r}.pt", weights_only=False) if (d / f"rank{r}.pt").exists() else {}
             for r in range(2)]
    if alive:
        done = [sorted(s) for s in saved]
        pytest.fail(f"ranks still running after {TIMEOUT_S} s (a hang); runs finished per rank: {done}")
    return saved, d


def _same_finite_weights(r0: dict, r1: dict) -> None:
    assert r0["weights"].keys() == r1["weights"].keys()
    for k, v in r0["weights"].items():
        assert torch.isfinite(v).all(), k
        assert torch.equal(v, r1["weights"][k]), k


def _checkpoint_weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.dist
@pytest.mark.parametrize("run, source", [("mlm", "loss"), ("contrastive", "gradient norm")])
def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(two_ranks, run, source):
    saved, d = two_ranks
    r0, r1 = saved[0][run], saved[1][run]
    for r in (r0, r1):
        assert r["error"] is not None, f"{run}: a rank did not stop"
        assert f"step {BAD_STEP}:" in r["error"] and source in r["error"] and "rank 1" in r["error"], r["error"]
        assert "every rank" in r["error"] and f"step-{BAD_STEP - 1:08d}" in r["error"], r["error"]
        assert r["step"] == BAD_STEP - 1  # the bad step made no update
    assert r0["error"] == r1["error"]
    _same_finite_weights(r0, r1)
    # The weights are those of the last good checkpoint: the bad step changed nothing.
    ckpt = _checkpoint_weights(d / run / "checkpoints" / f"step-{BAD_STEP - 1:08d}")
    for k, v in ckpt.items():
        assert torch.equal(v, r0["weights"][k]), k
    assert not (d / run / "model").exists()


@pytest.mark.dist
def test_a_nan_on_one_rank_is_skipped_on_every_rank_within_the_budget(two_ranks):
    saved, d = two_ranks
    r0, r1 = saved[0]["finetune"], saved[1]["finetune"]
    assert r0["error"] is None and r1["error"] is None
    assert r0["step"] == r1["step"] == 3
    _same_finite_weights(r0, r1)
    recs = [json.loads(x) for x in (d / "finetune" / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in recs if r.get("event") == "skipped"]
    assert [r["step"] for r in skipped] == [BAD_STEP] and skipped[0]["ranks"] == [1]
    # The skipped step made no update: the checkpoint after it holds the weights of the one before.
    before = _checkpoint_weights(d / "finetune" / "checkpoints" / f"step-{BAD_STEP - 1:08d}")
    after = _checkpoint_weights(d / "finetune" / "checkpoints" / f"step-{BAD_STEP:08d}")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert (d / "finetune" / "model" / "model.safetensors").exists()
