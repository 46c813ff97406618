"""moembed.heap: with the mmap threshold fixed, a large block freed does not send the next one of its size to the heap;
leaving `bounded_heap` restores heap reuse; `release_free_heap` returns freed heap pages to the system."""

import os
import json
import subprocess
import sys

import pytest

from moembed.heap import PRIMITIVE_CACHE, TRAINING_PRIMITIVE_CACHE, _glibc

# Allocate and free a 4 MiB block, then allocate another: report whether the second was mmapped (mallinfo2's
# count of mmapped blocks goes up while it is held). glibc's default raises its threshold to 4 MiB on the first
# free, so the second comes from the heap; with the threshold fixed it is mmapped again.
PROBE = r"""
import ctypes, json, sys
from moembed.heap import bound_heap_growth, bounded_heap
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
size = 4 << 20
def second_mmapped():
    libc.free(libc.malloc(size))
    before = libc.mallinfo2().hblks
    p = libc.malloc(size)
    mmapped = libc.mallinfo2().hblks > before
    libc.free(p)
    return mmapped
if sys.argv[1] == "block":  # inside bounded_heap, then after it
    with bounded_heap() as fixed:
        inside = second_mmapped()
    print(json.dumps({"fixed": fixed, "mmapped": inside, "after": second_mmapped()}))
else:
    fixed = bound_heap_growth() if sys.argv[1] == "fix" else False
    print(json.dumps({"fixed": fixed, "mmapped": second_mmapped()}))
"""

# 64 MiB of small blocks (heap, below any threshold) freed except the last one, which pins the heap's top so that
# glibc's own trimming cannot return them: only malloc_trim does (on mimalloc: its collection, before its purge
# delay would); resident memory is read from /proc. Then whether the glibc threshold would be fixed.
TRIM = r"""
import ctypes, json, os
from moembed.heap import allocator, bound_heap_growth, release_free_heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * page / 2**20
blocks = [libc.malloc(64 << 10) for _ in range(1024)]
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
for b in blocks[:-1]:
    libc.free(b)
before = rss()
released = release_free_heap()
print(json.dumps({"allocator": allocator(), "released": released, "freed_mib": before - rss(),
                  "fixed": bound_heap_growth()}))
"""


def probe(mode: str, env: dict | None = None, code: str = PROBE) -> dict:
    out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout)


glibc_only = pytest.mark.skipif(_glibc() is None or not hasattr(_glibc(), "mallinfo2"), reason="needs glibc >= 2.33")


@glibc_only
def test_fixed_threshold_keeps_large_blocks_mmapped():
    assert probe("default") == {"fixed": False, "mmapped": False}  # glibc raised its threshold: heap reuse
    assert probe("fix") == {"fixed": True, "mmapped": True}


@glibc_only
def test_users_own_setting_is_left_alone():
    import os

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 << 20)}
    assert probe("fix", env) == {"fixed": False, "mmapped": False}


@glibc_only
def test_leaving_the_block_restores_heap_reuse():
    assert probe("block") == {"fixed": True, "mmapped": True, "after": False}


@glibc_only
def test_free_heap_pages_are_returned():
    out = probe("trim", code=TRIM)
    assert out["allocator"] == "system" and out["released"] and out["freed_mib"] > 48


# The `moembed` command caps oneDNN's primitive cache and turns on PyTorch's huge pages before torch loads (both
# are read once), and a training command puts OpenMP's idle workers to sleep; a user's own settings are kept.
CLI_ENV = r"""
import json, os, sys
from moembed.cli.main import main
loaded_early = "torch" in sys.modules
sys.argv = ["moembed", sys.argv[1], "--help"]
try:
    main()
except SystemExit:
    pass
print(json.dumps({"torch_before_main": loaded_early, "cap": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
                  "thp": os.environ.get("THP_MEM_ALLOC_ENABLE"), "wait": os.environ.get("OMP_WAIT_POLICY")}),
      file=sys.stderr)
"""
SET_BY_MOEMBED = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "THP_MEM_ALLOC_ENABLE", "OMP_WAIT_POLICY")


def cli_env(command: str, user: dict) -> dict:
    """The process settings the `moembed` command leaves in its environment when run as `moembed COMMAND --help`
    (command functions import torch only when they run), under the user's own `user` settings."""
    env = {k: v for k, v in os.environ.items() if k not in SET_BY_MOEMBED}
    out = subprocess.run([sys.executable, "-c", CLI_ENV, command], capture_output=True, text=True, check=True,
                         env={**env, **user})
    return json.loads(out.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("user", [{}, {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "512", "THP_MEM_ALLOC_ENABLE": "0"}])
def test_the_command_sets_the_allocator_before_torch_loads(user):
    got = cli_env("models", user)
    assert got["torch_before_main"] is False  # else neither setting could take effect
    assert got["cap"] == user.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE))
    assert got["thp"] == user.get("THP_MEM_ALLOC_ENABLE", "1")


