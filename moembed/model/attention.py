"""Scaled dot-product attention over the padded (B, H, T, hd) layout, in the precision that trains fastest here.

    out, dtype = attend(q, k, v, mask, dropout_p)   # out in q's dtype; dtype: what the kernel computed in

On a CPU without AMX, torch's fused (flash) attention kernel trains 2.2-3x slower in bfloat16 than in float32 at the
lengths embedding models see: on an AVX-512 BF16 EPYC (Zen 5), 12 heads of 32, forward and backward of B = 64, T =
64 took 52 ms in bf16 against 17 ms in float32 with the casts (`benchmarks/attention.py`; BENCHMARKS.md, "Attention
in float32 when training in bf16"); its bf16 backward was a quarter of a bf16 finetuning step. So there a bf16 call
in training casts q, k and v to float32, runs the kernel in float32 (outside autocast, which would cast
them back) and casts the output to bf16: the casts move (B, H, T, hd) values, the kernel's work is (B, H, T, T). The
result is also the more precise (float32 scores and softmax). Inference keeps bf16: there the casts cost more than
they save (`precision.py`: bf16 encode at 1.45-1.46x float32 with them against 1.56-1.58x without). Where bf16
attention has hardware of its own (AMX tiles, GPUs) the input's dtype is kept; MOEMBED_NO_FASTPATH=1 keeps it
everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moembed.model.linear import cpu_flags, fastpaths_off

def _upcast_pays() -> bool:
    """Not on AMX CPUs, whose tiles run bf16 attention natively (not measured here: bf16 is kept there)."""
    return not cpu_flags().get("amx_bf16", False)


_UPCAST_PAYS = _upcast_pays()


def compute_dtype(q: torch.Tensor, training: bool = False) -> torch.dtype:
    """The dtype attention over `q` runs in: float32 for a bf16 `q` in training (`training`: the module is in train
    mode, which includes GradCache's no-grad first pass, so that its replay computes the same values) or recorded by
    autograd, on a CPU without AMX (unless MOEMBED_NO_FASTPATH=1); else q's own."""
    upcast = (q.dtype == torch.bfloat16 and q.device.type == "cpu" and (training or q.requires_grad)
              and _UPCAST_PAYS and not fastpaths_off())
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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           dropout_p: float = 0.0, training: bool = False) -> tuple[torch.Tensor, torch.dtype]:
    """softmax(q kᵀ / √hd + mask) v for q, k, v (B, H, T, hd), mask (B, 1, 1, T) bool (True = attend) or None;
    (output (B, H, T, hd) in q's dtype, the dtype the kernel ran in). `training`: the calling module's mode."""
    dtype = compute_dtype(q, training)
    return attention_in(dtype, q, k, v, mask, dropout_p), dtype
