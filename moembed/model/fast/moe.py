"""`InPlaceMoEBlock`: an MoE block whose packed or int8 experts' outputs are combined where they are written.

At CPU inference on oneDNN-packed or int8 expert weights (`fast/experts.py`) the block takes the same four steps
in fewer passes over the (N·k, d) copies: the dispatch gathers them straight into per-expert slices (padded to
`row_multiple` rows for the packed kernels), each expert writes its own output buffer, and `combine.c` sums every
token's k rows from where they are (`kernels.combine_rows`: no concatenation, no second gather, no separate
multiply-adds, the same bits); where no C compiler builds it, torch ops concatenate and `MoEBlock.combine`.
Any other call (training, a gradient, another precision) is the plain block's.
"""

from __future__ import annotations

import torch

from moembed.model import kernels
from moembed.model.fast import swapped
from moembed.model.fast.experts import Int8Experts, PackedExperts, padded_positions
from moembed.model.moe import Dispatched, MoEBlock, slots


class InPlaceMoEBlock(MoEBlock):
    """`MoEBlock` over `PackedExperts` or `Int8Experts`; `compiled`: the sums run in `combine.c` (decided at the
    swap: where it is built and the experts' settings have the compiled loops on, `Settings.compiled_loops`)."""

    compiled: bool = False

    @classmethod
    def from_plain(cls, block: MoEBlock) -> InPlaceMoEBlock:
        compiled = block.experts.settings.compiled_loops() and kernels.available("combine")
        return swapped(block, cls, compiled=compiled)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not (isinstance(self.experts, (PackedExperts, Int8Experts)) and self.experts.applies(x)):
            return super().forward(x)
        r = self.route(x)
        counts = torch.bincount(r.experts.flatten(), minlength=self.num_experts)  # (E,)
        n = x.shape[0]
        d = self.dispatch_padded(x.to(self.experts.dtype), r.experts, counts, self.experts.row_multiple)
        sizes = d.counts.tolist() if d.sizes is None else d.sizes
        parts = self.experts.parts(d.tokens, sizes)  # one (sizes[e], d) buffer per expert, or None
        bias = None if self.output_bias is None else self.output_bias.float()
        if not (n and self.compiled):  # torch ops: the buffers concatenated, then the plain combine
            out = self.combine(torch.cat([p for p in parts if p is not None] or [d.tokens[:0]]), d, r.gates, n).float()
            out = out if bias is None else out + bias
        else:
            flat = r.experts.flatten()  # (N·k,) expert of each assignment
            starts = torch.tensor([0, *sizes[:-1]], device=x.device).cumsum(0)  # (E,) first padded row per expert
            rows = slots(d) - starts[flat]  # (N·k,) row within its expert's buffer
            out = kernels.combine_rows(parts, flat, rows, r.gates.float().contiguous(), bias)  # (N, d) float32
        return out.to(x.dtype), r.logits, counts

    def dispatch_padded(self, x: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor, rows: int) -> Dispatched:
        """`dispatch` with each expert's slice padded to a multiple of `rows` in the same gather (rows 1: unpadded).
        The padding repeats token 0, whose copies there are computed and never read (a row's result does not depend
        on its neighbours)."""
        if rows == 1:
            return self.dispatch(x, experts, counts)
        source = experts.flatten().argsort(stable=True)  # (N·k,) assignment indices grouped by expert
        token = source // self.top_k  # (N·k,) token of each sorted copy
        sizes = counts.tolist()
        padded = [-(-c // rows) * rows for c in sizes]
        at = padded_positions(sizes, padded, x.device)  # (N·k,) row of each sorted copy in the padded layout
        gather = token.new_zeros(sum(padded))  # (M',) token of each padded row
        gather[at] = token
        return Dispatched(x.index_select(0, gather), source, counts, padded, at)
