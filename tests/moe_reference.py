"""The MoE block as the papers write it, for parity tests: y_n = Σ_j g_nj · E_{e_nj}(x_n) (+ b), one boolean mask
per expert over all tokens (nomic-embed-v2 §3.2; Shazeer et al. 2017)."""

from __future__ import annotations

import torch
import torch.nn as nn

from moembed.model.fast import swap, swapped
from moembed.model.moe import MoEBlock


class ReferenceMoE(MoEBlock):
    def forward(self, x: torch.Tensor):
        r = self.route(x)
        counts = torch.bincount(r.experts.flatten(), minlength=self.num_experts)  # (E,)
        out = x.new_zeros(x.shape)  # (N, d)
        for e in range(self.num_experts):
            tok, slot = (r.experts == e).nonzero(as_tuple=True)  # (n_e,) each
            if tok.numel():
                y = self.experts.expert(e, x.index_select(0, tok)) * r.gates[tok, slot, None]  # (n_e, d)
                out = out.index_add(0, tok, y.to(out.dtype))
        if self.output_bias is not None:
            out = out + self.output_bias.to(out.dtype)
        return out.to(x.dtype), r.logits, counts


def use_reference(model: nn.Module) -> nn.Module:
    """Every MoE block of `model` computed by `ReferenceMoE` (its experts run one by one, whatever their class)."""
    return swap(model, lambda m: swapped(m, ReferenceMoE) if isinstance(m, MoEBlock) else None)


def use_blocks(model: nn.Module) -> nn.Module:
    """Every MoE block of `model` back to the plain `MoEBlock`."""
    return swap(model, lambda m: swapped(m, MoEBlock) if type(m) is ReferenceMoE else None)
