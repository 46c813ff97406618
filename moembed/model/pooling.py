"""Pooling of token states into one vector, Matryoshka truncation, and output precisions.

Pooling works on the encoder's packed real tokens (see encoder.py), so padding never enters a mean.
Precisions (arctic-embed-2 §2.5): int8 scalar quantisation with per-dimension ranges taken from calibration
embeddings, and binary (sign bits packed eight to a byte).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from moembed.errors import MoembedError

Pooling = Literal["mean", "cls", "last"]
Precision = Literal["float32", "int8", "binary"]
POOLINGS = ("mean", "cls", "last")
PRECISIONS = ("float32", "int8", "binary")


def pool(packed: torch.Tensor, batch_index: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool packed token states (N, d) into sequence vectors (B, d).

    batch_index (N,) gives each token's sequence; lengths (B,) the real tokens per sequence (tokens of a
    sequence are contiguous and in order in the packed layout).
    """
    B = lengths.shape[0]
    if mode == "mean":
        sums = packed.new_zeros(B, packed.shape[-1]).index_add_(0, batch_index, packed)  # (B, d)
        return sums / lengths.clamp(min=1).unsqueeze(-1).to(packed.dtype)
    ends = torch.cumsum(lengths, 0)  # (B,) one past each sequence's last packed token
    if mode == "cls":
        return packed.index_select(0, ends - lengths)
    if mode == "last":
        return packed.index_select(0, ends - 1)
    raise MoembedError(f"pooling: unknown mode {mode!r}; choose one of {', '.join(POOLINGS)}")


def truncate(emb: torch.Tensor, dim: int | None, normalize: bool = True) -> torch.Tensor:
    """Matryoshka truncation (Kusupati et al.): keep the first `dim` components, then L2-normalise."""
    if dim is not None:
        if not 1 <= dim <= emb.shape[-1]:
            raise MoembedError(f"dim: {dim} is out of range 1..{emb.shape[-1]}")
        emb = emb[..., :dim]
    return F.normalize(emb, dim=-1) if normalize else emb


def int8_ranges(calibration: np.ndarray) -> np.ndarray:
    """Per-dimension (low, high) ranges (2, d) from calibration embeddings (n, d)."""
    return np.stack([calibration.min(0), calibration.max(0)]).astype(np.float32)


def quantize_int8(x: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """Scalar quantisation: map [low, high] of each dimension linearly onto int8 [-128, 127], clipping outside."""
    lo, hi = ranges
    scale = np.where(hi > lo, hi - lo, 1.0)
    q = np.rint((x - lo) / scale * 255.0) - 128.0
    return np.clip(q, -128, 127).astype(np.int8)


def dequantize_int8(q: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    lo, hi = ranges
    scale = np.where(hi > lo, hi - lo, 1.0)
    return ((q.astype(np.float32) + 128.0) / 255.0 * scale + lo).astype(np.float32)


def binarize(x: np.ndarray) -> np.ndarray:
    """Sign bits (x > 0) packed eight to a byte: (n, d) float → (n, ceil(d / 8)) uint8."""
    return np.packbits(x > 0, axis=-1)


def unpack_binary(b: np.ndarray, dim: int) -> np.ndarray:
    """(n, ceil(d / 8)) uint8 → (n, d) float32 in {-1, +1}."""
    return np.unpackbits(b, axis=-1, count=dim).astype(np.float32) * 2.0 - 1.0
