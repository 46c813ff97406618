"""Compiled attention for CPU inference: `attention.c` as a module swapped for the plain `Attention` at load.

    n = use_compiled(model, True)     # every Attention of `model` becomes a CompiledAttention (False: back)
    core = CompiledAttention.from_plain(layer.core); plain = core.to_plain()

torch's CPU flash kernel runs far below the linear layers' rate at an encoder's shapes (12 heads of 32, T <= 128).
`attention.c` (`moembed.model.kernels`) holds tiles of eight queries by 32 keys in registers and computes each
sequence against its own real keys only, in float32 (bf16 inputs widened as they are loaded, so bf16 inference gets
float32 scores too): softmax(q kᵀ / √hd) v of Vaswani et al. 2017, Eq. 1. Without rotary positions it reads the
encoder's packed rows and writes them (`packed_attention`: no padding on either side); with them, q and k are
rotated on the padded (B, H, T, hd) layout first (`compiled_attention`). `moembed.model.backends` swaps it in
where the backend's record says attention is "compiled" (`Settings.compiled_attention`, by default where torch runs
AVX-512 kernels). A call the kernel does not take (training, gradients, dropout, another dtype or device, heads
other than 32 or 64, longer sequences, left padding, the kernel not built) runs the plain forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from moembed.model import kernels
from moembed.model.attention import Attention, Layout
from moembed.model.fast import plain, swap, swapped

COMPILED_HEAD_DIMS = kernels.HEAD_DIMS  # what attention.c is specialised for
COMPILED_MAX_LENGTH = kernels.MAX_LENGTH  # its longest sequence (its score rows live on the stack)


def compiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`kernels.attention` of q, k, v (B, H, T, hd) over each sequence's first `lengths` (B,) keys; (B, H, T, hd) in
    q's dtype, zero at padded query rows."""
    return kernels.attention(q, k, v, lengths.to(torch.int64).contiguous())


def packed_attention(qkv: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, heads: int) -> torch.Tensor:
    """`kernels.packed_attention` on the packed rows qkv (N, 3·H·hd) of sequences laid one after another; (N, H·hd)."""
    return kernels.packed_attention(qkv.contiguous(), starts, lengths, heads)


class CompiledAttention(Attention):
    """`Attention` whose CPU inference calls run `attention.c`; every other call runs the plain forward."""

    @classmethod
    def from_plain(cls, core: Attention) -> CompiledAttention:
        """A compiled module of `core`'s heads, dropout, mode and settings (no weights to copy)."""
        return swapped(core, cls)

    def to_plain(self) -> Attention:
        """The plain module of the same heads, dropout, mode and settings."""
        return plain(self)

    def applies(self, qkv: torch.Tensor, ctx: Layout) -> bool:
        """Whether the kernel takes this call: CPU inference (no gradient, eval mode, so no dropout) on float32 or
        bf16 rows, heads of 32 or 64, at most `COMPILED_MAX_LENGTH` positions, right padding (`ctx.lengths`), and
        the kernel built here."""
        return (
            qkv.device.type == "cpu" and qkv.dtype in (torch.float32, torch.bfloat16) and not self.training
            and not torch.is_grad_enabled() and self.head_dim in COMPILED_HEAD_DIMS
            and ctx.shape[1] <= COMPILED_MAX_LENGTH and ctx.lengths is not None and kernels.available("attention")
        )

    def forward(self, qkv: torch.Tensor, ctx: Layout) -> torch.Tensor:
        if not self.applies(qkv, ctx):
            return super().forward(qkv, ctx)
        if ctx.cos is None:  # the packed rows in and out, no padding either side
            return packed_attention(qkv, ctx.starts, ctx.lengths, self.num_heads)  # (N, H·hd)
        q, k, v = self.heads(qkv, ctx)  # each (B, H, T, hd), q and k rotated
        return self.merge(compiled_attention(q, k, v, ctx.lengths), ctx)  # (N, H·hd)


def use_compiled(model: nn.Module, on: bool) -> int:
    """Swap every plain `Attention` inside `model` for a `CompiledAttention` (`on`), or every compiled one back to
    plain; returns how many were swapped. The state dict does not change (neither has parameters)."""
    swapped = []

    def choose(m: nn.Module) -> nn.Module | None:
        if type(m) is Attention if on else isinstance(m, CompiledAttention):
            swapped.append(m)
            return CompiledAttention.from_plain(m) if on else m.to_plain()
        return None

    swap(model, choose)
    return len(swapped)
