"""The package's C loops behind one checked API: every tensor is checked before its pointer crosses into C.

    if kernels.available("rowquant"):
        codes, m, xo = kernels.quantize_rows(x, keep, outliers, inv_step, zero)
        kernels.rescale_rows(y, m, bias, gelu)
    out = kernels.combine_rows(parts, expert, row, gates, bias)     # "combine"
    out = kernels.attention(q, k, v, lengths)                       # "attention", padded (B, H, T, hd)
    out = kernels.packed_attention(qkv, starts, lengths, heads)     # "attention", packed rows

`rowquant.c`: the int8 path's per-row work around oneDNN's quantised matmul (the row's range, its codes on the
grid, the rescale with bias and GELU), one pass over a row while it is in cache instead of one torch op per step
over the batch, the codes those of torch's quantiser to the bit (`moembed.model.fast.int8.int8_linear`).
`combine.c`: an MoE block's gate-weighted sum of each token's k expert rows, read from the buffers the experts
wrote (`moembed.model.moe`). `attention.c`: encoder self-attention at CPU inference (`moembed.model.attention`).
`moembed.model.native` builds them. A C loop trusts its pointers, so each function here checks device, dtype,
contiguity, shapes and index ranges first; a wrong call raises `MoembedError` naming the argument, never reads or
writes past a buffer. Calling a kernel that was not built raises too (`available` says whether it was).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from moembed.errors import MoembedError
from moembed.model import native

HEAD_DIMS = (32, 64)  # what attention.c is specialised for
MAX_LENGTH = 1024  # its longest sequence (its score rows live on the stack)

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {  # name -> {function: (argtypes, restype)}
    "rowquant": {"quantize_rows": ([_P, _I, _I, _P, ctypes.c_float, ctypes.c_float, _P, _P, _P, _I, _P], None),
                 "rescale_rows": ([_P, _I, _I, _P, _P, ctypes.c_int], None)},
    "combine": {"combine_rows": ([_P, _P, _P, _P, _I, _I, _I, ctypes.c_int, _P, _P], None)},
    "attention": {"attention": ([_P, _P, _P, ctypes.c_int, _I, _I, _I, _I, _P, _P, _P, ctypes.c_float, _P],
                                ctypes.c_int)},
}


@functools.cache
def _lib(name: str) -> ctypes.CDLL | None:
    """The compiled `name` with its functions typed, or None where it cannot be built."""
    lib = native.load(name)
    if lib is not None:
        for fn, (args, res) in _SIGNATURES[name].items():
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = res
    return lib


def available(name: str) -> bool:
    """Whether `name` ("rowquant", "combine", "attention") is built here."""
    return _lib(name) is not None


def why_not(name: str) -> str | None:
    """Why `name` is not available (None when it is)."""
    return native.why_not(name)


def _built(name: str, fn: str) -> ctypes.CDLL:
    lib = _lib(name)
    if lib is None:
        raise MoembedError(f"{fn}: {name}.c is not built here ({why_not(name)})")
    return lib


def _check(fn: str, arg: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple | None = None,
           contiguous: bool = True) -> None:
    """Raise MoembedError unless `t` is a CPU tensor of one of `dtypes`, of `shape` (None entries: any size), and
    contiguous (or, with `contiguous` False, with unit stride in its last dimension)."""
    where = f"{fn}: {arg}"
    if not isinstance(t, torch.Tensor):
        raise MoembedError(f"{where}: expected a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise MoembedError(f"{where}: expected a CPU tensor, got one on {t.device}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise MoembedError(f"{where}: expected {names}, got {str(t.dtype).removeprefix('torch.')}")
    if shape is not None and (t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape))):
        want = "(" + ", ".join("·" if s is None else str(s) for s in shape) + ")"
        raise MoembedError(f"{where}: expected shape {want}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise MoembedError(f"{where}: expected a contiguous tensor, got strides {t.stride()}")
    if not contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise MoembedError(f"{where}: expected unit stride in the last dimension, got strides {t.stride()}")


def _in_range(fn: str, arg: str, idx: torch.Tensor, high: torch.Tensor | int) -> None:
    """Raise MoembedError unless every index is in [0, high) (high: a bound, or one per index)."""
    if idx.numel() and not bool(((idx >= 0) & (idx < high)).all()):
        raise MoembedError(f"{fn}: {arg}: an index outside its buffer")


# ---- rowquant.c ------------------------------------------------------------------------------------------------


def quantize_rows(x: torch.Tensor, keep: torch.Tensor, outliers: torch.Tensor, inv_step: float,
                  zero: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, k) float32 → (codes (N, k) uint8, m (N, 1) float32, xo (N, o) float32): each row's range m outside
    the channels where `keep` (k,) float32 is 0, the row's codes on the grid (x / m) · inv_step + zero, and the
    `outliers` (o,) int64 channels of x / m."""
    fn = "quantize_rows"
    lib = _built("rowquant", fn)
    _check(fn, "x", x, (torch.float32,), (None, None))
    N, k = x.shape
    _check(fn, "keep", keep, (torch.float32,), (k,))
    _check(fn, "outliers", outliers, (torch.int64,), (None,))
    _in_range(fn, "outliers", outliers, k)
    o = outliers.numel()
    codes, m, xo = torch.empty(N, k, dtype=torch.uint8), torch.empty(N, 1), torch.empty(N, o)
    lib.quantize_rows(x.data_ptr(), N, k, keep.data_ptr(), inv_step, zero, codes.data_ptr(), m.data_ptr(),
                      outliers.data_ptr(), o, xo.data_ptr())
    return codes, m, xo


