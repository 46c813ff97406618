"""Faster ways to run an MoE block's experts, swapped in for `Experts` by a backend (`moembed.model.backends`):

    GroupedExperts  two grouped matmuls over all slices (`torch._grouped_mm`, a private API probed once per device
                    and dtype by `grouped_support`); under autocast the weights are cast once per weight version
                    and optimizer step (`moembed.model.updates`: a fused optimizer moves no version).
                    Training and inference (the backend of training wherever torch has the kernel).
    PackedExperts   CPU inference: each expert on oneDNN-packed float32 or bf16 weights, GELU fused into fc1, on
                    slices padded to `ROW_MULTIPLE` rows, each expert's output left in its own buffer
    Int8Experts     CPU inference on int8 weights with per-row quantised activations (`fast/int8.py`), each expert's
                    output in its own buffer

Packed and int8 experts give `parts` (one output buffer per expert) for `fast/moe.py`'s in-place combine; on any
other call they run the plain loop. GroupedExperts in bf16 on a CPU pad each expert's rows to a multiple of
`ROW_MULTIPLE` too: there the matmul kernel is made per shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate

import torch

from moembed.model.activations import INPLACE_ACTIVATIONS
from moembed.model.experts import Experts
from moembed.model.fast import swapped
from moembed.model.fast.int8 import Int8Setup, fused_rows, int8_linear, int8_weights
from moembed.model.fast.packed import WeightCache, cached, inference_pass, pack, packed_linear, pass_dtype
from moembed.model.recompute import then_recomputed

# oneDNN makes (JIT-compiles) a primitive for every matmul shape it has not seen, and an expert sees a new row count
# almost every batch. The packed expert loop of CPU inference pads each expert's rows to a multiple of this, so
# that the shapes recur, for at most 31 wasted rows per expert (BENCHMARKS.md). Grouped matmuls in bf16 on a CPU
# (training) are padded the same way (`Experts.grouped_rows`; torch runs each group as a oneDNN matmul, float32 ones
# go to a BLAS without per-shape kernels); that pays only with oneDNN's primitive cache large enough for a step's
# shapes, as training processes set it (moembed.heap.TRAINING_PRIMITIVE_CACHE).
ROW_MULTIPLE = 32


def grouped_mm_aligned(*tensors: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` accepts these operands' layout: strides that are multiples of 16 bytes (except
    unit strides) and 16-byte-aligned storage."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any(s != 1 and (s * size) % 16 for s in t.stride()):
            return False
    return True


@dataclass(frozen=True)
class GroupedSupport:
    """What `torch._grouped_mm` (a private API) offers for one device and dtype, checked once per process."""

    usable: bool  # it runs, forward and backward
    preferred: bool  # and `auto` should pick it over the expert loop
    detail: str  # what was found, for the log


@functools.lru_cache(maxsize=None)
def _grouped_support(device_type: str, index: int | None, dtype: torch.dtype) -> GroupedSupport:
    where = f"{device_type} {str(dtype).removeprefix('torch.')}, torch {torch.__version__}"
    if not hasattr(torch, "_grouped_mm"):
        return GroupedSupport(False, False, f"this torch has no torch._grouped_mm ({where})")
    if device_type not in ("cpu", "cuda") or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return GroupedSupport(False, False, f"torch._grouped_mm has no kernel for {where}")
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    # A tiny forward and backward: older releases raise on some devices and dtypes. Outside inference mode and
    # autocast whatever the caller's context, or the first call (often under an encode's inference_mode) would
    # cache "unusable" for the whole process. No random numbers: the probe runs at the first MoE pass, and drawing
    # from the global generator there would shift a training run's dropout masks (and break an exact resume).
    try:
        with torch.inference_mode(False), torch.autocast(device_type, enabled=False), torch.enable_grad():
            a = torch.ones(32, 16, device=device, dtype=dtype, requires_grad=True)
            b = torch.ones(2, 16, 16, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
            y = torch._grouped_mm(a, b, offs=torch.tensor([16, 32], device=device, dtype=torch.int32))
            torch.autograd.grad(y, (a, b), torch.ones_like(y))  # a dense gradient: an expanded one is refused
    except Exception as e:  # noqa: BLE001 - any failure means "use the loop", never an error for the user
        return GroupedSupport(False, False, f"torch._grouped_mm failed on {where}: {str(e).splitlines()[0]}")
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        fast = cuda_grouped_kernel((major, minor), dtype)
        return GroupedSupport(True, fast, f"{where}, sm_{major}{minor}" + ("" if fast else ": no grouped kernel"))
    return GroupedSupport(True, True, where)


def cuda_grouped_kernel(capability: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether torch runs `_grouped_mm` as one grouped kernel on a GPU of this compute capability: CUTLASS, for
    bfloat16 on sm_90 and sm_100 only (torch's GroupedBlas). Elsewhere it loops over the groups itself after a
    device-to-host copy of the offsets — no better than the expert loop, which `auto` then takes."""
    return dtype == torch.bfloat16 and capability[0] in (9, 10)


