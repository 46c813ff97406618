"""The int8 path's per-row element-wise work as two compiled loops (`rowquant.c`, built by `moembed.model.native`).

    lib = load()                                       # None where no C compiler builds it
    codes, m, xo = quantize_rows(lib, x, keep, outliers, inv_step, zero)
    rescale_rows(lib, y, m, bias, gelu)

Around oneDNN's quantised matmul, `moembed.model.linear.int8_linear` quantises every row on its own range (so an
embedding never depends on its batch) and rescales the product: in torch ops that is `abs`, `amax`, `div` and the
quantiser before the matmul and `addcmul` and GELU after it, each a pass over the whole batch. Here each is one
loop over a row while it is in cache (BENCHMARKS.md), and the codes are those of torch's quantiser to the bit.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from moembed.model import native


@functools.cache
def load() -> ctypes.CDLL | None:
    """`rowquant.c` compiled (`native.load`), its functions typed; None where it cannot be built
    (`why_not()` says why)."""
    lib = native.load("rowquant")
    if lib is not None:
        p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.quantize_rows.argtypes = [p, i, i, p, f, f, p, p, p, i, p]
        lib.quantize_rows.restype = None
        lib.rescale_rows.argtypes = [p, i, i, p, p, ctypes.c_int]
        lib.rescale_rows.restype = None
    return lib


def why_not() -> str | None:
    return native.why_not("rowquant")


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
