"""Durable outputs: fsync before every rename, old-or-new at every step of a directory replacement, SIGKILL at
seeded instants during checkpoint and model saves (resume stays bit-identical), full disk during saves; and what
the texts reader (`read_texts`) says of a line it cannot read."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import resource
import shutil
import signal
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from kill_helpers import Killer, run_forked
from safetensors.torch import load_file
from torch import nn

from moembed import fileio
from moembed.errors import MoembedError
from moembed.fileio import atomic_dir, atomic_path, recover_dir
from moembed.train.checkpoint import CheckpointManager
from moembed.train.config import OptimConfig
from moembed.train.optim import build_optimizer

MODES = [pytest.param(False, id="exchange"), pytest.param(True, id="rename-aside")]


@pytest.fixture
def fallback(request, monkeypatch):
    """With the parameter True, act as on a system without renameat2(RENAME_EXCHANGE)."""
    if request.param:
        monkeypatch.setattr(fileio, "_renameat2", None)
    return request.param


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- fsync ------------------------------------------------------------------------------------------------------


def _spy_fsync(monkeypatch) -> list[tuple[str, str]]:
    """Record ('fsync', path) and ('rename', target) in call order."""
    log = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        log.append(("rename", str(b)))
        return real_replace(a, b)

    def exchange(a, b, real=fileio._exchange):
        done = real(a, b)
        if done:
            log.append(("rename", str(b)))
        return done

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(fileio, "_exchange", exchange)
    return log


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="names open files through /proc (Linux)")
def test_atomic_path_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    log = _spy_fsync(monkeypatch)
    target = tmp_path / "out.json"
    with atomic_path(target) as tmp:
        tmp.write_text("{}")
    assert [e for e, _ in log] == ["fsync", "rename", "fsync"]
    assert log[0][1] == str(tmp) and log[1][1] == str(target) and log[2][1] == str(tmp_path)


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="names open files through /proc (Linux)")
@pytest.mark.parametrize("fallback", MODES, indirect=True)
def test_atomic_dir_fsyncs_every_file_and_directory_before_the_swap(tmp_path, monkeypatch, fallback):
    target = tmp_path / "model"
    with atomic_dir(target) as tmp:
        (tmp / "old.txt").write_text("old")
    log = _spy_fsync(monkeypatch)
    with atomic_dir(target) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "a.txt").write_text("a")
        (tmp / "sub" / "b.txt").write_text("b")
    first_rename = next(i for i, (e, _) in enumerate(log) if e == "rename")
    before = {p for e, p in log[:first_rename]}
    assert before == {str(tmp / "a.txt"), str(tmp / "sub" / "b.txt"), str(tmp / "sub"), str(tmp)}
    assert ("fsync", str(tmp_path)) in log[first_rename:]  # the parent, after the swap
    assert _tree(target) == {"a.txt": "a", "sub/b.txt": "b"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no aside, no temporary left


# ---- every step of a replacement leaves the old or the new directory ----------------------------------------------


@pytest.mark.parametrize("fallback", MODES, indirect=True)
def test_a_kill_between_any_two_steps_of_a_replacement_leaves_old_or_new(tmp_path, monkeypatch, fallback):
    """Before and after every filesystem step of the swap, copy the parent directory as a kill would leave it and
    read it as a reader does (recover_dir first): the target is always complete, with the old or the new files."""
    parent = tmp_path / "out"
    target = parent / "model"
    old, new = {"a": "old a", "b": "old b"}, {"a": "new a", "c": "new c", "d/e": "new e"}
    with atomic_dir(target) as tmp:
        for name, text in old.items():
            (tmp / name).write_text(text)
    seen, observing = [], [False]

    def observe():
        if observing[0]:
            return
        observing[0] = True
        try:
            snap = tmp_path / f"snap{len(seen)}"
            shutil.copytree(parent, snap)
            missing = not (snap / "model").exists()
            recover_dir(snap / "model")
            seen.append((missing, _tree(snap / "model")))
        finally:
            observing[0] = False

    def wrap(fn):
        def step(*a, **k):
            observe()
            try:
                return fn(*a, **k)
            finally:
                observe()
        return step

    for mod, name in ((os, "replace"), (shutil, "rmtree"), (fileio, "_exchange"), (fileio, "_fsync_dir")):
        monkeypatch.setattr(mod, name, wrap(getattr(mod, name)))
    with atomic_dir(target) as tmp:
        (tmp / "d").mkdir()
        for name, text in new.items():
            (tmp / name).write_text(text)
    monkeypatch.undo()
    assert len(seen) >= 6
    assert all(tree in (old, new) for _, tree in seen), [t for _, t in seen if t not in (old, new)]
    assert seen[0][1] == old and seen[-1][1] == new
    # the rename-aside fallback passes through a state with no target, which recovery repairs; the swap never does
    assert any(missing for missing, _ in seen) == fallback
    assert _tree(target) == new and sorted(p.name for p in parent.iterdir()) == ["model"]


# ---- SIGKILL at seeded instants -----------------------------------------------------------------------------------

STEPS = 60


def _tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt, sched = build_optimizer(model, OptimConfig(lr=1e-2, schedule="cosine", warmup_steps=2), STEPS)
    return model, opt, sched


def _train_and_save(ckdir: Path, keep_last: int, kill: Killer | None) -> None:
    """Resume from the latest checkpoint (or start), then train to STEPS saving every step, `kill` active in saves."""
    model, opt, sched = _tiny()
    mgr = CheckpointManager(ckdir, keep_last)
    latest = mgr.latest()
    step = mgr.load(latest, model, opt, sched).step if latest else 0
    if latest is None:
        torch.manual_seed(1)  # the data (global RNG) of a fresh run; a resumed one restores it from the checkpoint
    while step < STEPS:
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()
        step += 1
        with kill.active() if kill else nullcontext():
            mgr.save(step, model, opt, sched, {"position": step})


def _loadable_steps(ckdir: Path, ref: dict[int, dict]) -> list[int]:
    """Every listed checkpoint restores, and holds exactly the uninterrupted run's state at its step."""
    mgr = CheckpointManager(ckdir)
    steps = []
    for path in mgr.all():
        model, opt, sched = _tiny()
        r = mgr.load(path, model, opt, sched)
        assert r.data_state == {"position": r.step}
        assert all(torch.equal(v, ref[r.step][k]) for k, v in model.state_dict().items()), path
        steps.append(r.step)
    return steps


