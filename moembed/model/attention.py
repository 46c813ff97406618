"""Multi-head self-attention of the encoder, plain torch: one forward for training and reference inference.

    core = Attention(num_heads=12, head_dim=32, dropout=0.1)   # no parameters: the projections are the layer's
    out = core(qkv, ctx)   # qkv (N, 3·H·hd) packed real tokens → (N, H·hd)

softmax(q kᵀ / √hd + mask) v (Vaswani et al. 2017, Eq. 1) over the padded (B, H, T, hd) layout, with rotary
positions where the model has them (Su et al. 2021, RoFormer; nomic-bert). The fast CPU inference kernel is a
module of its own, swapped in when a model is loaded (`moembed.model.fast.attention.CompiledAttention`).

**Precision.** On a CPU without AMX, torch's fused (flash) attention kernel trains several times slower in
bfloat16 than in float32 at the lengths embedding models see (`benchmarks/attention.py`; BENCHMARKS.md). So there a
bf16 call in training casts q, k and v to float32, runs the kernel in float32 (outside autocast, which would cast
them back) and casts the output to bf16: the casts move (B, H, T, hd) values, the kernel's work is (B, H, T, T).
The result is also the more precise (float32 scores and softmax). Inference keeps bf16: there the casts cost more
than they save. Where bf16 attention has hardware of its own (AMX tiles, GPUs) the input's dtype is kept
(`Settings.upcast_attention`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from moembed.errors import MoembedError
from moembed.model.rope import apply_rope
from moembed.model.settings import Settings, UsesSettings


class Layout(Protocol):
    """The per-forward layout attention reads (the encoder's `_Context`)."""

    shape: tuple[int, int]  # (B, T) of the padded batch
    attn_mask: torch.Tensor | None  # (B, 1, 1, T) bool, True = attend; None when nothing is padded
    cos: torch.Tensor | None  # rotary tables (T, hd) or (B, 1, T, hd) float32; None without rotary positions
    sin: torch.Tensor | None
    lengths: torch.Tensor | None  # (B,) real tokens per sequence where they come first (right padding), else None
    starts: torch.Tensor  # (B,) each sequence's first packed row (where `lengths` is given)

    def pad_keys(self, x: torch.Tensor) -> torch.Tensor: ...  # (N, c) → (B, T, c)

    def unpad(self, x: torch.Tensor) -> torch.Tensor: ...  # (B, T, c) → (N, c)


def compute_dtype(q: torch.Tensor, training: bool = False, settings: Settings = Settings()) -> torch.dtype:
    """The dtype attention over `q` runs in: float32 for a bf16 `q` in training (`training`: the module is in train
    mode, which includes GradCache's no-grad first pass, so that its replay computes the same values) or recorded by
    autograd, on a CPU where `settings.upcast_attention()` (no AMX); else q's own."""
    upcast = (q.dtype == torch.bfloat16 and q.device.type == "cpu" and (training or q.requires_grad)
              and settings.upcast_attention())
    return torch.float32 if upcast else q.dtype


def attention_in(dtype: torch.dtype, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 dropout_p: float = 0.0) -> torch.Tensor:
    """The fused kernel run in `dtype` (outside autocast, which would cast the inputs back), its output in q's dtype."""
    if dtype == q.dtype:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    with torch.autocast(q.device.type, enabled=False):
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask,
                                             dropout_p=dropout_p)
    return out.to(q.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float = 0.0,
           training: bool = False, settings: Settings = Settings()) -> torch.Tensor:
    """softmax(q kᵀ / √hd + mask) v for q, k, v (B, H, T, hd), mask (B, 1, 1, T) bool (True = attend) or None; the
    output (B, H, T, hd) in q's dtype, computed in `compute_dtype(q, training, settings)`. `training`: the calling
    module's mode; `settings`: its settings."""
    return attention_in(compute_dtype(q, training, settings), q, k, v, mask, dropout_p)


class Attention(UsesSettings, nn.Module):
    """Self-attention of packed rows: qkv (N, 3·H·hd), the fused q, k, v projections of the real tokens → (N, H·hd).

    Pads to (B, T) with copies of real rows (`Layout.pad_keys`; the mask weighs them 0), applies the rotary
    positions, runs `attend` (dropout `dropout` in training only) and drops the padded rows again. No parameters:
    swapping it for a subclass (a backend) leaves the state dict as it is."""

    def __init__(self, num_heads: int, head_dim: int, dropout: float = 0.0):
        super().__init__()
        if num_heads < 1 or head_dim < 1 or not 0.0 <= dropout < 1.0:
            raise MoembedError(f"Attention: expected num_heads >= 1, head_dim >= 1 and 0 <= dropout < 1, got "
                               f"num_heads {num_heads}, head_dim {head_dim}, dropout {dropout}")
        self.num_heads, self.head_dim, self.dropout = num_heads, head_dim, dropout

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, dropout={self.dropout}"

    def heads(self, qkv: torch.Tensor, ctx: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (B, H, T, hd) of the packed rows qkv (N, 3·H·hd): views of one padded buffer, q and k rotated
        where the model has rotary positions."""
        B, T = ctx.shape
        padded = ctx.pad_keys(qkv)  # (B, T, 3·H·hd)
        q, k, v = padded.view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
        if ctx.cos is not None:
            cos, sin = ctx.cos.to(q.dtype), ctx.sin.to(q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def merge(self, a: torch.Tensor, ctx: Layout) -> torch.Tensor:
        """(B, H, T, hd) → (N, H·hd), the real tokens' rows."""
        B, T = ctx.shape
        return ctx.unpad(a.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def forward(self, qkv: torch.Tensor, ctx: Layout) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        q, k, v = self.heads(qkv, ctx)  # each (B, H, T, hd)
        return self.merge(attend(q, k, v, ctx.attn_mask, p, self.training, self.settings), ctx)  # (N, H·hd)