def grouped_support(device: torch.device, dtype: torch.dtype) -> GroupedSupport:
    """`torch._grouped_mm`'s support for a device and dtype; probed on first use, then cached."""
    return _grouped_support(device.type, device.index, dtype)


def padded_positions(sizes: list[int], padded: list[int], device: torch.device) -> torch.Tensor:
    """Where each row of consecutive slices of `sizes` rows lands when every slice is padded to `padded` rows."""
    shift = [p0 - s0 for p0, s0 in zip(accumulate(padded, initial=0), accumulate(sizes, initial=0))][:-1]
    m = sum(sizes)  # each slice moves by `shift` rows
    return torch.arange(m, device=device) + torch.tensor(shift, device=device).repeat_interleave(
        torch.tensor(sizes, device=device), output_size=m)


class _CastOnce(torch.autograd.Function):
    """Identity onto a cast made earlier: forward returns `cast[0]` (= w.to(dtype)), backward the gradient cast back
    to w's dtype, as the backward of `w.to(dtype)`. Lets a cached cast enter the graph of each pass."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, cast: tuple[torch.Tensor]) -> torch.Tensor:
        ctx.dtype = w.dtype
        return cast[0].detach()  # a new tensor object on the cached storage: the graph never touches the cache

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


class _SegmentBias(torch.autograd.Function):
    """In place, h[rows of expert e] += bias[e] for consecutive slices of `sizes` rows: h (M, n), bias (E, n).

    Adds each expert's bias to its own slice instead of materialising an (M, n) tensor of repeated bias rows (and
    the new (M, n) sum) as `h + bias.repeat_interleave(counts)` would; the bias gradient is the per-slice row sum."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, bias: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        ctx.sizes = sizes
        for part, b in zip(torch.split(h, sizes), bias):
            if part.shape[0]:
                part.add_(b)
        ctx.mark_dirty(h)
        return h

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = torch.split(grad, ctx.sizes)
        bias_grad = torch.stack([p.sum(0, dtype=torch.float32) for p in parts])  # (E, n), summed in float32
        return grad, bias_grad.to(grad.dtype), None