# (anchor, highest k): a whole save is ~9,000-13,000 events; the swap ~400; pruning ~160.
CHECKPOINT_WINDOWS = [(None, 20_000), ("_replace_dir", 400), ("_prune", 200), ("_remove_tree", 120)]


def test_sigkill_at_seeded_instants_of_checkpoint_saves(tmp_path):
    mgr = _ckpt(tmp_path / "warm")[0]  # first uses are slow (lazy imports): pay them once, before the forks
    mgr.load(mgr.latest(), *_tiny())
    ref_dir = tmp_path / "ref"
    assert run_forked(_train_and_save, ref_dir, STEPS, None) == 0
    ref = {s: load_file(str(ref_dir / f"step-{s:08d}" / "model.safetensors")) for s in range(1, STEPS + 1)}
    ck, rng, kills, latest = tmp_path / "ck", random.Random(18), 0, 0
    for _ in range(30):
        anchor, hi = rng.choice(CHECKPOINT_WINDOWS)
        code = run_forked(_train_and_save, ck, 2, Killer(rng.randint(1, hi), anchor))
        assert code in (0, -signal.SIGKILL)
        kills += code == -signal.SIGKILL
        steps = _loadable_steps(ck, ref)
        assert (steps[-1] if steps else 0) >= latest  # never loses a complete checkpoint
        latest = steps[-1] if steps else 0
    assert kills >= 25 and 0 < latest < STEPS  # the kills landed, and some progress survived them
    assert run_forked(_train_and_save, ck, 2, None) == 0  # resume to the end: bit-identical
    assert _loadable_steps(ck, ref)[-1] == STEPS
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".")]  # leftovers of killed saves pruned


def _set_version(emb, v: int) -> None:
    emb.name = f"v{v}"
    g = torch.Generator().manual_seed(v)
    with torch.no_grad():
        for p in emb.encoder.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def _save_versions(model_dir: Path, emb, first: int, kill: Killer, fallback: bool) -> None:
    if fallback:  # in this child only
        fileio._renameat2 = None
    for v in range(first, first + 3):
        _set_version(emb, v)
        with kill.active():
            emb.save(model_dir)


