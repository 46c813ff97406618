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

CPU inference on oneDNN-packed or int8 expert weights takes the same steps in fewer passes over the (N·k, d)
copies: the dispatch gathers them straight into slices (padded for the packed kernels, `Experts.row_multiple`),
each expert keeps its own output buffer, and `combine.c` sums every token's k rows from where they are (no
concatenation, no second gather); where no C compiler builds it, the same sums in torch ops. Which path ran is
`last_dispatch`; which one a model takes is decided by its `settings` (`moembed.model.settings`).

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

from moembed.model import kernels
from moembed.model.config import EncoderConfig
from moembed.model.experts import Experts, grouped_support, padded_positions

Dispatch = Literal["auto", "grouped", "loop", "naive"]
DISPATCH_MODES = ("auto", "grouped", "loop", "naive")

@dataclass
class Routing:
    logits: torch.Tensor  # (N, E) router logits (float32)
    gates: torch.Tensor  # (N, k) combination weights of the chosen experts
    experts: torch.Tensor  # (N, k) long, chosen expert ids


@dataclass
class Dispatched:
    tokens: torch.Tensor  # (M', d) token copies sorted by expert (M' = M = N·k dropless, unpadded)
    source: torch.Tensor  # (M,) long, flat assignment index n·k + j of each sorted copy
    counts: torch.Tensor  # (E,) long, copies per expert (contiguous, in expert order)
    sizes: list[int] | None = None  # padded: rows per expert in `tokens` (counts rounded up), else None
    at: torch.Tensor | None = None  # padded: (M,) long, the row of `tokens` holding each sorted copy, else None


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
        width = moe.expert_size or config.intermediate_size
        self.experts = Experts(moe.num_experts, config.hidden_size, width, config.mlp, expert_bias)
        # Auxiliary-loss-free balancing (`MoEConfig.balance_rate`): the selection bias, saved with the model, and the
        # assignments counted in training since the last update (`moembed.train.loop.update_balance_biases`).
        self.balance_rate = moe.balance_rate
        if self.balance_rate > 0:
            self.register_buffer("balance_bias", torch.zeros(moe.num_experts))
            self.register_buffer("balance_counts", torch.zeros(moe.num_experts), persistent=False)
        # Shared bias after combination (`MoEConfig.output_bias`); zero-initialised as the other biases.
        self.output_bias = nn.Parameter(torch.zeros(config.hidden_size)) if moe.output_bias else None
        self.dispatch_mode: Dispatch = dispatch_mode
        self.last_dispatch: str | None = None  # the path of the latest forward

    # ---- the four steps ----------------------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> Routing:
        """Router logits, top-k experts and gates. The router runs in float32 (small, and softmax-sensitive).

        Experts whose logits tie exactly (the identical router rows of a virtual group, `convert.upcycle`) are
        ranked by index: the choice is a stable descending sort, so a group of contiguous tied experts is taken
        or left whole. With `balance_rate` the selection bias is added to the logits to choose, not to the gates."""
        if self.training and self.jitter > 0:  # Switch Transformer's multiplicative input jitter
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())  # (N, E)
        probs = logits.softmax(dim=-1)
        score = probs if self.balance_rate == 0 else logits + self.balance_bias
        experts = score.sort(dim=-1, descending=True, stable=True).indices[:, : self.top_k].contiguous()  # (N, k)
        gates = probs.gather(1, experts)  # (N, k)
        if self.balance_rate > 0 and self.training:
            self.balance_counts += torch.bincount(experts.flatten(), minlength=self.num_experts)
        if self.renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return Routing(logits, gates, experts)

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, rows: int = 1,
                 counts: torch.Tensor | None = None) -> Dispatched:
        """Copy each token once per chosen expert and sort the copies by expert (stable: token order kept). With
        `rows` > 1 each expert's slice is padded to a multiple of `rows` in the same gather: the padding repeats
        token 0, whose copies there are computed and never read (a row's result does not depend on its neighbours).
        `counts`: the copies per expert, when the caller has them already."""
        flat = experts.flatten()  # (N·k,)
        source = flat.argsort(stable=True)  # (N·k,) assignment indices grouped by expert
        if counts is None:
            counts = torch.bincount(flat, minlength=self.num_experts)  # (E,)
        token = source // self.top_k  # (N·k,) token of each sorted copy
        if rows == 1:
            return Dispatched(x.index_select(0, token), source, counts)
        sizes = counts.tolist()
        padded = [-(-c // rows) * rows for c in sizes]
        at = padded_positions(sizes, padded, x.device)  # (N·k,) row of each sorted copy in the padded layout
        gather = token.new_zeros(sum(padded))  # (M',) token of each padded row
        gather[at] = token
        return Dispatched(x.index_select(0, gather), source, counts, padded, at)

    def in_place(self, x: torch.Tensor) -> str | None:
        """The CPU inference path whose experts' outputs are combined where they are written (`_forward_in_place`):
        "int8-loop" (after `quantize.quantize_int8`, any mode but "naive"), "packed-loop" / "packed-bf16-loop"
        (oneDNN-packed float32 / bf16 weights, `Experts.packed_dtype`, modes "auto" and "loop"); None otherwise."""
        if self.dispatch_mode != "naive" and self.experts.can_int8(x):
            return "int8-loop"
        packed = self.experts.packed_dtype(x) if self.dispatch_mode in ("auto", "loop") else None
        return None if packed is None else "packed-loop" if packed == torch.float32 else "packed-bf16-loop"

    def compute(self, d: Dispatched) -> torch.Tensor:
        """Each expert on its contiguous slice: (M, d) → (M, d). Records the path taken in `last_dispatch`."""
        x, mode = d.tokens, self.dispatch_mode
        if mode != "loop":
            dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
            support = grouped_support(x.device, dtype)
            if support.usable and (mode == "grouped" or support.preferred):
                y = self.experts.grouped(x, d.counts, dtype)  # None: operand strides not multiples of 16 bytes
                if y is not None:
                    return self._ran("grouped", y)
        return self._ran("loop", self.experts.loop(x, d.counts))

    def _ran(self, path: str, y: torch.Tensor) -> torch.Tensor:
        self.last_dispatch = path
        return y

    def combine(self, y: torch.Tensor, d: Dispatched, gates: torch.Tensor, n: int) -> torch.Tensor:
        """Gate-weighted sum of each token's expert outputs: y (M', d) → (n, d)."""
        k = self.top_k
        if d.source.numel() == n * k:  # dropless: undo the sort with a gather (much faster than a scatter-add on CPU)
            y = y.index_select(0, self._slots(d)).view(n, k, -1)  # (N, k, d)
            g = gates.to(y.dtype).unsqueeze(-1)  # (N, k, 1)
            # a multiply-add per choice: `(y * g).sum(1)` would reduce over a strided axis, slower on a CPU
            out = y[:, 0] * g[:, 0]
            for j in range(1, k):
                out = out.addcmul_(y[:, j], g[:, j])
            return out  # (N, d)
        w = gates.flatten().index_select(0, d.source).to(y.dtype)  # (M,)
        return y.new_zeros(n, y.shape[-1]).index_add_(0, d.source // k, y * w[:, None])

    @staticmethod
    def _slots(d: Dispatched) -> torch.Tensor:
        """(N·k,) the row of `d.tokens` (and of the experts' output) holding each assignment n·k + j."""
        slots = torch.empty_like(d.source)
        slots[d.source] = torch.arange(d.source.numel(), device=d.source.device) if d.at is None else d.at
        return slots

    def _forward_in_place(self, x: torch.Tensor, r: Routing, path: str, counts: torch.Tensor) -> torch.Tensor:
        """CPU inference on int8 or packed expert weights (`in_place`), output bias included: (N, d) → (N, d) float32.

        One gather writes the copies in slices (padded for the packed kernels), each expert writes its own buffer, and
        `combine.c` reads each token's k rows from those buffers (`kernels.combine_rows`): no per-expert padding
        copies, no concatenation, no second gather and no separate multiply-adds, the same bits."""
        n = x.shape[0]
        dtype = torch.bfloat16 if path == "packed-bf16-loop" else torch.float32
        d = self.dispatch(x.to(dtype), r.experts, 1 if path == "int8-loop" else self.experts.row_multiple, counts)
        sizes = d.counts.tolist() if d.sizes is None else d.sizes  # unpadded (int8, or row_multiple 1)
        if path == "int8-loop":
            parts = self.experts.int8_parts(d.tokens, sizes)
        else:  # one (sizes[e], d) buffer per expert, or None
            parts = self.experts.packed_parts(d.tokens, sizes, dtype)
        self._ran(path, x)
        bias = None if self.output_bias is None else self.output_bias.float()
        if not (n and kernels.available("combine")):  # torch ops: the buffers concatenated, then `combine`
            out = self.combine(torch.cat([p for p in parts if p is not None] or [d.tokens[:0]]), d, r.gates, n).float()
            return out if bias is None else out + bias
        flat = r.experts.flatten()  # (N·k,) expert of each assignment
        starts = torch.tensor([0, *sizes[:-1]], device=x.device).cumsum(0)  # (E,) first padded row per expert
        rows = self._slots(d) - starts[flat]  # (N·k,) row within its expert's buffer
        return kernels.combine_rows(parts, flat, rows, r.gates.float().contiguous(), bias)  # (N, d) float32

    # ---- forward -----------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = self.route(x)
        counts = torch.bincount(r.experts.flatten(), minlength=self.num_experts)  # (E,)
        # Capacity in training only: at inference no batch-mate may take a token's expert slot (always dropless).
        if self.capacity_factor is not None and self.training:
            out = self._forward_capacity(x, r, counts)
        elif self.dispatch_mode == "naive":
            out = self._forward_naive(x, r)
        elif (path := self.in_place(x)) is not None:
            return self._forward_in_place(x, r, path, counts).to(x.dtype), r.logits, counts
        else:
            d = self.dispatch(x, r.experts, counts=counts)
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
        return self._ran("naive", out)

    def capacity(self, n: int) -> int:
        """Assignments each expert takes with a capacity factor: ceil(cf · N · k / E)."""
        return max(1, math.ceil(self.capacity_factor * n * self.top_k / self.num_experts))

    def _forward_capacity(self, x: torch.Tensor, r: Routing, counts: torch.Tensor) -> torch.Tensor:
        """Fixed-capacity padded dispatch: an (E, C, d) buffer, assignments past capacity dropped."""
        E, C, dm = self.num_experts, self.capacity(x.shape[0]), x.shape[-1]
        d = self.dispatch(x, r.experts, counts=counts)
        starts = torch.cumsum(d.counts, 0) - d.counts  # (E,) first sorted row of each expert
        expert_of_row = torch.repeat_interleave(torch.arange(E, device=x.device), d.counts)  # (M,)
        pos = torch.arange(d.tokens.shape[0], device=x.device) - starts[expert_of_row]  # (M,) rank within expert
        keep = pos < C
        slot = expert_of_row[keep] * C + pos[keep]  # (M_kept,) row in the flattened buffer
        buf = d.tokens.new_zeros(E * C, dm).index_copy(0, slot, d.tokens[keep])
        y = self.experts.padded(buf.view(E, C, dm)).reshape(E * C, -1).index_select(0, slot)  # (M_kept, d)
        kept = Dispatched(d.tokens[keep], d.source[keep], d.counts.clamp(max=C))
        return self._ran("capacity", self.combine(y, kept, r.gates, x.shape[0]))


def set_dispatch(module: nn.Module, mode: Dispatch) -> None:
    """Set the dispatch implementation of every MoE block inside `module`."""
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch mode {mode!r}; choose one of {', '.join(DISPATCH_MODES)}")
    for m in module.modules():
        if isinstance(m, MoEBlock):
            m.dispatch_mode = mode
