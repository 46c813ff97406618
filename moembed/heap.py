"""The memory allocator and process settings of a process that moembed owns (`moembed train`, `quickstart`, ...).

A program that imports the library keeps its own settings: these are set by the commands, which own their process,
and by a program of the user's that asks for them.

Training's heap. glibc's malloc raises its mmap threshold to the size of every large block freed; after the first
training step the activation buffers of later steps (a new size at every sequence length) come from the heap,
where freed ones fragment and stay resident, so memory grows with the run's history. With the threshold fixed
they are mmapped and returned on free, and memory follows what the current step needs. The price is a page fault
per fresh page, which inference does not pay for (it keeps glibc's default), and training commands avoid by running
on mimalloc (Leijen et al. 2019), which keeps freed pages for reuse and returns them after a delay. The delay is
longer than a step (`PURGE_DELAY_MS`): the weight gradients freed by `zero_grad(set_to_none=True)` at a step's start
are made again at its end, and would otherwise be faulted in again every step. A process's allocator is chosen
when it starts, so the `moembed` command starts itself again with mimalloc preloaded, as PyTorch's CPU launcher
does for jemalloc; MOEMBED_ALLOCATOR=system or a user's own LD_PRELOAD keeps it as it is.

    bounded_heap()        a block that runs with the threshold fixed, then restores glibc's ceiling and trims:
                          what the training commands wrap `moembed.train.loop.train` in
    bound_heap_growth()   fix the threshold (no-op off glibc, on mimalloc, or when MALLOC_MMAP_THRESHOLD_ is set)
    release_free_heap()   return the heap's free pages to the system (malloc_trim, or mimalloc's collection):
                          between a recipe's stages, so one stage's leftovers are not under the next one's peak
    mimalloc_library()    the installed library's path (package cmeel-mimalloc), or None
    allocator()           the allocator this process runs on: "mimalloc" or "system"
    preload_environment() the environment to start a training command again with, or None to run it as it is
    start_on_mimalloc()   start this process again that way (returns only where it runs as it is)

Process settings, read once when torch, oneDNN or OpenMP load, so set before torch is imported:
oneDNN keeps one primitive (a kernel with its buffers) per matmul shape it has seen; an MoE layer's experts see a
new row count almost every batch, so the cache is capped — at `PRIMITIVE_CACHE` for inference, large enough for the
experts' recurring padded shapes beside the dense layers' one-off ones, and at `TRAINING_PRIMITIVE_CACHE` in
training, whose bf16 steps run every expert's matmuls in six shapes per row count. PyTorch's THP_MEM_ALLOC_ENABLE=1
backs large buffers with huge pages (512 times fewer faults). Training sets OMP_WAIT_POLICY=PASSIVE: OpenMP's idle
workers sleep between a step's matmuls instead of spinning while the main thread runs autograd and the optimizer.

    process_settings()    those settings for an inference or a training process
    configure_process()   set those the user has not, as the `moembed` command does on start

Measurements of each choice, with their commands: BENCHMARKS.md, "Training's process settings".
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
THRESHOLD = 1 << 20  # bytes: tensors of a few thousand floats and more are mmapped and returned on free
CEILING = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its own rule stops raising the threshold
PRIMITIVE_CACHE = 256  # oneDNN primitives kept at inference: the experts' recurring shapes, and one-off dense ones
TRAINING_PRIMITIVE_CACHE = 512  # training: the padded expert shapes of bf16 steps (above)
ALLOCATOR = "MOEMBED_ALLOCATOR"  # "system": training commands keep the C library's malloc
PURGE_DELAY = "MIMALLOC_PURGE_DELAY"  # mimalloc's option, read when the library loads
PURGE_DELAY_MS = 10_000  # mimalloc keeps freed pages this long before returning them: longer than a step (above)


def _glibc():
    """The C library when it is glibc, else None (musl and macOS have no dynamic threshold to fix)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 — only glibc defines it
    except (OSError, AttributeError):
        return None
    return libc


