"""Auxiliary losses of sparse MoE routers, as pure functions of router logits (no module state).

Router logits come per MoE layer either packed over real tokens, (N, E), as the encoder returns them (padding
is never routed), or padded, (B, T, E), together with an attention mask (B, T) that selects the real tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _real_tokens(logits: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(N, E) logits of real tokens from (N, E), or from (B, T, E) with a (B, T) mask."""
    if logits.dim() == 3:
        logits = logits[attention_mask.bool()] if attention_mask is not None else logits.reshape(-1, logits.shape[-1])
    return logits.float()


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor] | torch.Tensor,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    alpha: float = 1.0,
) -> torch.Tensor:
    """Load-balancing loss (nomic-embed-v2 Eq. 1, after Fedus et al. / Zoph et al.), averaged over MoE layers:

        L = α · E · Σ_i r_i · p_i

    r_i: fraction of the N·k routing assignments that go to expert i (top-k of the softmax), no gradient;
    p_i: mean router probability of expert i over the real tokens. Perfectly balanced routing gives L = α.
    """
    if isinstance(router_logits, torch.Tensor):
        router_logits = (router_logits,)
    if len(router_logits) == 0:
        return torch.zeros(())
    losses = []
    for logits in router_logits:
        logits = _real_tokens(logits, attention_mask)  # (N, E)
        N, E = logits.shape
        if N == 0:
            losses.append(logits.sum() * 0.0)
            continue
        probs = logits.softmax(-1)  # (N, E)
        chosen = probs.topk(top_k, dim=-1).indices  # (N, k)
        r = torch.zeros(E, device=logits.device).index_add_(0, chosen.flatten(), torch.ones(N * top_k, device=logits.device))
        r = r / (N * top_k)  # (E,) fractions, sum to 1
        p = probs.mean(0)  # (E,)
        losses.append(alpha * E * (r * p).sum())
    return torch.stack(losses).mean()


def router_z_loss(
    router_logits: Sequence[torch.Tensor] | torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Router z-loss (Zoph et al. 2022, ST-MoE Eq. 5): mean over tokens of (logsumexp of the logits)²,
    averaged over MoE layers. Keeps router logits small for numerical stability."""
    if isinstance(router_logits, torch.Tensor):
        router_logits = (router_logits,)
    if len(router_logits) == 0:
        return torch.zeros(())
    losses = []
    for logits in router_logits:
        logits = _real_tokens(logits, attention_mask)
        losses.append(torch.logsumexp(logits, dim=-1).square().mean() if logits.shape[0] else logits.sum() * 0.0)
    return torch.stack(losses).mean()


def router_entropy(router_logits: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean entropy (nats) of the routing distribution over real tokens, for one layer's logits."""
    logits = _real_tokens(router_logits, attention_mask)
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1).mean()
