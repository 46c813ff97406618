"""Routing-weight (RW) and hidden-state (HS) embeddings from a decoder's per-token outputs (MoEE §3.1, §4.3).

Conventions: batches are LEFT-padded, so the last real token of every sequence sits at position -1;
`mask` (B, T) is True at real tokens. Router logits are pre-softmax, one (B, T, E_l) tensor per MoE layer.
Everything is computed per sequence: nothing here looks across the batch (no per-batch standardisation), so an
embedding never depends on the other texts of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from moembed.errors import MoembedError

POOLINGS = ("last", "mean")
HS_LAYERS = ("last", "all")


class ExtractConfig(BaseModel):
    """How a decoder's outputs become HS and RW (MoEE §3.1; Table 5 variants). Defaults are the paper's choice."""

    model_config = ConfigDict(extra="forbid")

    rw_pooling: Literal["last", "mean"] = "last"  # RW at the last token, or mean over real tokens
    hs_pooling: Literal["last", "mean"] = "last"  # HS at the last token, or mean over real tokens ("all tokens")
    hs_layers: Literal["last", "all"] = "last"  # last layer, or the mean over all layers ("all layers")



@dataclass
class Features:
    """The two raw embeddings of n texts, float32, in input order, not normalised."""

    hs: torch.Tensor  # (n, d_HS)
    rw: torch.Tensor  # (n, d_RW) = concatenated per-layer routing distributions


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x (B, T, D) over the real tokens of each sequence → (B, D).

    Uses `where`, not multiplication, so values at padding (which may be NaN after fully masked attention)
    never leak into the mean.
    """
    keep = mask.unsqueeze(-1)  # (B, T, 1)
    total = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(1)  # (B, D)
    return total / mask.sum(1, keepdim=True).clamp(min=1).to(x.dtype)


def _pool_tokens(x: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """(B, T, D) → (B, D): the last token (left padding) or the mean over real tokens."""
    if pooling == "last":
        return x[:, -1]
    if pooling == "mean":
        return masked_mean(x, mask)
    raise MoembedError(f"pooling: unknown {pooling!r}; choose one of {', '.join(POOLINGS)}")


def routing_weights(router_logits: list[torch.Tensor], mask: torch.Tensor, pooling: str = "last") -> torch.Tensor:
    """e_RW (MoEE eq. 3): per MoE layer softmax over ALL experts of the router logits, concatenated → (B, ΣE_l).

    router_logits: one (B, T, E_l) pre-softmax tensor per MoE layer, in layer order. Each layer's block of the
    result sums to 1 (for "mean" too: a mean of distributions is a distribution).
    """
    if not router_logits:
        raise MoembedError("router_logits: the model produced none (is it a Mixture-of-Experts model?)")
    blocks = [_pool_tokens(torch.softmax(z.float(), dim=-1), mask, pooling) for z in router_logits]  # (B, E_l) each
    return torch.cat(blocks, dim=-1)


def hidden_state(hidden_states: tuple[torch.Tensor, ...], mask: torch.Tensor, pooling: str = "last",
                 layers: str = "last") -> torch.Tensor:
    """e_HS (MoEE eq. 1) → (B, d).

    hidden_states: the model's (embeddings, layer 1, ..., layer L) outputs, each (B, T, d); the last one is the
    final-norm output. pooling: "last" token or "mean" over real tokens; layers: "last" layer, or "all" = the
    mean over the L layer outputs (Table 5 "all layers": "for multi-layer or multi-token cases, mean pooling is
    applied").
    """
    if layers == "last":
        h = hidden_states[-1].float()  # (B, T, d)
    elif layers == "all":
        h = torch.stack([s.float() for s in hidden_states[1:]]).mean(0)  # (L, B, T, d) → (B, T, d)
    else:
        raise MoembedError(f"hs_layers: unknown {layers!r}; choose one of {', '.join(HS_LAYERS)}")
    return _pool_tokens(h, mask, pooling)


def packed_routing_weights(router_logits: tuple[torch.Tensor, ...], batch_index: torch.Tensor,
                           batch_size: int) -> torch.Tensor:
    """e_RW for an encoder that routes packed real tokens: per MoE layer the mean over each sequence's tokens of
    softmax(logits), concatenated → (B, ΣE_l).

    router_logits: one (N, E_l) per MoE layer over the N real tokens; batch_index (N,) maps tokens to sequences.
    """
    if not router_logits:
        raise MoembedError("model: the encoder has no MoE layers, so it has no routing weights")
    counts = torch.bincount(batch_index, minlength=batch_size).clamp(min=1).unsqueeze(-1).float()  # (B, 1)
    blocks = []
    for z in router_logits:
        p = torch.softmax(z.float(), dim=-1)  # (N, E)
        sums = p.new_zeros(batch_size, p.shape[-1]).index_add_(0, batch_index, p)  # (B, E)
        blocks.append(sums / counts)
    return torch.cat(blocks, dim=-1)
