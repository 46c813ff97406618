"""moembed.heap: with the mmap threshold fixed, a large block freed does not send the next one of its size to the heap."""

import json
import subprocess
import sys

import pytest

from moembed.heap import _glibc

# Allocate and free a 4 MiB block, then allocate another: report whether the second was mmapped (mallinfo2's
# count of mmapped blocks goes up while it is held). glibc's default raises its threshold to 4 MiB on the first
# free, so the second comes from the heap; with the threshold fixed it is mmapped again.
PROBE = r"""
import ctypes, json, sys
from moembed.heap import bound_heap_growth
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
fixed = bound_heap_growth() if sys.argv[1] == "fix" else False
size = 4 << 20
libc.free(libc.malloc(size))
before = libc.mallinfo2().hblks
p = libc.malloc(size)
mmapped = libc.mallinfo2().hblks > before
libc.free(p)
print(json.dumps({"fixed": fixed, "mmapped": mmapped}))
"""


def probe(mode: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env=env)
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
