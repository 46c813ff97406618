"""The experts of an MoE block: E MLPs with stacked weights, each run on its slice of the tokens.

`Experts` holds fc1/fc2 weights (and biases) stacked on a leading E axis, each slice laid out as the dense MLP it
was upcycled from. Given tokens already sorted by expert (`moembed.model.moe`'s `dispatch`) and the count per
expert, `forward` runs each expert on its contiguous slice, in a loop over the experts (any device, any dtype):
the reference. Faster ways to run the same experts — grouped matmuls, oneDNN-packed or int8 weights — are
subclasses a backend swaps in (`moembed.model.fast.experts`); every one gives the same result up to rounding.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moembed.model.activations import MLP_ACTIVATIONS
from moembed.model.recompute import then_recomputed
from moembed.model.settings import UsesSettings


class Experts(UsesSettings, nn.Module):
    """E MLPs of one kind (GELU or SwiGLU, as the dense MLP they replace), weights stacked on a leading E axis.

    fc1_weight (E, r, d) with r = i (GELU) or 2i (SwiGLU: rows [:i] up, [i:] gate), fc2_weight (E, d, i),
    optional biases fc1_bias (E, r), fc2_bias (E, d). Each slice [e] has the layout of the dense MLP's
    `fc1.weight` / `fc2.weight`, so upcycling is a broadcast copy.
    """

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

    def biases(self, e: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Expert e's fc1 and fc2 biases (None where the experts have none)."""
        return (None if self.fc1_bias is None else self.fc1_bias[e]), (None if self.fc2_bias is None else self.fc2_bias[e])

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on tokens x (n, d) → (n, d)."""
        b1, b2 = self.biases(e)
        h = F.linear(x, self.fc1_weight[e], b1)
        return then_recomputed(self.act, h, lambda a: F.linear(a, self.fc2_weight[e], b2), self.recompute_act)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, d) sorted by expert with counts (E,) → (M, d): a loop over experts on contiguous slices."""
        parts = torch.split(x, counts.tolist())
        return torch.cat([self.expert(e, p) for e, p in enumerate(parts) if p.shape[0]] or [x[:0]])

    def padded(self, buf: torch.Tensor) -> torch.Tensor:
        """Fixed-shape batched experts (`MoEConfig.capacity_factor`): buf (E, C, d) → (E, C, d)."""
        h = torch.bmm(buf, self.fc1_weight.transpose(1, 2))  # (E, C, r)
        if self.fc1_bias is not None:
            h = h + self.fc1_bias[:, None, :]
        y = torch.bmm(self.act(h), self.fc2_weight.transpose(1, 2))  # (E, C, d)
        if self.fc2_bias is not None:
            y = y + self.fc2_bias[:, None, :]
        return y
