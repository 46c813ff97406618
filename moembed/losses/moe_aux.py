"""Auxiliary losses of sparse MoE routers, as pure functions of router logits (no module state).

Router logits come per MoE layer either packed over real tokens, (N, E), as the encoder returns them (padding
is never routed), or padded, (B, T, E), together with an attention mask (B, T) that selects the real tokens
(`moembed.model.utilisation.real_token_logits`). The router entropy, a statistic rather than a loss, is
`moembed.model.utilisation.router_entropy`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moembed.model.utilisation import real_token_logits


def routing_fractions(counts: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    """Per-layer routing-assignment counts → fractions r (the r_i of nomic-embed-v2 Eq. 1), float32, no gradient.

    counts: one (E,) per MoE layer, or a stacked (L, E): assignments per expert, e.g. `EncoderOutput.expert_counts`
    summed over passes, chunks or ranks. Each layer's fractions sum to 1 (zeros for a layer without assignments).
    """
    return [c.detach().float() / c.sum().clamp(min=1) for c in counts]  # (E,) each


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor] | torch.Tensor,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    alpha: float = 1.0,
    fractions: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Load-balancing loss (nomic-embed-v2 Eq. 1, after Fedus et al. / Zoph et al.), averaged over MoE layers:

        L = α · E · Σ_i r_i · p_i

    r_i: fraction of the N·k routing assignments that go to expert i (top-k of the softmax), no gradient;
    p_i: mean router probability of expert i over the real tokens. Perfectly balanced routing gives L = α.

    `fractions` (one (E,) per layer, e.g. from `routing_fractions`) replaces r by precomputed fractions, typically
    of a larger token set than these logits: the whole batch of a GradCache step, or all data-parallel ranks.
    p stays the mean over these logits' tokens. Without it, r is counted from these logits.

    Global r, local p. With r of all ranks' N = Σ_ρ N_ρ tokens, rank ρ's loss is L_ρ = α·E·Σ_i r_i·p_i^ρ, and
    p_i^global = Σ_ρ (N_ρ / N)·p_i^ρ, so for each layer

        Σ_ρ (N_ρ / N) · L_ρ = α·E·Σ_i r_i·p_i^global,

    the loss of the whole batch (and, r being constant, its gradient). With W ranks that is the mean over ranks
    of W·N_ρ/N · L_ρ; with equal token counts the weights are 1 and the plain mean of the per-rank losses is the
    global loss. With unequal counts the plain mean is α·E·Σ_i r_i·(1/W)·Σ_ρ p_i^ρ, which over-weights the
    probabilities of ranks with fewer tokens; `moembed.train.step` applies the weight W·N_ρ/N (`global_routing`).
    """
    if isinstance(router_logits, torch.Tensor):
        router_logits = (router_logits,)
    if len(router_logits) == 0:
        return torch.zeros(())
    if fractions is not None and len(fractions) != len(router_logits):
        raise ValueError(f"fractions: {len(fractions)} layers given for {len(router_logits)} layers of router logits")
    losses = []
    for layer, logits in enumerate(router_logits):
        logits = real_token_logits(logits, attention_mask)  # (N, E)
        N, E = logits.shape
        if N == 0:
            losses.append(logits.sum() * 0.0)
            continue
        probs = logits.softmax(-1)  # (N, E)
        if fractions is None:
            chosen = probs.topk(top_k, dim=-1).indices  # (N, k)
            r = routing_fractions([torch.bincount(chosen.flatten(), minlength=E)])[0]  # (E,) sums to 1
        else:
            r = fractions[layer].detach().to(probs)  # (E,) precomputed, e.g. over all ranks and chunks
        p = probs.mean(0)  # (E,)
        losses.append(alpha * E * (r * p).sum())  # Eq. 1
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
        logits = real_token_logits(logits, attention_mask)
        losses.append(torch.logsumexp(logits, dim=-1).square().mean() if logits.shape[0] else logits.sum() * 0.0)
    return torch.stack(losses).mean()


def balance_bias_step(counts: torch.Tensor, rate: float) -> torch.Tensor:
    """Auxiliary-loss-free balancing's update of the selection bias (Wang et al. 2024, arXiv 2408.15664, Alg. 1;
    DeepSeek-V3 §2.1.2): Δb_i = u · sign(mean_j c_j − c_i) from one step's assignments c (E,) per expert, so an
    overloaded expert's bias falls and an idle one's rises. No gradient: the bias only chooses, never weighs."""
    c = counts.detach().float()
    return rate * torch.sign(c.mean() - c)  # (E,)
