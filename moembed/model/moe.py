"""Sparse Mixture-of-Experts MLP block (nomic-embed-v2 §3.2; Shazeer et al. 2017; Fedus et al. 2022).

    router: h = x W_r  (no bias)  →  p = softmax(h)  →  the top-k experts of each token, gates g = p[top-k]
    (renormalised to sum to 1 when `renormalize`)  →  y = Σ_j g_j · Expert_{e_j}(x)  (+ b when `output_bias`)

With `renormalize` off the gates are the softmax probabilities themselves (summing to less than 1), and with
`output_bias` one bias b of width d, shared by all experts, is added once after the weighted sum: the layout of
the published nomic-embed-text-v2-moe (its experts have no biases of their own, `expert_bias` off).

The block sees only real tokens: the encoder removes padding before the first layer (encoder.py), so the
input is the packed (N, d) tensor and padding is never routed, never counted and never takes expert capacity.

Computation is split in four steps so that expert parallelism can later wrap `dispatch`/`combine` with an
all-to-all: `route` (router logits, gates, chosen experts) → `dispatch` (token copies sorted by expert, one
contiguous slice per expert) → `Experts.grouped` (every expert on its slice) → `combine` (gate-weighted sum).

Dropless by default: every assignment is computed, however unbalanced. With `capacity_factor` each expert
takes at most C = ceil(capacity_factor · N · k / E) assignments in a fixed-shape (E, C, d) buffer, as on
accelerators that want static shapes; assignments past an expert's capacity are dropped (they add nothing,
so a token whose every choice overflowed leaves the block as zero and passes through the residual only).
Assignments compete in token order (earlier tokens first).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from moembed.model.activations import MLP_ACTIVATIONS
from moembed.model.config import EncoderConfig
from moembed.model.linear import (
    cached,
    inference_pass,
    int8_linear,
    int8_weights,
    pack,
    packed_dtype,
    packed_linear,
)
from moembed.model.recompute import then_recomputed

Dispatch = Literal["auto", "grouped", "loop", "naive"]
DISPATCH_MODES = ("auto", "grouped", "loop", "naive")

log = logging.getLogger("moembed")

# oneDNN makes (JIT-compiles) a primitive for every matmul shape it has not seen, ~0.4 ms each on an AVX-512 EPYC,
# and an expert sees a new row count almost every batch. The packed expert loop of CPU inference pads each expert's
# rows to a multiple of this, so that the shapes recur: an MoE block on 60 batches of random size took 0.60 s
# instead of 0.91 s in bf16 and 1.06 s instead of 1.37 s in float32 (BENCHMARKS.md, "On an AVX-512 BF16 / VNNI
# CPU"), for at most 31 wasted rows per expert. Padding bf16 grouped matmuls in training the same way gained
# nothing (0.99x the step time with new batches every step), so training is not padded.
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


_ANNOUNCED: set[str] = set()


def _announce(message: str) -> None:
    """Log which dispatch runs, once per distinct message and process (logger "moembed")."""
    if message not in _ANNOUNCED:
        _ANNOUNCED.add(message)
        log.info("MoE dispatch: %s", message)


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


class Experts(nn.Module):
    """E MLPs of one kind (GELU or SwiGLU, as the dense MLP they replace), weights stacked on a leading E axis.

    fc1_weight (E, r, d) with r = i (GELU) or 2i (SwiGLU: rows [:i] up, [i:] gate), fc2_weight (E, d, i),
    optional biases fc1_bias (E, r), fc2_bias (E, d). Each slice [e] has the layout of the dense MLP's
    `fc1.weight` / `fc2.weight`, so upcycling is a broadcast copy.
    """

    int8 = False  # set by `moembed.model.linear.quantize_int8`
    row_multiple = ROW_MULTIPLE  # rows per expert padded to a multiple of this in `packed_loop` (1: never)
    recompute_act = False  # keep fc1's output, not the activation's, for backward (moembed.model.recompute)

    def __init__(self, num_experts: int, d: int, i: int, kind: str, bias: bool):
        super().__init__()
        self.kind, self.num_experts = kind, num_experts
        r = 2 * i if kind == "swiglu" else i
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, r, d))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, d, i))
        self.fc1_bias = nn.Parameter(torch.zeros(num_experts, r)) if bias else None
        self.fc2_bias = nn.Parameter(torch.zeros(num_experts, d)) if bias else None
        nn.init.normal_(self.fc1_weight, std=0.02)  # as Encoder._init_weights for nn.Linear
        nn.init.normal_(self.fc2_weight, std=0.02)

    def act(self, h: torch.Tensor) -> torch.Tensor:
        return MLP_ACTIVATIONS[self.kind](h)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on tokens x (n, d) → (n, d)."""
        b1 = self.fc1_bias[e] if self.fc1_bias is not None else None
        b2 = self.fc2_bias[e] if self.fc2_bias is not None else None
        h = F.linear(x, self.fc1_weight[e], b1)
        return then_recomputed(self.act, h, lambda a: F.linear(a, self.fc2_weight[e], b2), self.recompute_act)

    def loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, d) sorted by expert with counts (E,) → (M, d): a loop over experts on contiguous slices."""
        parts = torch.split(x, counts.tolist())
        return torch.cat([self.expert(e, p) for e, p in enumerate(parts) if p.shape[0]] or [x[:0]])

    # CPU inference: oneDNN-packed expert weights, as `moembed.model.linear.Linear` does for dense layers — float32,
    # or bf16 under bf16 autocast where bf16 matmuls are native (no per-pass cast, no generic grouped matmul).

    def packed_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The dtype `packed_loop` runs in for this call (`linear.packed_dtype`), or None where it does not apply."""
        return packed_dtype(self, x) if self.fc1_weight.dtype == torch.float32 else None

    def _packed(self, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        key = (dtype,) + tuple((w.data_ptr(), w._version) for w in (self.fc1_weight, self.fc2_weight))
        return cached(self, f"packed-{dtype}", key, lambda: [
            (pack(self.fc1_weight[e], dtype), pack(self.fc2_weight[e], dtype)) for e in range(self.num_experts)
        ])

    def packed_loop(self, x: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`loop` on oneDNN-packed weights in `dtype` (see `packed_dtype`); float32 biases are added in the kernel.
        Each expert's rows are padded to a multiple of `row_multiple` (a row's result does not depend on its
        neighbours, padding included)."""
        packed, gelu = self._packed(dtype), self.kind == "gelu"  # GELU as fc1's post-op (`linear.packed_linear`)
        out = []
        for e, p in enumerate(torch.split(x.to(dtype), counts.tolist())):
            n = p.shape[0]
            if n:
                w1, w2 = packed[e]
                b1 = self.fc1_bias[e] if self.fc1_bias is not None else None
                b2 = self.fc2_bias[e] if self.fc2_bias is not None else None
                if n % self.row_multiple:  # zero rows, dropped from the output
                    p = F.pad(p, (0, 0, 0, -n % self.row_multiple))
                h = packed_linear(p, w1, b1, gelu)
                a = h if gelu else self.act(h).contiguous()
                out.append(packed_linear(a, w2, b2)[:n])
        return torch.cat(out or [x[:0].to(dtype)])

    def can_int8(self, x: torch.Tensor) -> bool:
        """Whether `int8_loop` applies: the model was switched to int8 (`linear.quantize_int8`) and this is a CPU
        float32 inference pass."""
        return self.int8 and inference_pass(self, x) and self.fc1_weight.dtype == torch.float32

    def int8_loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`loop` on int8 weights with per-row quantised activations (`moembed.model.linear.int8_linear`)."""
        b1 = self.fc1_bias if self.fc1_bias is not None else [None] * self.num_experts
        b2 = self.fc2_bias if self.fc2_bias is not None else [None] * self.num_experts
        pairs, amax = [], []
        stats = self.__dict__.get("int8_amax") or (None, [None] * self.num_experts)
        for e in range(self.num_experts):  # [fc1 of expert 0, fc2 of expert 0, fc1 of expert 1, ...]
            pairs += [(self.fc1_weight[e], b1[e]), (self.fc2_weight[e], b2[e])]
            amax += [stats[0], stats[1][e]]
        w = int8_weights(self, pairs, amax)
        out = [int8_linear(self.act(int8_linear(p, w[2 * e])), w[2 * e + 1])
               for e, p in enumerate(torch.split(x, counts.tolist())) if p.shape[0]]
        return torch.cat(out or [x[:0]])

    @torch.no_grad()
    def record_amax(self, x: torch.Tensor) -> None:
        """Largest |input| per channel of every expert's two matmuls, over all tokens x (N, d) of a calibration
        pass (each expert sees every token, so that each gets ranges): `int8_amax` = (fc1's (d,), [fc2's (i,)])."""
        old = self.__dict__.get("int8_amax") or (None, [None] * self.num_experts)
        fc1 = x.abs().amax(0).float() if old[0] is None else torch.maximum(x.abs().amax(0).float(), old[0])
        fc2 = []
        for e in range(self.num_experts):
            b1 = self.fc1_bias[e] if self.fc1_bias is not None else None
            a = self.act(F.linear(x, self.fc1_weight[e], b1)).abs().amax(0).float()
            fc2.append(a if old[1][e] is None else torch.maximum(a, old[1][e]))
        self.__dict__["int8_amax"] = (fc1, fc2)

    # Grouped matmuls.

    def _weights_as(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(fc1_weight, fc2_weight, fc1_bias, fc2_bias) in `dtype`, cast once per weight version.

        Under autocast torch casts an nn.Linear weight once per autocast region and reuses it; `_grouped_mm` is not
        on autocast's lists, so the experts cast by hand, and keep the cast until an optimizer step (or any in-place
        update) bumps the weight's version. With gradient the cached copy enters the graph through `_CastOnce`,
        whose backward is the cast's (the gradient back in the weight's dtype).
        """
        params = [self.fc1_weight, self.fc2_weight, self.fc1_bias, self.fc2_bias]
        if dtype == self.fc1_weight.dtype:
            return tuple(params)
        # Inference tensors (a model built under inference_mode) have no version counter and never change. Casts
        # made under inference_mode are inference tensors that autograd refuses: they are kept apart from the others.
        key = (dtype, torch.is_inference_mode_enabled()) + tuple(
            (w.data_ptr(), 0 if w.is_inference() else w._version) for w in params if w is not None)
        casts = cached(self, "cast", key, lambda: [None if w is None else w.detach().to(dtype) for w in params])
        if not torch.is_grad_enabled():
            return tuple(casts)
        return tuple(None if w is None else _CastOnce.apply(w, (c,)) for w, c in zip(params, casts))

    def grouped(self, x: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Same as `loop` with two grouped matmuls (torch._grouped_mm) in `dtype`; None when the operands' layout
        does not suit the kernel (strides must be multiples of 16 bytes), so that the caller takes the loop."""
        w1, w2, b1, b2 = self._weights_as(dtype)
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)  # (E, d, r), (E, i, d)
        xc = x.to(dtype)
        if not grouped_mm_aligned(xc, w1, w2):  # w2's strides cover act(h)'s
            return None
        offs = counts.cumsum(0).to(torch.int32)  # (E,) end of each expert's slice
        sizes = counts.tolist()
        h = torch._grouped_mm(xc, w1, offs=offs)  # (M, r)
        if b1 is not None:
            h = _SegmentBias.apply(h, b1, sizes)
        y = then_recomputed(self.act, h, lambda a: torch._grouped_mm(a.contiguous(), w2, offs=offs),  # (M, d)
                            self.recompute_act)
        if b2 is not None:
            y = _SegmentBias.apply(y, b2, sizes)
        return y

    def padded(self, buf: torch.Tensor) -> torch.Tensor:
        """Fixed-shape batched experts: buf (E, C, d) → (E, C, d)."""
        h = torch.bmm(buf, self.fc1_weight.transpose(1, 2))  # (E, C, r)
        if self.fc1_bias is not None:
            h = h + self.fc1_bias[:, None, :]
        y = torch.bmm(self.act(h), self.fc2_weight.transpose(1, 2))  # (E, C, d)
        if self.fc2_bias is not None:
            y = y + self.fc2_bias[:, None, :]
        return y


