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
contiguous slice per expert) → `experts` (every expert on its slice) → `combine` (gate-weighted sum). Faster ways
to run the same steps (grouped matmuls; packed or int8 experts combined in place at CPU inference) are swapped in
by a backend (`moembed.model.fast`).

Dropless by default: every assignment is computed, however unbalanced. With `capacity_factor` each expert
takes at most C = ceil(capacity_factor · N · k / E) assignments in a fixed-shape (E, C, d) buffer, as on
accelerators that want static shapes; assignments past an expert's capacity are dropped (they add nothing,
so a token whose every choice overflowed leaves the block as zero and passes through the residual only).
Assignments compete in token order (earlier tokens first). Capacity applies in training only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from moembed.model.config import EncoderConfig
from moembed.model.experts import Experts


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
    expert_counts (E,) long: routing assignments per expert, before any capacity drop)."""

    def __init__(self, config: EncoderConfig):
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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = self.route(x)
        counts = torch.bincount(r.experts.flatten(), minlength=self.num_experts)  # (E,)
        if self.capacity_factor is not None and self.training:  # at inference no batch-mate may take a token's slot
            out = self._forward_capacity(x, r, counts)
        else:
            d = self.dispatch(x, r.experts, counts)
            out = self.combine(self.experts(d.tokens, d.counts), d, r.gates, x.shape[0])  # (N, d)
        if self.output_bias is not None:  # once per token, not weighted by the gates
            out = out + self.output_bias.to(out.dtype)
        return out.to(x.dtype), r.logits, counts

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

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor) -> Dispatched:
        """Copy each token once per chosen expert and sort the copies by expert (stable: token order kept);
        `counts` (E,): the copies per expert."""
        source = experts.flatten().argsort(stable=True)  # (N·k,) assignment indices grouped by expert
        return Dispatched(x.index_select(0, source // self.top_k), source, counts)

    def combine(self, y: torch.Tensor, d: Dispatched, gates: torch.Tensor, n: int) -> torch.Tensor:
        """Gate-weighted sum of each token's expert outputs: y (M', d) → (n, d)."""
        k = self.top_k
        if d.source.numel() == n * k:  # dropless: undo the sort with a gather (much faster than a scatter-add on CPU)
            y = y.index_select(0, slots(d)).view(n, k, -1)  # (N, k, d)
            g = gates.to(y.dtype).unsqueeze(-1)  # (N, k, 1)
            # a multiply-add per choice: `(y * g).sum(1)` would reduce over a strided axis, slower on a CPU
            out = y[:, 0] * g[:, 0]
            for j in range(1, k):
                out = out.addcmul_(y[:, j], g[:, j])
            return out  # (N, d)
        w = gates.flatten().index_select(0, d.source).to(y.dtype)  # (M,)
        return y.new_zeros(n, y.shape[-1]).index_add_(0, d.source // k, y * w[:, None])

    def capacity(self, n: int) -> int:
        """Assignments each expert takes with a capacity factor: ceil(cf · N · k / E)."""
        return max(1, math.ceil(self.capacity_factor * n * self.top_k / self.num_experts))

    def _forward_capacity(self, x: torch.Tensor, r: Routing, counts: torch.Tensor) -> torch.Tensor:
        """Fixed-capacity padded dispatch: an (E, C, d) buffer, assignments past capacity dropped."""
        E, C, dm = self.num_experts, self.capacity(x.shape[0]), x.shape[-1]
        d = self.dispatch(x, r.experts, counts)
        starts = torch.cumsum(d.counts, 0) - d.counts  # (E,) first sorted row of each expert
        expert_of_row = torch.repeat_interleave(torch.arange(E, device=x.device), d.counts)  # (M,)
        pos = torch.arange(d.tokens.shape[0], device=x.device) - starts[expert_of_row]  # (M,) rank within expert
        keep = pos < C
        slot = expert_of_row[keep] * C + pos[keep]  # (M_kept,) row in the flattened buffer
        buf = d.tokens.new_zeros(E * C, dm).index_copy(0, slot, d.tokens[keep])
        y = self.experts.padded(buf.view(E, C, dm)).reshape(E * C, -1).index_select(0, slot)  # (M_kept, d)
        kept = Dispatched(d.tokens[keep], d.source[keep], d.counts.clamp(max=C))
        return self.combine(y, kept, r.gates, x.shape[0])


def slots(d: Dispatched) -> torch.Tensor:
    """(N·k,) the row of `d.tokens` (and of the experts' output) holding each assignment n·k + j."""
    out = torch.empty_like(d.source)
    out[d.source] = torch.arange(d.source.numel(), device=d.source.device) if d.at is None else d.at
    return out