def rescale_rows(y: torch.Tensor, m: torch.Tensor, bias: torch.Tensor, gelu: bool) -> torch.Tensor:
    """y (N, n) float32, contiguous, in place: y · m (N, 1) + bias (n,), then exact GELU if `gelu`. Returns y."""
    fn = "rescale_rows"
    lib = _built("rowquant", fn)
    _check(fn, "y", y, (torch.float32,), (None, None))
    N, n = y.shape
    _check(fn, "m", m, (torch.float32,), (N, 1))
    _check(fn, "bias", bias, (torch.float32,), (n,))
    lib.rescale_rows(y.data_ptr(), N, n, m.data_ptr(), bias.data_ptr(), int(gelu))
    return y


# ---- combine.c -------------------------------------------------------------------------------------------------


def combine_rows(parts: list[torch.Tensor | None], expert: torch.Tensor, row: torch.Tensor, gates: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """out[n] = Σ_j gates[n, j] · parts[expert[n, j]][row[n, j]] (+ bias), summed in float32 in the order j = 0..k-1.

    parts: one (rows_e, d) contiguous buffer per expert, all float32 or all bfloat16 (None for an expert without
    rows); expert, row: (N·k,) int64, the expert and the row of each assignment n·k + j; gates (N, k) float32;
    bias (d,) float32 or None. Returns (N, d) float32."""
    fn = "combine_rows"
    lib = _built("combine", fn)
    _check(fn, "gates", gates, (torch.float32,), (None, None))
    N, k = gates.shape
    _check(fn, "expert", expert, (torch.int64,), (N * k,))
    _check(fn, "row", row, (torch.int64,), (N * k,))
    present = [p for p in parts if p is not None]
    if not present:
        if N:
            raise MoembedError(f"{fn}: parts: every expert's buffer is missing")
        return torch.empty(0, 0)
    first = next(e for e, p in enumerate(parts) if p is not None)
    _check(fn, f"parts[{first}]", parts[first], (torch.float32, torch.bfloat16), (None, None))
    dtype, d = parts[first].dtype, parts[first].shape[1]
    for e, p in enumerate(parts):
        if p is not None:
            _check(fn, f"parts[{e}]", p, (dtype,), (None, d))
    if bias is not None:
        _check(fn, "bias", bias, (torch.float32,), (d,))
    rows = torch.tensor([0 if p is None else p.shape[0] for p in parts], dtype=torch.int64)  # (E,), 0: no buffer
    _in_range(fn, "expert", expert, len(parts))
    if N:
        _in_range(fn, "row", row, rows[expert])  # also refuses an expert without a buffer (0 rows)
    addresses = torch.tensor([0 if p is None else p.data_ptr() for p in parts], dtype=torch.int64)  # (E,)
    out = torch.empty(N, d)
    lib.combine_rows(addresses.data_ptr(), expert.data_ptr(), row.data_ptr(), gates.data_ptr(), N, k, d,
                     int(dtype == torch.bfloat16), None if bias is None else bias.data_ptr(), out.data_ptr())
    return out


# ---- attention.c -----------------------------------------------------------------------------------------------


def _attention_args(fn: str, dtype: torch.dtype, D: int, lengths: torch.Tensor, B: int, rows: int) -> None:
    if dtype not in (torch.float32, torch.bfloat16):
        raise MoembedError(f"{fn}: q: expected float32 or bfloat16, got {str(dtype).removeprefix('torch.')}")
    if D not in HEAD_DIMS:
        raise MoembedError(f"{fn}: heads of {D}: attention.c takes heads of {' or '.join(map(str, HEAD_DIMS))}")
    _check(fn, "lengths", lengths, (torch.int64,), (B,))
    _in_range(fn, "lengths", lengths, min(rows, MAX_LENGTH) + 1)


def _run(q, k, v, starts, lengths, out, rows: int, strides: tuple[int, ...]) -> None:
    """`attention.c` on checked arguments (its `Layout`: `strides` = q_b, q_h, q_t, k_b, k_h, k_t, v_b, v_h, v_t,
    o_b; `starts` None for the padded layout); `rows`: output rows per sequence (0 for packed rows)."""
    B, H, D = lengths.numel(), out.shape[-2], out.shape[-1]
    rc = _lib("attention").attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), int(q.dtype == torch.bfloat16), B, H,
                                     rows, D, None if starts is None else starts.data_ptr(), lengths.data_ptr(),
                                     (ctypes.c_int64 * 10)(*strides), D**-0.5, out.data_ptr())
    if rc != 0:  # unreachable after the checks; kept so that a mismatch cannot return garbage
        raise MoembedError(f"attention.c refused B={B} H={H} hd={D} lengths up to {int(lengths.max())}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Attention of q, k, v (B, H, T, hd) float32 or bf16 (each row of hd contiguous; views of one projection are
    fine) over each sequence's first `lengths` (B,) int64 keys, computed in float32; (B, H, T, hd) in q's dtype, a
    view of a (B, T, H, hd) buffer, zero at padded query rows (and for a sequence of length 0)."""
    fn = "attention"
    _built("attention", fn)
    _check(fn, "q", q, (q.dtype,), (None, None, None, None), contiguous=False)
    B, H, T, D = q.shape
    for name, t in (("k", k), ("v", v)):
        _check(fn, name, t, (q.dtype,), (B, H, T, D), contiguous=False)
    _attention_args(fn, q.dtype, D, lengths, B, T)
    out = torch.empty(B, T, H, D)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], T * H * D)
    _run(q, k, v, None, lengths, out, T, strides)
    return out.transpose(1, 2).to(q.dtype)


def packed_attention(qkv: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, heads: int) -> torch.Tensor:
    """Attention on packed rows: qkv (N, 3·H·hd) contiguous, the q, k, v projections of sequences laid one after
    another (sequence b in rows starts[b] .. starts[b] + lengths[b], both (B,) int64), with no padding; (N, H·hd)
    in qkv's dtype. No gather pads the rows for the kernel, none drops the padding after it, and the keys are
    transposed inside the kernel."""
    fn = "packed_attention"
    _built("attention", fn)
    _check(fn, "qkv", qkv, (qkv.dtype,), (None, None))
    N, width = qkv.shape
    if heads < 1 or width % (3 * heads):
        raise MoembedError(f"{fn}: qkv: width {width} is not 3 x {heads} heads")
    d = width // 3
    D = d // heads
    B = starts.numel()
    _check(fn, "starts", starts, (torch.int64,), (B,))
    _attention_args(fn, qkv.dtype, D, lengths, B, N)
    _in_range(fn, "starts", starts, N - lengths + 1)  # each sequence's rows inside qkv
    out = torch.empty(N, heads, D)
    _run(qkv, qkv[:, d:], qkv[:, 2 * d :], starts, lengths, out, 0, (0, D, 3 * d) * 3 + (0,))
    return out.view(N, d).to(qkv.dtype)