@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "rename-aside"])
def test_sigkill_at_seeded_instants_of_model_saves(tmp_path, make_tiny, fallback):
    """Replacing a model directory: after any kill the directory loads, with the old or the new weights."""
    from moembed.model.embedder import Embedder

    emb, ref = make_tiny(), make_tiny()
    model_dir = tmp_path / "model"
    _set_version(emb, 0)
    emb.save(model_dir)
    # a whole save is ~6,000-10,000 events; the swap ~220-440; the renames of the fallback ~30 after the first
    windows = [(None, 12_000), ("_replace_dir", 440), ("_exchange", 40) if not fallback else (os.replace, 30)]
    rng, version, kills = random.Random(19 + fallback), 0, 0
    for _ in range(15):
        anchor, hi = rng.choice(windows)
        code = run_forked(_save_versions, model_dir, emb, version + 1, Killer(rng.randint(1, hi), anchor), fallback)
        assert code in (0, -signal.SIGKILL)
        kills += code == -signal.SIGKILL
        loaded = Embedder.load(model_dir)  # never missing, never half-written
        now = int(loaded.name[1:])
        assert version <= now <= version + 3
        _set_version(ref, now)
        for k, v in loaded.encoder.state_dict().items():
            assert torch.equal(v, ref.encoder.state_dict()[k]), (now, k)
        version = now
    assert kills >= 12 and version > 0


# ---- full disk ----------------------------------------------------------------------------------------------------


def _ckpt(tmp_path, steps=2):
    model, opt, sched = _tiny()
    mgr = CheckpointManager(tmp_path / "ck", keep_last=3)
    for s in range(1, steps + 1):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()
        mgr.save(s, model, opt, sched, {"position": s})
    return mgr, model, opt, sched


def test_full_disk_during_a_checkpoint_save_raises_and_loses_nothing(tmp_path, monkeypatch):
    mgr, model, opt, sched = _ckpt(tmp_path)
    before = {p.name: _bytes(p) for p in mgr.all()}
    real = torch.save

    def full(obj, f, *a, **k):  # writes part of the file, then the disk is full
        Path(f).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(MoembedError, match=r"step-00000003: cannot write \(No space left on device\); the previous"):
        mgr.save(3, model, opt, sched, {"position": 3})
    monkeypatch.setattr(torch, "save", real)
    assert {p.name: _bytes(p) for p in mgr.all()} == before
    assert sorted(p.name for p in mgr.dir.iterdir()) == ["step-00000001", "step-00000002"]  # no temporary left
    model2, opt2, sched2 = _tiny()
    assert mgr.load(mgr.latest(), model2, opt2, sched2).step == 2


def test_full_disk_during_a_model_save_raises_and_loses_nothing(tmp_path, make_tiny, monkeypatch):
    from moembed.model.embedder import Embedder

    emb = make_tiny(seed=1)
    emb.save(tmp_path / "model")
    before = _bytes(tmp_path / "model")
    other = make_tiny(seed=2)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the data cannot be made durable: nothing may be replaced
    with pytest.raises(MoembedError, match=r"model: cannot write \(No space left on device\)"):
        other.save(tmp_path / "model")
    with pytest.raises(MoembedError, match=r"out\.jsonl: cannot write \(No space left on device\)"):
        fileio.write_jsonl(tmp_path / "out.jsonl", [{"a": 1}])
    monkeypatch.undo()
    assert _bytes(tmp_path / "model") == before and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert torch.equal(Embedder.load(tmp_path / "model").encoder.layers[0].qkv.weight, emb.encoder.layers[0].qkv.weight)


