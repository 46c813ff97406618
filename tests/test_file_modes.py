"""Outputs get the process's umask: 0644 files and 0755 directories under umask 022, 0600 / 0700 under 077, for
every writer built on `fileio.atomic_path` / `atomic_dir` (a file, a model directory, a report, a checkpoint)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from torch import nn

from moembed.eval.report import write_results
from moembed.eval.runner import TaskResult
from moembed.fileio import atomic_dir, atomic_path, write_jsonl
from moembed.model.embedder import Embedder
from moembed.train.checkpoint import CheckpointManager
from moembed.train.config import OptimConfig
from moembed.train.optim import build_optimizer

UMASKS = [pytest.param(0o022, id="umask-022"), pytest.param(0o077, id="umask-077")]


@pytest.fixture
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    """Permission bits of `root` and of everything under it."""
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    return {str(p.relative_to(root.parent)): stat.S_IMODE(p.stat().st_mode) for p in paths}


def _check(root: Path, mask: int) -> None:
    modes = _modes(root)
    dirs = {p for p in modes if (root.parent / p).is_dir()}
    assert len(modes) > len(dirs) or not root.is_dir()  # some files were written
    want = {p: (0o777 if p in dirs else 0o666) & ~mask for p in modes}
    assert modes == want, {p: (oct(m), oct(want[p])) for p, m in modes.items() if m != want[p]}


@pytest.mark.parametrize("umask", UMASKS, indirect=True)
def test_atomic_path_and_atomic_dir_follow_the_umask(tmp_path, umask):
    with atomic_path(tmp_path / "out" / "a.json") as tmp:
        tmp.write_text("{}")
    write_jsonl(tmp_path / "out" / "b.jsonl", [{"x": 1}])
    with atomic_dir(tmp_path / "out" / "tree") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "c.txt").write_text("c")
    with atomic_dir(tmp_path / "out" / "tree") as tmp:  # a replacement (exchange), not only a first write
        (tmp / "d.txt").write_text("d")
    _check(tmp_path / "out", umask)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.json", "b.jsonl", "tree"]  # no leftovers


@pytest.mark.parametrize("umask", UMASKS, indirect=True)
def test_a_saved_model_follows_the_umask(tmp_path, make_tiny, umask):
    make_tiny().save(tmp_path / "first")
    # a model loaded from a directory copies its tokenizer files from there: their modes are not copied with them
    os.chmod(tmp_path / "first" / "tokenizer.json", 0o640)
    Embedder.load(tmp_path / "first").save(tmp_path / "models" / "second")
    _check(tmp_path / "models", umask)


@pytest.mark.parametrize("umask", UMASKS, indirect=True)
def test_an_evaluation_report_follows_the_umask(tmp_path, umask):
    results = [TaskResult("t", "retrieval", "test", {"ndcg_at_10": s}, s, 0.1, dim=d) for d, s in ((8, 0.4), (16, 0.5))]
    write_results(results, tmp_path / "report", "m", None)
    assert {"results.json", "results.md", "score_vs_dim.png"} <= {p.name for p in (tmp_path / "report").iterdir()}
    _check(tmp_path / "report", umask)


@pytest.mark.parametrize("umask", UMASKS, indirect=True)
def test_a_checkpoint_follows_the_umask(tmp_path, umask):
    model = nn.Linear(4, 2)
    opt, sched = build_optimizer(model, OptimConfig(lr=1e-2), 4)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    CheckpointManager(tmp_path / "ck", 2).save(1, model, opt, sched, {"position": 1})
    _check(tmp_path / "ck", umask)
