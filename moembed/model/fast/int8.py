"""Dynamic int8 inference: `Int8Linear`, and the kernels int8 experts share (`fast/experts.py`).

Weights are quantised once per output channel to int8 (symmetric), and each call quantises every input row to 8
bits with that row's own range ("dynamic" quantisation, so no calibration data is needed), multiplies in integers
and rescales to float32. On CPUs with int8 dot products (AVX-512 VNNI, AVX-VNNI, AMX) the matmul is oneDNN's, on
the full 8-bit grid; elsewhere (AVX2) fbgemm's, on a 7-bit grid (`Settings.int8_kernel`). It runs at inference
only; training and autograd see the float32 weights, which are kept. `moembed.model.quantize.quantize_int8`
swaps every linear layer and every expert set of a model to int8.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from moembed.model import kernels
from moembed.model.activations import INPLACE_ACTIVATIONS
from moembed.model.fast import swapped
from moembed.model.fast.packed import WeightCache, cached, inference_pass
from moembed.model.linear import Linear
from moembed.model.settings import Settings

OUTLIERS = 8  # input channels per layer kept in float32 (the largest activations; see `pack_int8`)

# The activations' 8-bit grids over [-1, 1], (scale, zero point) of unsigned 8-bit codes. fbgemm's: 7-bit reduced
# range, as its dynamic kernel would choose for that range, which keeps AVX2's 16-bit pair sums (vpmaddubsw) from
# saturating. oneDNN's: the full symmetric range (codes 1..255), half the rounding error; its kernel runs only where
# VNNI's dot products sum u8 x s8 products straight into 32 bits (`Settings.int8_kernel`).
INT8_GRID = (2.0 / 127, 64)
ONEDNN_GRID = (1.0 / 127, 128)
_ONEDNN_INV_STEP = (1.0 / torch.tensor(ONEDNN_GRID[0], dtype=torch.float32)).item()  # as torch's quantiser has it
# The fbgemm kernel that takes the grid as given (no range pass); None where this torch lacks it.
_fixed_grid_linear = getattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32", None)
# oneDNN's quantised linear (u8 activations x s8 weights, float32 out); None where this torch lacks it.
_onednn_qlinear = getattr(torch.ops.onednn, "qlinear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def int8_kernel(flags: dict | None = None, settings: Settings | None = None) -> str:
    """The int8 matmul `quantize_int8` picks for a CPU with features `flags` (this one's by default) under
    `settings` (MOEMBED_NO_FASTPATH's by default): see `Settings.int8_kernel`."""
    return (settings or Settings.from_env()).int8_kernel(flags)


@dataclass(frozen=True)
class Int8Setup:
    """A layer switched to int8 by `quantize_int8`: its matmul kernel and the input ranges its outliers come from."""

    kernel: str  # "onednn" | "fbgemm"
    amax: object  # Linear: (k,) float32 largest |input| per channel, or None; Experts: (fc1's (d,), [fc2's (i,)])


@dataclass
class Int8Weight:
    """A linear layer's weight for `int8_linear`: int8 apart from a few outlier input channels."""

    kernel: str  # "onednn" | "fbgemm" (`int8_kernel`)
    packed: object  # the int8 weight (n, k) packed for `kernel`, one scale per output row, outlier columns zeroed
    scale: torch.Tensor | None  # (n,) float32, the rows' scales (oneDNN takes them per call; fbgemm packs them)
    zero: torch.Tensor | None  # (n,) int32 zeros, the rows' zero points (symmetric), as oneDNN takes them
    outliers: torch.Tensor  # (o,) long, input channels computed in float32
    w_outliers: torch.Tensor  # (o, n) float32, W[:, outliers]ᵀ
    bias: torch.Tensor  # (n,) float32, zeros where the layer has none (the rescale adds it either way)
    keep: torch.Tensor  # (k,) float32, 0 at the outlier channels and 1 elsewhere (`rowquant`'s range mask)


def pack_int8(weight: torch.Tensor, bias: torch.Tensor | None, amax: torch.Tensor | None,
              kernel: str | None = None) -> Int8Weight:
    """weight (n, k) → `Int8Weight` for `kernel` (`int8_kernel()` by default). `amax` (k,): the largest |input|
    seen per input channel (see `quantize_int8`).

    Transformer activations carry a few outlier channels, far larger than the rest on every token; an 8-bit grid
    sized for them leaves the others a handful of levels. The `OUTLIERS` channels with the largest `amax` are
    therefore multiplied in float32 (as LLM.int8()'s mixed-precision decomposition does) and the rest in int8.
    """
    kernel = kernel or int8_kernel()
    w = weight.detach().float().contiguous()
    out = torch.zeros(0, dtype=torch.long)
    if amax is not None:
        out = amax.topk(min(OUTLIERS, w.shape[1])).indices.sort().values
    w_outliers = w[:, out].t().contiguous()  # (o, n)
    w = w.index_fill(1, out, 0.0)
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # (n,) symmetric: max |w| of a row ↦ 127
    bias = torch.zeros(w.shape[0]) if bias is None else bias.detach().float().contiguous()
    keep = torch.ones(w.shape[1]).index_fill_(0, out, 0.0)
    with warnings.catch_warnings():  # the eager quantised-tensor API is deprecated; its kernels are not replaced yet
        warnings.simplefilter("ignore")
        if kernel == "onednn":
            qw = torch.round(w / scale[:, None]).to(torch.int8)  # (n, k)
            torch.quantize_per_tensor(w[:1], *ONEDNN_GRID, torch.quint8)  # its one-time deprecation notice, here
            packed = torch.ops.onednn.qlinear_prepack(qw, None)
            zero = torch.zeros_like(scale, dtype=torch.int32)
            return Int8Weight(kernel, packed, scale, zero, out, w_outliers, bias, keep)
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qw, None)
    return Int8Weight(kernel, packed, None, None, out, w_outliers, bias, keep)


def fused_rows(settings: Settings) -> bool:
    """Whether the int8 path's per-row work runs compiled (`kernels.quantize_rows`, `kernels.rescale_rows`): where
    `rowquant.c` is built and the compiled loops are on (`Settings.compiled_loops`)."""
    return settings.compiled_loops() and kernels.available("rowquant")


def int8_path(settings: Settings | None = None) -> str:
    """What int8 layers run here under `settings` (MOEMBED_NO_FASTPATH's by default), for logs: the matmul kernel
    and its grid, and where the per-row work runs."""
    settings = settings or Settings.from_env()
    kernel = settings.int8_kernel()
    grid = "full 8-bit grid" if kernel == "onednn" else "7-bit grid"
    if fused_rows(settings):
        return f"{kernel} ({grid}), per-row quantisation compiled"
    why = kernels.why_not("rowquant") if settings.compiled_loops() else "fast paths off"
    return f"{kernel} ({grid}), per-row quantisation in torch ops ({why})"


def int8_linear(x: torch.Tensor, w: Int8Weight, gelu: bool = False, fused: bool = False) -> torch.Tensor:
    """F.linear with int8 weights, then exact GELU if `gelu`: x (N, k) float32 → (N, n) float32, a buffer of its
    own. `fused`: the per-row work in the compiled loops (`fused_rows`), else in torch ops.

    Each row is quantised with its own range (its largest |value| outside the outlier channels), so a text's
    embedding never depends on the other texts of its batch: the rows are divided by that maximum and quantised on
    one fixed grid over [-1, 1] (`ONEDNN_GRID`, `INT8_GRID`), which the kernel takes as given instead of measuring
    each call's range. The outlier channels of the scaled rows may lie beyond 1: the quantiser clamps them, and
    their int8 weights are 0 (`pack_int8`); their float32 product is added before the rescale. With `fused`,
    the range, the codes and the rescale (with bias and GELU) are one pass each (`kernels`); otherwise torch ops do
    the same steps.
    """
    if fused and w.kernel == "onednn":
        step, zero = ONEDNN_GRID
        codes, m, xo = kernels.quantize_rows(x.contiguous(), w.keep, w.outliers, _ONEDNN_INV_STEP, zero)  # xo: x_o/m
        y = _onednn_qlinear(codes, step, zero, w.packed, w.scale, w.zero, None, 1.0, 0, torch.float32,
                            "none", [], "")  # (N, n)
        if w.outliers.numel():
            y.addmm_(xo, w.w_outliers)  # (N, o) @ (o, n), on the row's scale like the int8 product
        return kernels.rescale_rows(y, m, w.bias, gelu)
    xs = x.abs()  # (N, k), then the scaled rows
    if w.outliers.numel():
        xs.index_fill_(1, w.outliers, 0.0)
    m = xs.amax(dim=1, keepdim=True).clamp_min_(1e-12)  # (N, 1) (faster than an inf-norm here)
    torch.div(x, m, out=xs)
    xo = xs.index_select(1, w.outliers) if w.outliers.numel() else None  # (N, o), before any clamp
    if w.kernel == "onednn":
        step, zero = ONEDNN_GRID
        y = _onednn_qlinear(_onednn_codes(xs), step, zero, w.packed, w.scale, w.zero, None, 1.0, 0, torch.float32,
                            "none", [], "")  # (N, n)
    elif _fixed_grid_linear is not None:
        y = _fixed_grid_linear(xs, *INT8_GRID, w.packed)  # (N, n)
    else:  # older kernels measure the range: a fixed row (1, -1, 0, ...) makes it [-1, 1] on every call
        fixed = xs.new_zeros(1, xs.shape[1])
        fixed[0, :2] = torch.tensor([1.0, -1.0])
        y = torch.ops.quantized.linear_dynamic(torch.cat([xs.clamp_(-1.0, 1.0), fixed]), w.packed, True)[:-1]
    if xo is not None:
        y.addmm_(xo, w.w_outliers)
    if fused:  # fbgemm's product with the compiled rescale
        return kernels.rescale_rows(y, m, w.bias, gelu)
    # in place: no second (N, n) buffer (a fresh one is page faults each call wherever malloc has trimmed its heap)
    y = torch.addcmul(w.bias, y, m, out=y)
    return INPLACE_ACTIVATIONS["gelu"](y) if gelu else y


def _onednn_codes(xs: torch.Tensor, step: float = ONEDNN_GRID[0]) -> torch.Tensor:
    """Scaled rows xs (N, k) → their codes on `ONEDNN_GRID` (or another `step`, zero point 128), (N, k) uint8, in
    one pass: torch's quantiser (the one fused round-and-clamp it has), its storage then read as the plain uint8
    tensor oneDNN's kernel takes, without the copy `int_repr` would make."""
    q = torch.quantize_per_tensor(xs, step, ONEDNN_GRID[1], torch.quint8)
    return torch.empty(0, dtype=torch.uint8).set_(q.untyped_storage(), q.storage_offset(), q.shape, q.stride())


def int8_weights(module: nn.Module, pairs, amax) -> list[Int8Weight]:
    """`pack_int8` of `pairs` [(weight (n, k), bias (n,) | None), ...] with `amax` [(k,) | None, ...] for the
    module's kernel (`module.setup`), kept in its `weight_cache` until a weight changes."""
    kernel = module.setup.kernel
    key = (kernel, *((w.data_ptr(), w._version) for w, _ in pairs))
    return cached(module.weight_cache, "int8", key,
                  lambda: [pack_int8(w, b, a, kernel) for (w, b), a in zip(pairs, amax)])



class Int8Linear(Linear):
    """`Linear` on int8 weights at CPU float32 inference (`int8_linear`); `setup`: its kernel and input ranges,
    `fused`: whether its per-row work runs compiled (`fused_rows`, decided when it is swapped in)."""

    setup: Int8Setup
    fused: bool = False

    @classmethod
    def from_plain(cls, linear: Linear, setup: Int8Setup) -> Int8Linear:
        return swapped(linear, cls, setup=setup, fused=fused_rows(linear.settings), weight_cache=WeightCache())

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        if self.weight.dtype != torch.float32 or not inference_pass(self, x):
            return super().forward(x, gelu=gelu)
        w = int8_weights(self, [(self.weight, self.bias)], [self.setup.amax])[0]
        return int8_linear(x.reshape(-1, x.shape[-1]), w, gelu, self.fused).view(*x.shape[:-1], -1)