@dataclass
class Routing:
    logits: torch.Tensor  # (N, E) router logits (float32)
    gates: torch.Tensor  # (N, k) combination weights of the chosen experts
    experts: torch.Tensor  # (N, k) long, chosen expert ids


@dataclass
class Dispatched:
    tokens: torch.Tensor  # (M, d) token copies sorted by expert (M = N·k dropless)
    source: torch.Tensor  # (M,) long, flat assignment index n·k + j of each row
    counts: torch.Tensor  # (E,) long, rows per expert (contiguous, in expert order)


class MoEBlock(nn.Module):
    """Sparse MoE replacement of a dense MLP. forward(x (N, d)) → (hidden (N, d), router_logits (N, E),
    expert_counts (E,) long: routing assignments per expert, before any capacity drop).

    `dispatch_mode` (runtime, not part of the config): "auto" (grouped matmul when usable, else the expert
    loop), "grouped", "loop", or "naive" (boolean mask per expert over all tokens: the plain reference).
    """

    def __init__(self, config: EncoderConfig, dispatch_mode: Dispatch = "auto"):
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("MoEBlock needs config.moe")
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.renormalize, self.capacity_factor, self.jitter = moe.renormalize, moe.capacity_factor, moe.router_jitter
        self.router = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        expert_bias = config.bias if moe.expert_bias is None else moe.expert_bias
        self.experts = Experts(moe.num_experts, config.hidden_size, config.intermediate_size, config.mlp, expert_bias)
        # Shared bias after combination (`MoEConfig.output_bias`); zero-initialised as the other biases.
        self.output_bias = nn.Parameter(torch.zeros(config.hidden_size)) if moe.output_bias else None
        self.dispatch_mode: Dispatch = dispatch_mode

    # ---- the four steps ----------------------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> Routing:
        """Router logits, top-k experts and gates. The router runs in float32 (small, and softmax-sensitive)."""
        if self.training and self.jitter > 0:  # Switch Transformer's multiplicative input jitter
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())  # (N, E)
        probs = logits.softmax(dim=-1)
        gates, experts = probs.topk(self.top_k, dim=-1)  # (N, k) each
        if self.renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return Routing(logits, gates, experts)

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> Dispatched:
        """Copy each token once per chosen expert and sort the copies by expert (stable: token order kept)."""
        flat = experts.flatten()  # (N·k,)
        source = flat.argsort(stable=True)  # (N·k,) assignment indices grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,)
        return Dispatched(x.index_select(0, source // self.top_k), source, counts)

    def compute(self, d: Dispatched) -> torch.Tensor:
        """Each expert on its contiguous slice: (M, d) → (M, d). Records the path taken in `last_dispatch`."""
        x, mode = d.tokens, self.dispatch_mode
        if mode != "naive" and self.experts.can_int8(x):
            return self._ran("int8-loop", "expert loop on int8 weights (cpu inference)", self.experts.int8_loop(x, d.counts))
        packed = self.experts.packed_dtype(x) if mode in ("auto", "loop") else None
        if packed == torch.float32:
            return self._ran("packed-loop", "expert loop on oneDNN-packed weights (cpu float32 inference)",
                             self.experts.packed_loop(x, d.counts, packed))
        if packed == torch.bfloat16:
            return self._ran("packed-bf16-loop", "expert loop on oneDNN-packed bf16 weights (cpu bf16 inference)",
                             self.experts.packed_loop(x, d.counts, packed))
        if mode == "loop":
            return self._ran("loop", "expert loop (asked for)", self.experts.loop(x, d.counts))
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        support = grouped_support(x.device, dtype)
        if support.usable and (mode == "grouped" or support.preferred):
            y = self.experts.grouped(x, d.counts, dtype)
            if y is not None:
                return self._ran("grouped", f"grouped matmuls, torch._grouped_mm ({support.detail})", y)
            why = "operand strides are not multiples of 16 bytes (hidden or intermediate size)"
        else:
            why = support.detail
        return self._ran("loop", f"expert loop instead of grouped matmuls: {why}", self.experts.loop(x, d.counts))

    def _ran(self, path: str, message: str, y: torch.Tensor) -> torch.Tensor:
        self.__dict__["last_dispatch"] = path  # plain attribute (not through nn.Module.__setattr__): per forward
        _announce(message)
        return y

    def combine(self, y: torch.Tensor, d: Dispatched, gates: torch.Tensor, n: int) -> torch.Tensor:
        """Gate-weighted sum of each token's expert outputs: y (M, d) → (n, d)."""
        k = self.top_k
        if y.shape[0] == n * k:  # dropless: undo the sort with a gather (much faster than a scatter-add on CPU)
            inverse = torch.empty_like(d.source)
            inverse[d.source] = torch.arange(n * k, device=y.device)  # (N·k,) sorted row of each assignment
            y = y.index_select(0, inverse).view(n, k, -1)  # (N, k, d)
            g = gates.to(y.dtype).unsqueeze(-1)  # (N, k, 1)
            # a multiply-add per choice: `(y * g).sum(1)`, a reduction over a strided axis, took 5% of a bf16 block
            out = y[:, 0] * g[:, 0]
            for j in range(1, k):
                out = out.addcmul_(y[:, j], g[:, j])
            return out  # (N, d)
        w = gates.flatten().index_select(0, d.source).to(y.dtype)  # (M,)
        return y.new_zeros(n, y.shape[-1]).index_add_(0, d.source // k, y * w[:, None])

    # ---- forward -----------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = self.route(x)
        counts = torch.bincount(r.experts.flatten(), minlength=self.num_experts)  # (E,)
        # Capacity in training only: at inference no batch-mate may take a token's expert slot (always dropless).
        if self.capacity_factor is not None and self.training:
            out = self._forward_capacity(x, r)
        elif self.dispatch_mode == "naive":
            out = self._forward_naive(x, r)
        else:
            d = self.dispatch(x, r.experts)
            out = self.combine(self.compute(d), d, r.gates, x.shape[0])
        if self.output_bias is not None:  # once per token, not weighted by the gates
            out = out + self.output_bias.to(out.dtype)
        return out.to(x.dtype), r.logits, counts

    def _forward_naive(self, x: torch.Tensor, r: Routing) -> torch.Tensor:
        """Reference: for each expert, a boolean mask over all tokens selects its assignments."""
        out = x.new_zeros(x.shape)  # (N, d)
        for e in range(self.num_experts):
            tok, slot = (r.experts == e).nonzero(as_tuple=True)  # (n_e,) each
            if tok.numel():
                y = self.experts.expert(e, x.index_select(0, tok)) * r.gates[tok, slot, None]  # (n_e, d)
                out = out.index_add(0, tok, y.to(out.dtype))
        return self._ran("naive", "naive per-expert masks (asked for)", out)

    def capacity(self, n: int) -> int:
        """Assignments each expert takes with a capacity factor: ceil(cf · N · k / E)."""
        return max(1, math.ceil(self.capacity_factor * n * self.top_k / self.num_experts))

    def _forward_capacity(self, x: torch.Tensor, r: Routing) -> torch.Tensor:
        """Fixed-capacity padded dispatch: an (E, C, d) buffer, assignments past capacity dropped."""
        E, C, dm = self.num_experts, self.capacity(x.shape[0]), x.shape[-1]
        d = self.dispatch(x, r.experts)
        starts = torch.cumsum(d.counts, 0) - d.counts  # (E,) first sorted row of each expert
        expert_of_row = torch.repeat_interleave(torch.arange(E, device=x.device), d.counts)  # (M,)
        pos = torch.arange(d.tokens.shape[0], device=x.device) - starts[expert_of_row]  # (M,) rank within expert
        keep = pos < C
        slot = expert_of_row[keep] * C + pos[keep]  # (M_kept,) row in the flattened buffer
        buf = d.tokens.new_zeros(E * C, dm).index_copy(0, slot, d.tokens[keep])
        y = self.experts.padded(buf.view(E, C, dm)).reshape(E * C, -1).index_select(0, slot)  # (M_kept, d)
        kept = Dispatched(d.tokens[keep], d.source[keep], d.counts.clamp(max=C))
        return self._ran("capacity", "fixed-capacity batched matmuls (capacity_factor)", self.combine(y, kept, r.gates, x.shape[0]))


def set_dispatch(module: nn.Module, mode: Dispatch) -> None:
    """Set the dispatch implementation of every MoE block inside `module`."""
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch mode {mode!r}; choose one of {', '.join(DISPATCH_MODES)}")
    for m in module.modules():
        if isinstance(m, MoEBlock):
            m.dispatch_mode = mode
