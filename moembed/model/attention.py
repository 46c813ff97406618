"""Scaled dot-product attention over the padded (B, H, T, hd) layout, in the precision and kernel fastest here.

    out, dtype, kernel = attend(q, k, v, mask, dropout_p, training, lengths, settings)
    # out in q's dtype; dtype: what the kernel computed in; kernel: "compiled" or "torch"

On a CPU without AMX, torch's fused (flash) attention kernel trains several times slower in bfloat16 than in
float32 at the lengths embedding models see (`benchmarks/attention.py`; BENCHMARKS.md). So there a bf16 call in
training casts q, k and v to float32, runs the kernel in float32 (outside autocast, which would cast them back) and
casts the output to bf16: the casts move (B, H, T, hd) values, the kernel's work is (B, H, T, T). The result is also
the more precise (float32 scores and softmax). Inference keeps bf16: there the casts cost more than they save.
Where bf16 attention has hardware of its own (AMX tiles, GPUs) the input's dtype is kept
(`Settings.upcast_attention`).

**Compiled attention for CPU inference.** torch's CPU flash kernel runs far below the linear layers' rate at an
encoder's shapes (12 heads of 32, T <= 128). An inference call (no gradient, eval mode, no dropout) in float32 or
bf16 on right-padded sequences with heads of 32 or 64 runs `attention.c` instead (`moembed.model.kernels`),
where `Settings.compiled_attention` (by default where torch runs AVX-512 kernels) and a C compiler builds it.
Tiles of eight queries by 32 keys are held in registers, each sequence is computed against its own real keys only,
in float32 (bf16 inputs widened as they are loaded, so bf16 inference gets float32 scores too). `packed_attention`
reads the encoder's packed rows and writes them (no padding on either side); `attend(..., lengths=)` takes the
padded layout (models with rotary positions, which are applied there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moembed.model import kernels
from moembed.model.settings import Settings

COMPILED_HEAD_DIMS = kernels.HEAD_DIMS  # what attention.c is specialised for
COMPILED_MAX_LENGTH = kernels.MAX_LENGTH  # its longest sequence (its score rows live on the stack)


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


def compiled_applies(x: torch.Tensor, head_dim: int, length: int, dropout_p: float, training: bool,
                     settings: Settings = Settings()) -> bool:
    """Whether the compiled kernel takes attention over `x` (q, or the q/k/v projection): a CPU inference call (no
    gradient, not training, no dropout) in float32 or bf16, heads of 32 or 64, sequences of at most
    `COMPILED_MAX_LENGTH` tokens (`length`: the longest), `settings.compiled_attention()`, and the kernel built."""
    return (
        x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and not training and dropout_p == 0.0
        and not torch.is_grad_enabled() and head_dim in COMPILED_HEAD_DIMS and length <= COMPILED_MAX_LENGTH
        and settings.compiled_attention() and kernels.available("attention")
    )


def compiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`kernels.attention` of q, k, v (B, H, T, hd) over each sequence's first `lengths` (B,) keys; (B, H, T, hd) in
    q's dtype, zero at padded query rows."""
    return kernels.attention(q, k, v, lengths.to(torch.int64).contiguous())


def packed_attention(qkv: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, heads: int) -> torch.Tensor:
    """`kernels.packed_attention` on the packed rows qkv (N, 3·H·hd) of sequences laid one after another; (N, H·hd)."""
    return kernels.packed_attention(qkv.contiguous(), starts, lengths, heads)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           dropout_p: float = 0.0, training: bool = False, lengths: torch.Tensor | None = None,
           settings: Settings = Settings()) -> tuple[torch.Tensor, torch.dtype, str]:
    """softmax(q kᵀ / √hd + mask) v for q, k, v (B, H, T, hd), mask (B, 1, 1, T) bool (True = attend) or None;
    (output (B, H, T, hd) in q's dtype, the dtype the kernel ran in, "compiled" or "torch"). `training`: the
    calling module's mode. `lengths` (B,): given when every sequence's real tokens are its first ones (mask the
    prefix of that length), which lets `compiled_attention` run; the rows past a length are then zero, where
    torch's kernel leaves the attention of padded queries (which no caller reads). `settings`: the calling layer's."""
    if (lengths is not None and compiled_applies(q, q.shape[-1], q.shape[2], dropout_p, training, settings)
            and q.dtype == k.dtype == v.dtype and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
        return compiled_attention(q, k, v, lengths), torch.float32, "compiled"
    dtype = compute_dtype(q, training, settings)
    return attention_in(dtype, q, k, v, mask, dropout_p), dtype, "torch"
