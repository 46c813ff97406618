"""Sparse Mixture-of-Experts MLP block (nomic-embed-v2 §3.2; Shazeer et al. 2017; Fedus et al. 2022).

    router: h = x W_r  (no bias)  →  p = softmax(h)  →  the top-k experts of each token, gates g = p[top-k]
    (renormalised to sum to 1 when `renormalize`)  →  y = Σ_j g_j · Expert_{e_j}(x)

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

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from moembed.model.config import EncoderConfig
from moembed.model.linear import fastpath_enabled

Dispatch = Literal["auto", "grouped", "loop", "naive"]
DISPATCH_MODES = ("auto", "grouped", "loop", "naive")


def grouped_mm_available(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` (a private API) can multiply a (M, K) by b (E, K, n) here.

    It needs matching float dtypes and strides that are multiples of 16 bytes (except unit strides).
    """
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype:
        return False
    if a.dtype not in (torch.float32, torch.bfloat16, torch.float16) or a.device.type not in ("cpu", "cuda"):
        return False
    for t in (a, b):
        size = t.element_size()
        if t.data_ptr() % 16 or any(s != 1 and (s * size) % 16 for s in t.stride()):
            return False
    return True


class Experts(nn.Module):
    """E MLPs of one kind (GELU or SwiGLU, as the dense MLP they replace), weights stacked on a leading E axis.

    fc1_weight (E, r, d) with r = i (GELU) or 2i (SwiGLU: rows [:i] up, [i:] gate), fc2_weight (E, d, i),
    optional biases fc1_bias (E, r), fc2_bias (E, d). Each slice [e] has the layout of the dense MLP's
    `fc1.weight` / `fc2.weight`, so upcycling is a broadcast copy.
    """

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
        if self.kind == "swiglu":
            up, gate = h.chunk(2, dim=-1)
            return up * F.silu(gate)
        return F.gelu(h)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on tokens x (n, d) → (n, d)."""
        b1 = self.fc1_bias[e] if self.fc1_bias is not None else None
        b2 = self.fc2_bias[e] if self.fc2_bias is not None else None
        return F.linear(self.act(F.linear(x, self.fc1_weight[e], b1)), self.fc2_weight[e], b2)

    def loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, d) sorted by expert with counts (E,) → (M, d): a loop over experts on contiguous slices."""
        parts = torch.split(x, counts.tolist())
        run = self._packed_expert if self._can_pack(x) else self.expert
        return torch.cat([run(e, p) for e, p in enumerate(parts) if p.shape[0]] or [x[:0]])

    # CPU float32 inference: oneDNN-packed expert weights, as `moembed.model.linear.Linear` does for dense layers.

    def _can_pack(self, x: torch.Tensor) -> bool:
        return (
            x.device.type == "cpu" and x.dtype == torch.float32 and self.fc1_weight.dtype == torch.float32
            and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu") and fastpath_enabled()
        )

    def _packed(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Keyed by storage and version counters: an optimizer step or load_state_dict repacks.
        key = tuple((w.data_ptr(), w._version) for w in (self.fc1_weight, self.fc2_weight))
        cache = self.__dict__.get("_packed_cache")
        if cache is None or cache[0] != key:
            pack = torch.ops.mkldnn._reorder_linear_weight
            packed = [(pack(self.fc1_weight[e].detach()), pack(self.fc2_weight[e].detach())) for e in range(self.num_experts)]
            cache = (key, packed)
            self.__dict__["_packed_cache"] = cache
        return cache[1]

    def _packed_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = self._packed()[e]
        b1 = self.fc1_bias[e] if self.fc1_bias is not None else None
        b2 = self.fc2_bias[e] if self.fc2_bias is not None else None
        lin = torch.ops.mkldnn._linear_pointwise
        return lin(self.act(lin(x, w1, b1, "none", [], "")).contiguous(), w2, b2, "none", [], "")

    def grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Same as `loop` with two grouped matmuls (torch._grouped_mm); falls back to `loop` where unusable."""
        dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):  # _grouped_mm is not on autocast's lists: cast by hand
            dtype = torch.get_autocast_dtype(x.device.type)
        w1 = self.fc1_weight.to(dtype).transpose(1, 2)  # (E, d, r)
        w2 = self.fc2_weight.to(dtype).transpose(1, 2)  # (E, i, d)
        xc = x.to(dtype)
        if not (grouped_mm_available(xc, w1) and grouped_mm_available(w2, w2)):  # w2's strides cover act(h)'s
            return self.loop(x, counts)
        offs = counts.cumsum(0).to(torch.int32)  # (E,) end of each expert's slice
        h = torch._grouped_mm(xc, w1, offs=offs)  # (M, r)
        if self.fc1_bias is not None:
            h = h + self.fc1_bias.to(dtype).repeat_interleave(counts, dim=0, output_size=x.shape[0])
        y = torch._grouped_mm(self.act(h).contiguous(), w2, offs=offs)  # (M, d)
        if self.fc2_bias is not None:
            y = y + self.fc2_bias.to(dtype).repeat_interleave(counts, dim=0, output_size=x.shape[0])
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
        self.experts = Experts(moe.num_experts, config.hidden_size, config.intermediate_size, config.mlp, config.bias)
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
        """Each expert on its contiguous slice: (M, d) → (M, d)."""
        if self.dispatch_mode == "grouped" or (self.dispatch_mode == "auto" and not self.experts._can_pack(d.tokens)):
            return self.experts.grouped(d.tokens, d.counts)
        return self.experts.loop(d.tokens, d.counts)

    def combine(self, y: torch.Tensor, d: Dispatched, gates: torch.Tensor, n: int) -> torch.Tensor:
        """Gate-weighted sum of each token's expert outputs: y (M, d) → (n, d)."""
        k = self.top_k
        if y.shape[0] == n * k:  # dropless: undo the sort with a gather (much faster than a scatter-add on CPU)
            inverse = torch.empty_like(d.source)
            inverse[d.source] = torch.arange(n * k, device=y.device)  # (N·k,) sorted row of each assignment
            y = y.index_select(0, inverse).view(n, k, -1)  # (N, k, d)
            return (y * gates.to(y.dtype).unsqueeze(-1)).sum(1)  # (N, d)
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
        return out.to(x.dtype), r.logits, counts

    def _forward_naive(self, x: torch.Tensor, r: Routing) -> torch.Tensor:
        """Reference: for each expert, a boolean mask over all tokens selects its assignments."""
        out = x.new_zeros(x.shape)  # (N, d)
        for e in range(self.num_experts):
            tok, slot = (r.experts == e).nonzero(as_tuple=True)  # (n_e,) each
            if tok.numel():
                y = self.experts.expert(e, x.index_select(0, tok)) * r.gates[tok, slot, None]  # (n_e, d)
                out = out.index_add(0, tok, y.to(out.dtype))
        return out

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
        return self.combine(y, kept, r.gates, x.shape[0])


def set_dispatch(module: nn.Module, mode: Dispatch) -> None:
    """Set the dispatch implementation of every MoE block inside `module`."""
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch mode {mode!r}; choose one of {', '.join(DISPATCH_MODES)}")
    for m in module.modules():
        if isinstance(m, MoEBlock):
            m.dispatch_mode = mode
