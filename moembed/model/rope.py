"""Rotary position embeddings with Dynamic NTK scaling.

RoPE (Su et al.) rotates each pair of query/key channels by a position-dependent angle θ_j·t with
θ_j = b^(-2j/D). We use the "rotate half" layout (channel j pairs with j + D/2), as nomic-bert does.

Dynamic NTK (nomic-embed-v1 Eq. 5): for a sequence of length l longer than the trained length L, the base is
    b' = b · ((α·s) − (α − 1))^(D / (D − 2)),   s = l / L,
and left unchanged for l ≤ L, so short inputs see exactly the trained positions.

l is the sequence's own number of real tokens, never the padded length of its batch: otherwise a short text
batched with a long one would be encoded with the long one's base, and its embedding would depend on the batch.
`batch_cos_sin` builds the tables per sequence, grouped by regime (one table for every sequence of at most L
tokens, one per distinct longer length).
"""

from __future__ import annotations

import torch


def ntk_base(base: float, head_dim: int, seq_len: int, trained_len: int, alpha: float) -> float:
    """The Dynamic NTK-scaled base of Eq. 5 (identity when seq_len <= trained_len)."""
    if seq_len <= trained_len:
        return base
    s = seq_len / trained_len
    return base * ((alpha * s) - (alpha - 1)) ** (head_dim / (head_dim - 2))


def rope_cos_sin(seq_len: int, head_dim: int, base: float, device=None, dtype=torch.float32):
    """cos and sin tables, each (seq_len, head_dim), for the rotate-half layout."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def batch_cos_sin(lengths: torch.Tensor, seq_len: int, head_dim: int, base: float, trained_len: int, alpha: float,
                  dtype=torch.float32):
    """Dynamic NTK tables for a padded batch whose sequence b has `lengths[b]` real tokens.

    Returns cos, sin of shape (seq_len, head_dim) when every sequence is within the trained length (one shared
    table, the plain base), else (B, 1, seq_len, head_dim): each sequence with the base of its own length.
    """
    long = lengths > trained_len  # (B,)
    if not bool(long.any()):
        return rope_cos_sin(seq_len, head_dim, base, device=lengths.device, dtype=dtype)
    # Group by regime: 0 stands for "within the trained length" (plain base); longer sequences by their length.
    key = torch.where(long, lengths, torch.zeros_like(lengths))  # (B,)
    distinct, group = torch.unique(key, return_inverse=True)  # (G,), (B,)
    tables = [
        rope_cos_sin(seq_len, head_dim, ntk_base(base, head_dim, int(l), trained_len, alpha) if l else base,
                     device=lengths.device, dtype=dtype)
        for l in distinct.tolist()
    ]
    cos = torch.stack([c for c, _ in tables]).index_select(0, group)  # (B, T, D)
    sin = torch.stack([s for _, s in tables]).index_select(0, group)  # (B, T, D)
    return cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D): broadcast over heads


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by tables cos/sin (T, D), or per sequence (B, 1, T, D)."""
    return x * cos + rotate_half(x) * sin
