"""Keep a long CPU run's resident memory at what its largest step needs, not what its history of steps left behind.

glibc's malloc serves blocks above its mmap threshold with mmap and returns them to the system on free, but it
raises that threshold to the size of every such block freed (up to 32 MiB). After the first training step, the
activation buffers of later steps — of a different size at every sequence length — come from the heap instead,
where freed ones fragment and stay resident. Measured on the quickstart's dense all-MiniLM-L6-v2 finetuning
(variable-length batches, 2 threads, AMD EPYC): resident memory between steps grew from 1.25 to 2.48 GiB over
40 steps and reached 4.6 GiB by step 200; with the threshold fixed at 1 MiB it stays at 1.1 GiB between steps
(BENCHMARKS.md, "Quickstart: where the time and memory go"). The price is page faults: every buffer above the
threshold is fresh memory. `moembed encode` (2,000 texts, dense MiniLM upcycle) spent 17.9 s instead of 3.6 s in
the kernel and took 1.38× the wall time for 80 MiB less memory, so only training fixes it (`moembed.train.train`),
and only while it trains: the evaluation after it in the same process paid 24% more CPU time under the fixed
threshold (BENCHMARKS.md), so leaving the block sets glibc's ceiling, the state its own rule reaches after the
first large free.

oneDNN (the packed float32 linear layers and experts of CPU inference, where packing is on) keeps one primitive
per matmul shape it has seen, up to 1,024 by default, each with its own buffers. An MoE layer's experts see a new
token count almost every batch, so a process encoding with an MoE model grew from 1.1 to 2.0 GiB over 12 passes of
the same texts; with the cache capped it stays near 1 GiB (BENCHMARKS.md, "MoE dispatch against its FLOP floor").
Inference keeps 256: at 64, the dense layers' one-off shapes (a new token count each batch) pushed out the
experts' recurring ones, and `moembed encode` of the upcycled MiniLM made 1,240 kernels in 0.71 s where 256 makes
450 in 0.25 s (1,024: 414) — 0.965x the command's wall time, 26 MiB more peak; over five passes of varied batches
in one process, 1,223 MiB against 1,180 at 64 and 1,392 at 1,024 (BENCHMARKS.md, "A primitive cache that holds
the experts' shapes"). Training commands keep 512 instead: in bf16 on a CPU a step runs every expert's matmuls in
six shapes (fc1 and fc2; forward, input and weight gradients) per row count, its rows padded so that the counts recur
(`moembed.model.experts.ROW_MULTIPLE`), some hundreds of shapes in all; at 64 each was made again every step, about
0.4 ms apiece. The quickstart's MoE finetuning took 0.89x the CPU time for 5% more peak memory at 512 (0.95x, +9% at
1,024; 0.98x at 256). oneDNN reads the cap once, when it makes its first primitive, so the `moembed` command sets it
on start; a program using the library sets ONEDNN_PRIMITIVE_CACHE_CAPACITY itself before its first model runs.

The fixed threshold's price is page faults on fresh memory, 4 KiB at a time. PyTorch's THP_MEM_ALLOC_ENABLE=1
aligns its buffers of 2 MiB and more to huge pages and asks the kernel for them (madvise), 512 times fewer faults:
an MoE training step took 4.01 instead of 4.49 CPU s (1 thread, AVX2 EPYC), and encoding was no slower, with less
memory. PyTorch reads it at its first allocation, so the command sets it before importing torch.

    bounded_heap()        a block that runs with the threshold fixed, then restores the ceiling and trims
    bound_heap_growth()   fix the threshold (no-op off glibc, or when MALLOC_MMAP_THRESHOLD_ is set by the user)
    release_free_heap()   return the heap's free pages to the system (malloc_trim): between a recipe's stages

A training process also sets OMP_WAIT_POLICY=PASSIVE: OpenMP's worker threads then sleep at the end of a parallel
region instead of spinning for it. Between a training step's matmuls the main thread runs autograd, the optimizer
and the loss alone, and spinning workers burned that time as CPU: the quickstart's finetuning (20 steps, 2 threads,
AVX2 EPYC, 9 pairs of fresh runs, dense and MoE; benchmarks/training_settings.py) took 0.87x the CPU time with it
(median; never more), at 0.98x the wall time (0.88-1.14x). Encoding, whose regions are long matmuls back to back,
showed no gain, so inference commands keep OpenMP's default. OpenMP reads the policy when torch loads it, so the
command sets it before importing torch.

    process_settings()    ONEDNN_PRIMITIVE_CACHE_CAPACITY = PRIMITIVE_CACHE, THP_MEM_ALLOC_ENABLE = 1 (Linux);
                          training: OMP_WAIT_POLICY = PASSIVE, the cache at TRAINING_PRIMITIVE_CACHE
    configure_process()   set those the user has not, as the `moembed` command does on start

Training commands run on mimalloc (Leijen et al. 2019), not glibc's malloc. With the threshold fixed, every
activation buffer of every step is fresh memory from the kernel, faulted in and zeroed, then unmapped on free: the
quickstart spent 12% of its CPU time in the kernel (38 million page faults). mimalloc keeps freed pages for reuse
and returns them to the system after a short delay, so a step reuses the last one's memory and the resident size
still follows what the step needs. The `moembed` command starts itself again with the library that the
cmeel-mimalloc package installs preloaded (a process's allocator is chosen when it starts), as PyTorch's own CPU
launcher does for jemalloc; MOEMBED_ALLOCATOR=system or a user's own LD_PRELOAD keeps it as it is. The quickstart's
finetuning (2 threads, AVX2 EPYC, 6 pairs of fresh runs) took 0.97x the CPU time at the same peak, with half the
page faults (BENCHMARKS.md, "Training on mimalloc").

mimalloc's own delay before it returns freed pages is 10 ms, shorter than a training step: buffers freed in one step
and wanted again in the next — above all the weight gradients, which `zero_grad(set_to_none=True)` frees at the
start of every step and backward makes again at its end, 4x the FLOP-matched dense model's in an MoE — were returned
and faulted in again (zeroed by the kernel, huge pages included) every step. The MoE experts' matmuls of a training
step (`benchmarks/expert_gemm.py`'s, gradients freed between steps, 1 thread, AMD EPYC Zen 4) took 0.46 s of system
time against the wide MLP's 0.03 s, the whole of their excess over it; with the delay at `PURGE_DELAY_MS` (10 s)
none (BENCHMARKS.md, "Freed pages kept for the next step"). Memory a stage leaves behind is still returned at once
by `release_free_heap`, and a user's own MIMALLOC_PURGE_DELAY is kept.

    mimalloc_library()    the installed library's path, or None
    allocator()           the allocator this process runs on: "mimalloc" or "system"
    preload_environment() the environment to start a training command again with, or None to run it as it is
    start_on_mimalloc()   start this process again that way (returns only where it runs as it is)
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
