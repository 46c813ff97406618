"""Pooling of token states into one vector, Matryoshka truncation, and output precisions.

Pooling works on the encoder's packed real tokens (see encoder.py), so padding never enters a mean. The modes
are sentence-transformers' Pooling modes (its names in `ST_POOLING`), computed over the same tokens:
- "mean": the average of a text's token states (sentence-transformers' default, and moembed's);
- "cls": the first token's state; "last": the last real token's (sentence-transformers' "lasttoken");
- "max": the per-dimension maximum over the tokens;
- "mean_sqrt_len": the sum divided by the square root of the number of tokens ("mean_sqrt_len_tokens");
- "weightedmean": the average weighted by position, token t (counted from 1) weighing t (SGPT, Muennighoff 2022).
Precisions (arctic-embed-2 §2.5), named and computed as sentence-transformers' `quantize_embeddings` does:
- "int8" / "uint8": scalar quantisation, per dimension, of [low, high] (taken from calibration embeddings) into
  256 buckets of width step = (high − low) / 255: code = clip(floor((x − low) / step), 0, 255), minus 128 for
  int8. Values outside the calibration range are clipped to the end buckets.
- "binary" / "ubinary": sign bits (x > 0) packed eight to a byte, big-endian; "ubinary" keeps the bytes as uint8,
  "binary" shifts them by −128 into int8. Both hold the same bits: Hamming distances are equal.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from moembed.errors import MoembedError

Pooling = Literal["mean", "cls", "last", "max", "mean_sqrt_len", "weightedmean"]
Precision = Literal["float32", "int8", "uint8", "binary", "ubinary"]
POOLINGS = ("mean", "cls", "last", "max", "mean_sqrt_len", "weightedmean")
# sentence-transformers' name of each mode (its `pooling_mode` string) → moembed's
ST_POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last", "max": "max",
              "mean_sqrt_len_tokens": "mean_sqrt_len", "weightedmean": "weightedmean"}
PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")
SCALAR = ("int8", "uint8")  # precisions that need calibration ranges


def pool(packed: torch.Tensor, batch_index: torch.Tensor, lengths: torch.Tensor, mode: str,
         skip: torch.Tensor | None = None) -> torch.Tensor:
    """Pool packed token states (N, d) into sequence vectors (B, d).

    batch_index (N,) gives each token's sequence; lengths (B,) the real tokens per sequence (tokens of a
    sequence are contiguous and in order in the packed layout). skip (B,): leading positions of each sequence
    left out, its prompt's (`moembed.model.prompts`), as sentence-transformers' `include_prompt: false` masks
    them: "cls" takes the first token after the prompt, "last" is unchanged, weightedmean's weights stay the
    positions in the whole sequence.
    """
    if skip is not None:
        return _pool_after(packed, batch_index, lengths, mode, skip.to(lengths.device))
    B, d = lengths.shape[0], packed.shape[-1]
    counts = lengths.clamp(min=1).unsqueeze(-1).to(packed.dtype)  # (B, 1)
    if mode in ("mean", "mean_sqrt_len"):
        sums = packed.new_zeros(B, d).index_add_(0, batch_index, packed)  # (B, d)
        return sums / (counts if mode == "mean" else counts.sqrt())
    ends = torch.cumsum(lengths, 0)  # (B,) one past each sequence's last packed token
    if mode == "cls":
        return packed.index_select(0, ends - lengths)
    if mode == "last":
        return packed.index_select(0, ends - 1)
    if mode == "max":
        out = packed.new_full((B, d), float("-inf"))
        return out.scatter_reduce_(0, batch_index.unsqueeze(-1).expand(-1, d), packed, "amax")  # (B, d)
    if mode == "weightedmean":
        starts = (ends - lengths).index_select(0, batch_index)  # (N,) each token's sequence start
        w = (torch.arange(packed.shape[0], device=packed.device) - starts + 1).to(packed.dtype)  # (N,) 1, 2, ...
        sums = packed.new_zeros(B, d).index_add_(0, batch_index, packed * w.unsqueeze(-1))  # (B, d)
        return sums / packed.new_zeros(B).index_add_(0, batch_index, w).clamp(min=1).unsqueeze(-1)
    raise MoembedError(f"pooling: unknown mode {mode!r}; choose one of {', '.join(POOLINGS)}")


def _pool_after(packed: torch.Tensor, batch_index: torch.Tensor, lengths: torch.Tensor, mode: str,
                skip: torch.Tensor) -> torch.Tensor:
    """`pool` of the tokens at positions >= skip (B,) of each sequence (a prompt's tokens left out)."""
    B, d = lengths.shape[0], packed.shape[-1]
    ends = torch.cumsum(lengths, 0)  # (B,)
    starts = ends - lengths  # (B,)
    if mode == "cls":  # the first token after the prompt; the first of all when nothing follows it
        return packed.index_select(0, starts + torch.where(lengths > skip, skip, 0))
    if mode == "last":
        return packed.index_select(0, ends - 1)
    pos = torch.arange(packed.shape[0], device=packed.device) - starts.index_select(0, batch_index)  # (N,) 0, 1, ...
    keep = pos >= skip.index_select(0, batch_index)  # (N,)
    x, seq = packed[keep], batch_index[keep]  # (M, d), (M,)
    if mode == "max":
        out = packed.new_full((B, d), float("-inf"))
        return out.scatter_reduce_(0, seq.unsqueeze(-1).expand(-1, d), x, "amax")  # (B, d)
    if mode == "weightedmean":
        w = (pos[keep] + 1).to(packed.dtype)  # (M,) positions in the whole sequence, from 1
    elif mode in ("mean", "mean_sqrt_len"):
        w = packed.new_ones(x.shape[0])  # (M,)
    else:
        raise MoembedError(f"pooling: unknown mode {mode!r}; choose one of {', '.join(POOLINGS)}")
    sums = packed.new_zeros(B, d).index_add_(0, seq, x * w.unsqueeze(-1))  # (B, d)
    total = packed.new_zeros(B).index_add_(0, seq, w).clamp(min=1).unsqueeze(-1)  # (B, 1)
    return sums / (total.sqrt() if mode == "mean_sqrt_len" else total)


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


def _steps(ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low (d,), step (d,)) float32 of the 256 buckets spanning each dimension's range (a flat range: step 1)."""
    ranges = ranges.astype(np.float32, copy=False)
    lo = ranges[0]
    step = (ranges[1] - lo) / 255
    return lo, np.where(step == 0, 1, step).astype(np.float32)


def quantize_scalar(x: np.ndarray, ranges: np.ndarray, precision: str = "int8") -> np.ndarray:
    """Bucket codes of float embeddings (n, d): uint8 in [0, 255], or int8 in [-128, 127] (code − 128)."""
    lo, step = _steps(ranges)
    q = np.clip(np.floor((x.astype(np.float32, copy=False) - lo) / step), 0, 255)
    return (q - 128).astype(np.int8) if precision == "int8" else q.astype(np.uint8)


def dequantize_scalar(q: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """Codes (int8 or uint8) → float32 at the centre of each bucket."""
    lo, step = _steps(ranges)
    code = q.astype(np.float32) + (128.0 if q.dtype == np.int8 else 0.0)
    return ((code + 0.5) * step + lo).astype(np.float32)


def pack_bits(x: np.ndarray, precision: str = "ubinary") -> np.ndarray:
    """Sign bits (x > 0) packed eight to a byte: (n, d) float → (n, ceil(d / 8)) uint8 ("ubinary"), or the same
    bytes − 128 as int8 ("binary")."""
    packed = np.packbits(x > 0, axis=-1)
    return (packed.astype(np.int16) - 128).astype(np.int8) if precision == "binary" else packed


def unpack_bits(b: np.ndarray, dim: int) -> np.ndarray:
    """Packed sign bits, int8 ("binary") or uint8 ("ubinary"), (n, ceil(d / 8)) → (n, d) float32 in {-1, +1}."""
    if b.dtype == np.int8:
        b = (b.astype(np.int16) + 128).astype(np.uint8)
    return np.unpackbits(b, axis=-1, count=dim).astype(np.float32) * 2.0 - 1.0