class GroupedExperts(Experts):
    """`Experts` as two grouped matmuls (`torch._grouped_mm`) where torch has them for the call's device and dtype
    and the operands' layout suits the kernel; the plain loop otherwise."""

    row_multiple = ROW_MULTIPLE

    @classmethod
    def from_plain(cls, experts: Experts) -> GroupedExperts:
        return swapped(experts, cls, weight_cache=WeightCache())

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        y = self.grouped(x, counts, dtype) if grouped_support(x.device, dtype).usable else None
        return super().forward(x, counts) if y is None else y

    def _weights_as(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(fc1_weight, fc2_weight, fc1_bias, fc2_bias) in `dtype`, cast once per weight version and optimizer step.

        Under autocast torch casts an nn.Linear weight once per autocast region and reuses it; `_grouped_mm` is not
        on autocast's lists, so the experts cast by hand, and keep the cast until an in-place update bumps the
        weight's version or an optimizer steps (`cached`: the trainer's fused AdamW bumps no version). With gradient
        the cached copy enters the graph through `_CastOnce`, whose backward is the cast's (the gradient back in the
        weight's dtype).
        """
        params = [self.fc1_weight, self.fc2_weight, self.fc1_bias, self.fc2_bias]
        if dtype == self.fc1_weight.dtype:
            return tuple(params)
        # Inference tensors (a model built under inference_mode) have no version counter and never change. Casts
        # made under inference_mode are inference tensors that autograd refuses: they are kept apart from the others.
        key = (dtype, torch.is_inference_mode_enabled()) + tuple(
            (w.data_ptr(), 0 if w.is_inference() else w._version) for w in params if w is not None)
        casts = cached(self.weight_cache, "cast", key, lambda: [None if w is None else w.detach().to(dtype) for w in params])
        if not torch.is_grad_enabled():
            return tuple(casts)
        # One graph node per weight for as long as the cast is kept, as autocast's own cache keeps for nn.Linear: the
        # passes of a step (queries, documents, negatives) share it, so backward sums their gradients in `dtype` and
        # casts them back once, instead of once per pass with a float32 accumulation each (4x the dense MLPs'
        # parameters). The node saves no tensor, so any number of backward calls may run through it (GradCache's,
        # one per chunk).
        grads = tuple(w is not None and w.requires_grad for w in params)  # freezing a weight needs a new node
        return cached(self.weight_cache, "cast-node", key + grads,
                      lambda: tuple(None if w is None else _CastOnce.apply(w, (c,)) for w, c in zip(params, casts)))

    def grouped_rows(self, x: torch.Tensor) -> int:
        """Rows per expert are padded to a multiple of this in `grouped` (1: not padded): on a CPU in reduced
        precision, where torch runs each group's matmul as a oneDNN primitive made for its shape (see ROW_MULTIPLE)."""
        reduced = x.dtype in (torch.bfloat16, torch.float16)
        return self.row_multiple if x.device.type == "cpu" and reduced and self.settings.pad_rows() else 1

    def grouped(self, x: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Same as `loop` with two grouped matmuls (torch._grouped_mm) in `dtype`; None when the operands' layout
        does not suit the kernel (strides must be multiples of 16 bytes), so that the caller takes the loop."""
        w1, w2, b1, b2 = self._weights_as(dtype)
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)  # (E, d, r), (E, i, d)
        xc = x.to(dtype)
        if not grouped_mm_aligned(xc, w1, w2):  # w2's strides cover act(h)'s
            return None
        sizes, rows = counts.tolist(), self.grouped_rows(xc)
        if rows > 1:  # each slice padded with zero rows, dropped from the output (their gradients are zero)
            padded = [-(-n // rows) * rows for n in sizes]
            dest = padded_positions(sizes, padded, x.device)  # (M,) row of each sorted row in the padded layout
            xc = xc.new_zeros(sum(padded), xc.shape[1]).index_copy(0, dest, xc)  # (M', d)
            sizes = padded
        offs = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)  # (E,) end of each expert's slice
        h = torch._grouped_mm(xc, w1, offs=offs)  # (M, r)
        if b1 is not None:
            h = _SegmentBias.apply(h, b1, sizes)
        y = then_recomputed(self.act, h, lambda a: torch._grouped_mm(a.contiguous(), w2, offs=offs),  # (M, d)
                            self.recompute_act)
        if b2 is not None:
            y = _SegmentBias.apply(y, b2, sizes)
        return y if rows == 1 else y.index_select(0, dest)  # (M, d)


class PackedExperts(Experts):
    """`Experts` on oneDNN-packed weights at CPU inference, for the passes of `dtypes` (float32 and/or bf16 under
    bf16 autocast where bf16 matmuls are native), as `fast.packed.PackedLinear` does for dense layers."""

    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    row_multiple = ROW_MULTIPLE  # the dispatch pads each expert's rows to a multiple of this

    @classmethod
    def from_plain(cls, experts: Experts, *dtypes: torch.dtype) -> PackedExperts:
        return swapped(experts, cls, dtypes=dtypes or (torch.float32,), weight_cache=WeightCache())

    def serves(self, x: torch.Tensor) -> torch.dtype | None:
        """The dtype `parts` runs this call in (`packed.pass_dtype`, one of `dtypes`), or None: the plain loop."""
        dtype = pass_dtype(self, x) if self.fc1_weight.dtype == torch.float32 else None
        return dtype if dtype in self.dtypes else None

    def _packed(self, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        key = tuple((w.data_ptr(), w._version) for w in (self.fc1_weight, self.fc2_weight))
        return cached(self.weight_cache, f"packed-{dtype}", key, lambda: [
            (pack(self.fc1_weight[e], dtype), pack(self.fc2_weight[e], dtype)) for e in range(self.num_experts)
        ])

    def parts(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor | None]:
        """Each expert on its slice of x (M', d) — already in the dtype `serves` gave — slices of `sizes` rows
        (padded by the dispatch to multiples of `row_multiple`, for the kernels' sake): one (sizes[e], d) output per
        expert in that dtype, in a buffer of its own (None for an expert without rows), for the in-place combine to
        read. Float32 biases are added in the kernel."""
        packed, gelu = self._packed(x.dtype), self.kind == "gelu"  # GELU as fc1's post-op (`packed.packed_linear`)
        out: list[torch.Tensor | None] = []
        for e, p in enumerate(torch.split(x, sizes)):
            if not p.shape[0]:
                out.append(None)
                continue
            (w1, w2), (b1, b2) = packed[e], self.biases(e)
            h = packed_linear(p, w1, b1, gelu)
            a = h if gelu else self.act(h).contiguous()
            out.append(packed_linear(a, w2, b2).contiguous())
        return out


class Int8Experts(Experts):
    """`Experts` on int8 weights at CPU float32 inference (`fast.int8.int8_linear`); `setup`: the kernel and the
    input ranges (fc1's (d,), [fc2's (i,) per expert]); `fused`: the per-row work compiled (`fused_rows`)."""

    setup: Int8Setup
    fused: bool = False
    row_multiple = 1  # int8 slices are not padded

    @classmethod
    def from_plain(cls, experts: Experts, setup: Int8Setup) -> Int8Experts:
        return swapped(experts, cls, setup=setup, fused=fused_rows(experts.settings), weight_cache=WeightCache())

    def serves(self, x: torch.Tensor) -> torch.dtype | None:
        """float32 where `parts` takes this call (a CPU float32 inference pass, float32 weights), else None."""
        return torch.float32 if self.fc1_weight.dtype == torch.float32 and inference_pass(self, x) else None

    def parts(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor | None]:
        """Each expert on its slice of x (M, d), slices of `sizes` rows, on int8 weights with per-row quantised
        activations: one (sizes[e], d) float32 output per expert, in a buffer of its own (None for an expert
        without rows), as `PackedExperts.parts`."""
        pairs, amax = [], []
        stats = self.setup.amax or (None, [None] * self.num_experts)
        for e in range(self.num_experts):  # [fc1 of expert 0, fc2 of expert 0, fc1 of expert 1, ...]
            b1, b2 = self.biases(e)
            pairs += [(self.fc1_weight[e], b1), (self.fc2_weight[e], b2)]
            amax += [stats[0], stats[1][e]]
        w = int8_weights(self, pairs, amax)
        gelu, fused = self.kind == "gelu", self.fused  # GELU inside fc1's rescale (`int8_linear`)
        act = (lambda h: h) if gelu else INPLACE_ACTIVATIONS.get(self.kind, self.act)  # on int8_linear's own buffer
        return [int8_linear(act(int8_linear(p, w[2 * e], gelu, fused)), w[2 * e + 1], False, fused).contiguous()
                if p.shape[0] else None
                for e, p in enumerate(torch.split(x, sizes))]