def _bytes(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _save_with_file_size_limit(tmp_path: Path, emb, out: Path) -> None:
    """In a child: the kernel refuses writes past 64 KiB (EFBIG), so torch.save and safetensors fail mid-file."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    errors = []
    mgr, model, opt, sched = _ckpt(tmp_path)  # small checkpoints: under the limit
    big = nn.Linear(100, 100)  # weights 40 KB: model.safetensors fits; AdamW's two moments (80 KB) do not
    opt_big, sched_big = build_optimizer(big, OptimConfig(), 10)
    big(torch.randn(2, 100)).sum().backward()
    opt_big.step()
    for what, save in (("checkpoint", lambda: mgr.save(3, big, opt_big, sched_big, {})),
                       ("model", lambda: emb.save(tmp_path / "model"))):
        try:
            save()
            errors.append([what, None])
        except MoembedError as e:
            errors.append([what, str(e)])
        except Exception as e:  # noqa: BLE001  (what the test must not see)
            errors.append([what, f"not a MoembedError: {type(e).__name__}: {e}"])
    out.write_text(json.dumps(errors))


def test_real_writer_failures_become_clear_errors(tmp_path, make_tiny):
    """torch.save and safetensors failing in the middle of a file (a file-size limit) give MoembedError naming the
    target, the earlier checkpoints intact and no temporary files."""
    emb = make_tiny()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep.txt").write_text("an earlier model")
    assert run_forked(_save_with_file_size_limit, tmp_path, emb, tmp_path / "errors.json") == 0
    errors = dict(json.loads((tmp_path / "errors.json").read_text()))
    assert re.match(r".*step-00000003: cannot write \(.*\); the previous content is unchanged$", errors["checkpoint"])
    assert re.match(r".*model: cannot write \(.*\); the previous content is unchanged$", errors["model"])
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000001", "step-00000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "errors.json", "model"]
    assert _tree(tmp_path / "model") == {"keep.txt": "an earlier model"}
    model, opt, sched = _tiny()
    assert CheckpointManager(tmp_path / "ck").load(tmp_path / "ck" / "step-00000002", model, opt, sched).step == 2


@pytest.mark.parametrize(
    "line, got",
    [('{"id": 1, "text": "a"}', "an object (keys: id, text)"), ("42", "int"), ('["a"]', "list")],
)
def test_read_texts_names_the_line_what_it_found_and_the_two_formats_it_reads(tmp_path, line, got):
    path = tmp_path / "texts.jsonl"
    path.write_text(f'"fine"\n{line}\n', encoding="utf-8")
    with pytest.raises(MoembedError) as e:
        fileio.read_texts(path)
    assert str(e.value) == (f"{path}:2: expected a JSON string, got {got}; this command reads one JSON string per "
                            "line, or plain text lines with --plain")
    assert fileio.read_texts(path, plain=True) == ['"fine"', line]  # the same file as plain lines


# ---- hostile and careless input, missing output directories ------------------------------------------------------


def test_a_lone_surrogate_is_a_bad_line_of_any_jsonl_reader(tmp_path):
    path = tmp_path / "t.jsonl"
    # valid JSON, not valid Unicode: a lone high surrogate, a lone low one in a key; a proper pair is fine
    path.write_text('"ok"\n"a\\ud800"\n{"k\\udc00": 1}\n"\\ud83d\\ude00"\n', encoding="utf-8")
    with pytest.raises(MoembedError, match=r"t\.jsonl:2: not valid Unicode \(lone surrogate U\+D800 at character 1\)"):
        list(fileio.iter_jsonl(path))
    bad: list[int] = []
    assert list(fileio.iter_jsonl(path, skip_bad=True, bad=bad)) == [(1, "ok"), (4, "\U0001f600")]
    assert bad == [2, 3]
    with pytest.raises(MoembedError, match=r"t\.jsonl:2: not valid Unicode"):
        fileio.read_texts(path)


def test_a_directory_or_a_missing_file_as_input_is_named_as_such(tmp_path):
    (tmp_path / "d").mkdir()
    for read in (lambda p: list(fileio.iter_jsonl(p)), fileio.read_text_lines, fileio.read_yaml):
        with pytest.raises(MoembedError, match=r"/d: cannot read \(is a directory, not a file\)$"):
            read(tmp_path / "d")
        with pytest.raises(MoembedError, match=r"/nope: cannot read \(no such file\)$"):
            read(tmp_path / "nope")


@pytest.mark.parametrize("writer", ["path", "dir"])
def test_an_output_in_a_missing_directory_is_created_and_said(tmp_path, caplog, writer):
    target = tmp_path / "new" / "deeper" / "out"
    with caplog.at_level("INFO", logger="moembed"):
        with (atomic_path(target) if writer == "path" else atomic_dir(target)) as tmp:
            (tmp / "x").write_text("x") if writer == "dir" else tmp.write_text("x")
    assert target.exists()
    assert f"created directory {tmp_path / 'new'} (for {target})" in caplog.messages
    caplog.clear()
    with caplog.at_level("INFO", logger="moembed"), atomic_path(tmp_path / "new" / "again") as tmp:
        tmp.write_text("y")
    assert not [m for m in caplog.messages if "created directory" in m]  # said only when created
    (tmp_path / "file").write_text("")
    with pytest.raises(MoembedError, match=r"file/sub/out: cannot write \(.*/file is a file, not a directory\)"):
        with atomic_path(tmp_path / "file" / "sub" / "out") as tmp:
            tmp.write_text("z")