@pytest.mark.parametrize("command, user, expected, cap", [
    ("train", {}, "PASSIVE", TRAINING_PRIMITIVE_CACHE),
    ("quickstart", {}, "PASSIVE", TRAINING_PRIMITIVE_CACHE),
    ("encode", {}, None, PRIMITIVE_CACHE),  # inference keeps OpenMP's default: no gain measured there
    ("serve", {}, None, PRIMITIVE_CACHE),
    ("train", {"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE", TRAINING_PRIMITIVE_CACHE),  # the user's own choice is kept
])
def test_training_commands_put_idle_openmp_workers_to_sleep_and_keep_more_primitives(command, user, expected, cap):
    got = cli_env(command, user)
    assert got["torch_before_main"] is False  # OpenMP reads the policy when torch loads it
    assert got["wait"] == expected
    assert got["cap"] == str(cap)  # training: the padded expert shapes of a step (moembed.model.experts)


def test_configure_process_sets_only_what_the_user_has_not(monkeypatch):
    from moembed.heap import configure_process, process_settings

    for key in process_settings():
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    made = configure_process()
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in made and os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"
    assert made == {k: v for k, v in process_settings().items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    assert all(os.environ[k] == v for k, v in made.items())
    assert configure_process() == {}  # a second call finds everything set


# Training commands run on mimalloc: `preload_environment` says when the command starts itself again with it.
def test_mimalloc_is_installed_where_it_is_preloaded():
    from moembed.heap import mimalloc_library

    lib = mimalloc_library()
    assert (lib is not None and os.path.exists(lib)) == sys.platform.startswith("linux")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mimalloc is preloaded on Linux only")
@pytest.mark.parametrize("training, user, preloaded", [
    (True, {}, True),
    (False, {}, False),  # inference keeps the system allocator
    (True, {"MOEMBED_ALLOCATOR": "system"}, False),
    (True, {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, False),  # the user's own preload is kept
    (True, {"MIMALLOC_PURGE_DELAY": "50"}, True),  # and the user's own delay
])
def test_preload_environment(training, user, preloaded):
    from moembed.heap import PURGE_DELAY_MS, mimalloc_library, preload_environment

    env = preload_environment(training, {"PATH": "/bin", **user})
    if not preloaded:
        assert env is None
        return
    delay = user.get("MIMALLOC_PURGE_DELAY", str(PURGE_DELAY_MS))
    assert env == {"PATH": "/bin", "LD_PRELOAD": mimalloc_library(), "MOEMBED_ALLOCATOR": "mimalloc",
                   "MIMALLOC_PURGE_DELAY": delay}
    assert preload_environment(training, env) is None  # the restarted process runs as it is


# A buffer freed in one training step and made again in the next (a weight gradient) must find its pages still
# there: faulted in once, not every step. The gap between the two stands in for a step's work.
REUSE = r"""
import json, resource, time
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
buf = b"\x01" * (64 << 20)  # every page touched
del buf
time.sleep(0.3)
for _ in range(200):  # other work: mimalloc returns what has waited past its delay as it allocates and frees
    small = b"\x01" * (1 << 20)
    del small
before = faults()
buf = b"\x01" * (64 << 20)
print(json.dumps({"faults": faults() - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mimalloc is preloaded on Linux only")
def test_training_allocator_keeps_freed_pages_for_the_next_step():
    from moembed.heap import preload_environment

    env = preload_environment(True, {k: v for k, v in os.environ.items()
                                     if k not in ("LD_PRELOAD", "MOEMBED_ALLOCATOR", "MIMALLOC_PURGE_DELAY")})
    kept = probe("", env, code=REUSE)["faults"]
    returned = probe("", {**env, "MIMALLOC_PURGE_DELAY": "10"}, code=REUSE)["faults"]  # mimalloc's own default
    assert returned >= 16  # 64 MiB faulted in again: 32 huge pages of 2 MiB (mimalloc asks for them), or 16,384
    assert kept < returned / 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mimalloc is preloaded on Linux only")
def test_heap_calls_on_mimalloc():
    # glibc's threshold is left alone there (glibc's malloc is not in use); freed pages go back by mimalloc's
    # collection.
    from moembed.heap import mimalloc_library

    out = probe("trim", {**os.environ, "LD_PRELOAD": mimalloc_library()}, code=TRIM)
    assert out["allocator"] == "mimalloc" and out["fixed"] is False and out["released"]
    assert out["freed_mib"] > 48


# glibc's allocator policy belongs to whoever owns the process: `moembed train` sets it around training, while a
# program calling the library's `train()` keeps its own (moembed.heap.bounded_heap is never entered for it).
def test_library_training_leaves_the_allocator_policy_alone_and_the_train_command_sets_it(tmp_path, minilm_path,
                                                                                           monkeypatch):
    from pathlib import Path

    from train_helpers import chatterbot_pairs, write_pairs
    from typer.testing import CliRunner

    from moembed import heap
    from moembed.cli.main import app
    from moembed.train.config import load_config
    from moembed.train.loop import train

    fixed = []
    monkeypatch.setattr(heap, "bound_heap_growth", lambda threshold=heap.THRESHOLD: fixed.append(threshold) or False)
    pairs = write_pairs(tmp_path / "pairs.jsonl", chatterbot_pairs()[:64])
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny" / "contrastive.yaml"
    args = [f"tokenizer={minilm_path}", f"data.0.path={pairs}", "steps=1", "checkpoint.every=1"]
    train(load_config(config, args + [f"output_dir={tmp_path / 'library'}"]), progress=False)
    assert fixed == [] and (tmp_path / "library" / "model").is_dir()
    r = CliRunner().invoke(app, ["train", str(config), *args, f"output_dir={tmp_path / 'command'}", "--quiet"])
    assert r.exit_code == 0, r.output
    assert fixed == [heap.THRESHOLD] and (tmp_path / "command" / "model").is_dir()
