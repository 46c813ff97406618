"""Expert utilisation of MoE encoders: per-layer token counts, load fractions and router entropy.

From one forward pass (`from_output(EncoderOutput)`) for training logs, or accumulated over a file of probe
texts (`probe(embedder, texts)`) for `moembed info --probe`. Only real tokens are counted (padding is never
routed, see moe.py). Router entropy is the mean over tokens of H(softmax(router logits)) in nats: log E for a
router that spreads every token evenly, 0 for one that is certain.

Router logits come per MoE layer either packed over real tokens, (N, E), as the encoder returns them, or
padded, (B, T, E), together with an attention mask (B, T) that selects the real tokens (`real_token_logits`;
the auxiliary losses of `moembed.losses.moe_aux` read them the same way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moembed.model.encoder import EncoderOutput
from moembed.model.inference import length_sorted_batches


def real_token_logits(logits: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(N, E) float32 logits of real tokens from (N, E), or from (B, T, E) with a (B, T) mask."""
    if logits.dim() == 3:
        logits = logits[attention_mask.bool()] if attention_mask is not None else logits.reshape(-1, logits.shape[-1])
    return logits.float()


def router_entropy(router_logits: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean entropy (nats) of the routing distribution over real tokens, for one layer's logits."""
    logp = real_token_logits(router_logits, attention_mask).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1).mean()


@dataclass
class LayerUtilisation:
    layer: int  # 0-based layer index
    counts: list[int]  # routing assignments per expert (tokens · top_k in total)
    tokens: int  # real tokens routed
    entropy: float  # mean router entropy (nats) over those tokens

    @property
    def fractions(self) -> list[float]:
        total = sum(self.counts)
        return [c / total if total else 0.0 for c in self.counts]

    @property
    def max_entropy(self) -> float:
        return math.log(len(self.counts))

    def as_dict(self) -> dict:
        return {"layer": self.layer, "counts": self.counts, "fractions": self.fractions, "tokens": self.tokens,
                "router_entropy": self.entropy}


def from_output(out: EncoderOutput, layers: list[int]) -> list[LayerUtilisation]:
    """Utilisation of one forward pass; `layers` are the MoE layer indices (`config.moe_layers()`)."""
    if len(layers) != len(out.router_logits):
        raise ValueError(f"{len(layers)} MoE layers given, the output has {len(out.router_logits)} router outputs")
    rows = []
    for i, logits, counts in zip(layers, out.router_logits, out.expert_counts):
        n = logits.shape[0]
        h = router_entropy(logits.detach()).item() if n else 0.0
        rows.append(LayerUtilisation(i, [int(c) for c in counts.tolist()], n, h))
    return rows


def merge(a: list[LayerUtilisation], b: list[LayerUtilisation]) -> list[LayerUtilisation]:
    """Combine two reports of the same layers: counts add, entropies average weighted by tokens."""
    out = []
    for x, y in zip(a, b, strict=True):
        n = x.tokens + y.tokens
        h = (x.entropy * x.tokens + y.entropy * y.tokens) / n if n else 0.0
        out.append(LayerUtilisation(x.layer, [p + q for p, q in zip(x.counts, y.counts)], n, h))
    return out


@torch.inference_mode()
def probe(embedder, texts: list[str], batch_size: int = 32, prefix: str = "") -> list[LayerUtilisation]:
    """Utilisation of an MoE embedder over texts (eval mode; no jitter), in length-sorted batches."""
    layers = embedder.config.moe_layers()
    if not layers:
        return []
    report = None
    for _, _, out in encoder_passes(embedder, texts, batch_size, prefix):
        rows = from_output(out, layers)
        report = rows if report is None else merge(report, rows)
    return report or []


def encoder_passes(embedder, texts: list[str], batch_size: int, prefix: str = ""):
    """Yield (indices, mask (B, T), encoder output) per length-sorted batch of `texts`, the model in eval mode
    meanwhile (no jitter); the probes of utilisation and diagnostics read their routing from these passes."""
    was_training = embedder.training
    embedder.eval()
    device = next(embedder.parameters()).device
    ids, _ = embedder.token_ids(texts, prefix)
    try:
        for idx in length_sorted_batches([len(x) for x in ids], batch_size):
            input_ids, mask = embedder.tokenizer.pad([ids[i] for i in idx])  # (B, T) each
            yield idx, mask, embedder.encoder(input_ids.to(device), mask.to(device))
    finally:
        embedder.train(was_training)


def format_report(rows: list[LayerUtilisation]) -> list[str]:
    """Human-readable lines: per layer the load per expert (% of assignments) and the router entropy."""
    lines = []
    for r in rows:
        load = " ".join(f"{100 * f:4.1f}" for f in r.fractions)
        lines.append(
            f"layer {r.layer + 1}: {r.tokens} tokens, load % [{load}], "
            f"router entropy {r.entropy:.3f} nats (max {r.max_entropy:.3f})"
        )
    return lines