def mimalloc_library() -> str | None:
    """Path of the mimalloc shared library the cmeel-mimalloc package installs (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        dist = importlib.metadata.distribution("cmeel-mimalloc")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = sorted(str(dist.locate_file(f)) for f in dist.files or () if f.name.startswith("libmimalloc.so"))
    return next((p for p in found if os.path.exists(p)), None)


class _DlInfo(ctypes.Structure):  # <dlfcn.h> Dl_info
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def allocator() -> str:
    """The allocator this process runs on: "mimalloc" when the process's `malloc` is mimalloc's (preloaded), else
    "system". Asks the dynamic linker which library `malloc` resolves to: a mimalloc that is merely loaded by
    some library does not count."""
    try:
        process = ctypes.CDLL(None)
        info = _DlInfo()
        if not process.dladdr(ctypes.cast(process.malloc, ctypes.c_void_p), ctypes.byref(info)):
            return "system"
    except (OSError, AttributeError):  # no dladdr in this C library
        return "system"
    return "mimalloc" if b"mimalloc" in (info.dli_fname or b"") else "system"


def preload_environment(training: bool, environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment to start a `training` command again with, on mimalloc; None where the process runs as it
    is: not a training command, no mimalloc installed (or not Linux), MOEMBED_ALLOCATOR=system, or LD_PRELOAD
    already set — by the user, or by the start that led here (so a failed preload never loops)."""
    env = dict(os.environ if environ is None else environ)
    if not training or env.get(ALLOCATOR, "").lower() == "system" or env.get("LD_PRELOAD"):
        return None
    library = mimalloc_library()
    if library is None:
        return None
    return {PURGE_DELAY: str(PURGE_DELAY_MS), **env, "LD_PRELOAD": library, ALLOCATOR: "mimalloc"}


def start_on_mimalloc(argv: list[str], training: bool = True) -> None:
    """Replace this process with `python *argv` on mimalloc, where `preload_environment` gives an environment;
    otherwise return. Call it first thing, before anything worth keeping is done."""
    env = preload_environment(training)
    if env is not None:
        os.execve(sys.executable, [sys.executable, *argv], env)


def bound_heap_growth(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for this process (which also stops glibc from raising it).
    Returns whether it was set; the user's own MALLOC_MMAP_THRESHOLD_ is left alone, and on mimalloc glibc's
    malloc is not the one in use."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or allocator() == "mimalloc":
        return False
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, threshold))


def release_free_heap() -> bool:
    """Return the free pages of every malloc arena to the system; whether any were. What one stage freed (a
    teacher's embeddings, a model) otherwise stays resident under the next stage's peak. On mimalloc: its
    collection, which returns what it holds free at once instead of after its delay."""
    if allocator() == "mimalloc":
        ctypes.CDLL(None).mi_collect(ctypes.c_bool(True))
        return True
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


@contextmanager
def bounded_heap(threshold: int = THRESHOLD) -> Iterator[bool]:
    """Run the block with the mmap threshold fixed at `threshold` (yields whether it was); on leaving, set the
    threshold to glibc's ceiling (and the trim threshold to twice it, as glibc's rule does), so later work reuses
    freed blocks as under the defaults, and return the freed heap to the system."""
    fixed = bound_heap_growth(threshold)
    try:
        yield fixed
    finally:
        if fixed:
            libc = _glibc()
            libc.mallopt(M_MMAP_THRESHOLD, CEILING)
            libc.mallopt(M_TRIM_THRESHOLD, 2 * CEILING)
        release_free_heap()


def process_settings(training: bool = False) -> dict[str, str]:
    """The environment a process that moembed owns runs with: oneDNN's primitive cache capped, (on Linux, where
    the kernel has transparent huge pages) PyTorch's large buffers on huge pages, and for `training` OpenMP's
    idle workers asleep rather than spinning."""
    settings = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(TRAINING_PRIMITIVE_CACHE if training else PRIMITIVE_CACHE)}
    if sys.platform.startswith("linux"):
        settings["THP_MEM_ALLOC_ENABLE"] = "1"
    if training:
        settings["OMP_WAIT_POLICY"] = "PASSIVE"
    return settings


def configure_process(training: bool = False) -> dict[str, str]:
    """Set `process_settings(training)` in this process's environment (and its children's), keeping any the user
    set; returns the ones it set. Effective only before torch loads: PyTorch reads THP_MEM_ALLOC_ENABLE at its first
    allocation, oneDNN its cache capacity at its first primitive and OpenMP its wait policy when it loads."""
    made = {k: v for k, v in process_settings(training).items() if k not in os.environ}
    os.environ.update(made)
    return made
