"""The int8 path's per-row element-wise work as two compiled loops (`rowquant.c`), built on first use.

    kernels = load()                                   # None where no C compiler builds them
    codes, m, xo = quantize_rows(kernels, x, keep, outliers, inv_step, zero)
    rescale_rows(kernels, y, m, bias, gelu)

Around oneDNN's quantised matmul, `moembed.model.linear.int8_linear` quantises every row on its own range (so an
embedding never depends on its batch) and rescales the product: in torch ops that is `abs`, `amax`, `div` and the
quantiser before the matmul and `addcmul` and GELU after it, each a pass over the whole batch. They were 0.37 s of
int8 encode's 1.94 s of operators over 500 texts (torch.profiler, Zen 4; BENCHMARKS.md, "The int8 path's
element-wise work in one pass"), more than attention's share that int8 does not touch. Here each is one loop over a
row while it is in cache, and the codes are those of torch's quantiser to the bit.

The C file is compiled once per machine with the system C compiler (`CC`, else `cc`) for this CPU
(`-march=native`) and OpenMP, into the user's cache (`MOEMBED_KERNEL_CACHE`, else `$XDG_CACHE_HOME/moembed` or
`~/.cache/moembed`), named by a hash of the source, the compiler's version and the CPU, written to a temporary name
and renamed so that concurrent processes never load half a file. Without a compiler, or when the build fails,
`load` returns None (and says why once, in `why_not`) and int8 runs the same steps in torch ops. The library links
against libgomp by name; torch's own libgomp is then the one already loaded, so both share one OpenMP runtime and
its thread count (`torch.set_num_threads`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("rowquant.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]

why_not: str | None = None  # why `load` returned None, for the log line that names the int8 path


def cache_dir() -> Path:
    """Where compiled kernels are kept: MOEMBED_KERNEL_CACHE, else $XDG_CACHE_HOME/moembed/kernels, else
    ~/.cache/moembed/kernels."""
    if os.environ.get("MOEMBED_KERNEL_CACHE"):
        return Path(os.environ["MOEMBED_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moembed" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _identity(cc: str) -> str:
    """What the compiled file depends on: the source, the compiler (its --version), the flags and this CPU."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    cpu = torch._C._cpu._get_cpu_capability() if hasattr(torch._C, "_cpu") else {}
    return "\n".join([SOURCE.read_text(), version, " ".join(FLAGS), platform.machine(), repr(sorted(cpu.items()))])


def library_path(cc: str) -> Path:
    """The compiled file for compiler `cc` in `cache_dir`, named by a hash of what it depends on (`_identity`)."""
    return cache_dir() / f"rowquant-{hashlib.sha256(_identity(cc).encode()).hexdigest()[:16]}.so"


def build(target: Path, cc: str) -> None:
    """Compile `SOURCE` into `target`, atomically: a temporary file in the same folder, renamed when complete.
    Raises RuntimeError with the compiler's message on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.quantize_rows.argtypes = [p, i, i, p, f, f, p, p, p, i, p]
    lib.quantize_rows.restype = None
    lib.rescale_rows.argtypes = [p, i, i, p, p, ctypes.c_int]
    lib.rescale_rows.restype = None
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use and cached; None (reason in `why_not`) without a C compiler or
    when building or loading fails. A cached file that does not load (truncated by a full disk, say) is rebuilt."""
    global why_not
    cc = _compiler()
    if cc is None:
        why_not = f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH"
        return None
    try:
        target = library_path(cc)
        if not target.exists():
            build(target, cc)
        try:
            return _bind(target)
        except OSError:
            build(target, cc)
            return _bind(target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        why_not = str(e).splitlines()[0][:200]
        return None


def quantize_rows(lib: ctypes.CDLL, x: torch.Tensor, keep: torch.Tensor, outliers: torch.Tensor, inv_step: float,
                  zero: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, k) float32 → (codes (N, k) uint8, m (N, 1) float32, xo (N, o) float32): each row's range m outside
    the channels where `keep` (k,) is 0, the row's codes on the grid (x / m) · inv_step + zero, and the `outliers`
    (o,) long channels of x / m."""
    x = x.contiguous()
    N, k = x.shape
    o = outliers.numel()
    codes = torch.empty(N, k, dtype=torch.uint8)
    m = torch.empty(N, 1)
    xo = torch.empty(N, o)
    lib.quantize_rows(x.data_ptr(), N, k, keep.data_ptr(), inv_step, zero, codes.data_ptr(), m.data_ptr(),
                      outliers.data_ptr(), o, xo.data_ptr())
    return codes, m, xo


def rescale_rows(lib: ctypes.CDLL, y: torch.Tensor, m: torch.Tensor, bias: torch.Tensor, gelu: bool) -> torch.Tensor:
    """y (N, n) float32, contiguous, in place: y · m (N, 1) + bias (n,), then exact GELU if `gelu`. Returns y."""
    N, n = y.shape
    lib.rescale_rows(y.data_ptr(), N, n, m.data_ptr(), bias.data_ptr(), int(gelu))
    return y
