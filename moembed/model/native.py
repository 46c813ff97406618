"""The package's C loops (`moembed/model/*.c`), compiled for this machine on first use and cached.

    lib = load("rowquant")        # ctypes.CDLL, or None where no C compiler builds it (reason: why_not("rowquant"))

A few inference loops are faster written once in C than as a chain of torch ops (`rowquant`: the int8 path's
per-row work; `attention`: encoder self-attention on short sequences; `combine`: an MoE block's weighted sum of
each token's expert outputs). Each source is compiled with the system C
compiler (`CC`, else `cc`) for this CPU (`-march=native`) and OpenMP, into the user's cache
(`MOEMBED_KERNEL_CACHE`, else `$XDG_CACHE_HOME/moembed/kernels` or `~/.cache/moembed/kernels`), named by a hash of
the source, the compiler's version, the flags and the CPU; the build writes a temporary file in that folder and
renames it, so that concurrent processes never load half a file, and a cached file that does not load is rebuilt.
Without a compiler, or when the build fails, `load` returns None and the callers run torch ops instead. The
libraries link libgomp by name: torch's own libgomp is then the one already loaded, so they share one OpenMP
runtime and its thread count (`torch.set_num_threads`).
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

from moembed.model.cpu import flags

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]

def source(name: str) -> Path:
    return Path(__file__).with_name(f"{name}.c")


def cache_dir() -> Path:
    """Where compiled libraries are kept: MOEMBED_KERNEL_CACHE, else $XDG_CACHE_HOME/moembed/kernels, else
    ~/.cache/moembed/kernels."""
    if os.environ.get("MOEMBED_KERNEL_CACHE"):
        return Path(os.environ["MOEMBED_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moembed" / "kernels"


def compiler() -> str | None:
    """The C compiler's path: CC, else cc, on PATH; None if there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


@functools.cache
def _version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout


def library_path(name: str, cc: str) -> Path:
    """The compiled `name` for compiler `cc` in `cache_dir`, named by a hash of what it depends on: the source and
    the headers beside it, the compiler (its --version), the flags and this CPU."""
    cpu = flags()
    headers = [h.read_text() for h in sorted(Path(__file__).parent.glob("*.h"))]  # what the sources include
    identity = "\n".join([source(name).read_text(), *headers, _version(cc), " ".join(FLAGS), platform.machine(),
                          repr(sorted(cpu.items()))])
    return cache_dir() / f"{name}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.so"


def build(name: str, target: Path, cc: str) -> None:
    """Compile `name`'s source into `target`, atomically: a temporary file in the same folder, renamed when
    complete. Raises RuntimeError with the compiler's message on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(source(name)), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {name}.c: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(name: str) -> ctypes.CDLL | None:
    """The compiled `name`, built on first use and cached; None (reason: `why_not(name)`) without a C compiler
    or when building or loading fails."""
    return built(name)[0]


def why_not(name: str) -> str | None:
    """Why `load(name)` returns None (None when it loads); builds it first if needed."""
    return built(name)[1]


@functools.cache
def built(name: str) -> tuple[ctypes.CDLL | None, str | None]:
    """(the compiled `name`, None) or (None, why not), once per process."""
    cc = compiler()
    if cc is None:
        return None, f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH"
    try:
        target = library_path(name, cc)
        if not target.exists():
            build(name, target, cc)
        try:
            return ctypes.CDLL(str(target)), None
        except OSError:  # a file cut short (a full disk, an interrupted copy): built again
            build(name, target, cc)
            return ctypes.CDLL(str(target)), None
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, str(e).splitlines()[0][:200]
