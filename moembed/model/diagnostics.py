"""Whether an MoE model's experts learned anything: divergence, routing, and routing that follows the data.

Per MoE layer, over a probe set of texts (`moembed info MODEL --probe FILE`, the quickstart report):

    divergence   mean over experts of ‖W_e − W̄‖ / ‖W̄‖, W_e expert e's fc1 and fc2 weights, W̄ their mean over
                 experts: 0 for the exact copies of plain upcycling; the fine-grained slices of virtual-group
                 upcycling differ from the start (each holds other hidden units), so compare a model with its own
                 initialisation there
    load, entropy   assignments per expert and mean router entropy (`moembed.model.utilisation`)
    MI           mutual information I(expert; label) in nats between the expert a token is sent to and a label of
                 its text (source, language), from the joint assignment counts, and MI / H(label): 0 when routing
                 ignores the label, 1 when the experts chosen tell the label exactly

`router_grad_norms` reads the router gradients after a backward pass: the benchmark and the tests take them from
InfoNCE alone (auxiliary losses off) to show whether the task loss reaches the router at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moembed.model.utilisation import LayerUtilisation, encoder_passes, from_output, merge


def moe_blocks(embedder) -> list[tuple[int, torch.nn.Module]]:
    """(0-based layer, MoEBlock) of every MoE layer, in order."""
    return [(i, embedder.encoder.layers[i].mlp) for i in embedder.config.moe_layers()]


def expert_divergence(fc1: torch.Tensor, fc2: torch.Tensor) -> list[float]:
    """Per expert ‖W_e − W̄‖_F / ‖W̄‖_F, W_e = (fc1[e], fc2[e]) flattened together, W̄ the mean over experts.
    fc1 (E, r, d), fc2 (E, d, i)."""
    w = torch.cat([fc1.detach().float().flatten(1), fc2.detach().float().flatten(1)], dim=1)  # (E, P)
    mean = w.mean(0)  # (P,)
    return ((w - mean).norm(dim=1) / mean.norm().clamp(min=1e-12)).tolist()


def mutual_information(joint: torch.Tensor) -> tuple[float, float]:
    """(I(expert; label) in nats, I / H(label)) from joint counts (L, E): assignments of label l's tokens to
    expert e. I = Σ p(l,e) log(p(l,e) / (p(l) p(e))); the ratio is 0 where H(label) = 0."""
    p = joint.double() / joint.sum().clamp(min=1)
    pl, pe = p.sum(1, keepdim=True), p.sum(0, keepdim=True)  # (L, 1), (1, E)
    nz = p > 0
    mi = float((p[nz] * (p[nz] / (pl @ pe)[nz]).log()).sum())
    h = float(-(pl[pl > 0] * pl[pl > 0].log()).sum())
    return mi, (mi / h if h > 0 else 0.0)


def chosen_experts(block, logits: torch.Tensor) -> torch.Tensor:
    """(N, k) experts chosen from one block's router logits (N, E), as `MoEBlock.route` chooses them."""
    score = logits.float() + block.balance_bias if getattr(block, "balance_rate", 0) > 0 else logits.float()
    return score.sort(dim=-1, descending=True, stable=True).indices[:, : block.top_k]


@dataclass
class LayerDiagnostics:
    layer: int  # 0-based
    divergence: float  # mean over experts of ‖W_e − W̄‖ / ‖W̄‖
    utilisation: LayerUtilisation  # load and router entropy
    mutual_information: float | None  # nats; None without labels
    mi_ratio: float | None  # I / H(label)

    def as_dict(self) -> dict:
        return {"layer": self.layer, "divergence": self.divergence, **self.utilisation.as_dict(),
                "mutual_information": self.mutual_information, "mi_ratio": self.mi_ratio}


@torch.inference_mode()
def diagnose(embedder, texts: list[str], labels: list[str] | None = None, batch_size: int = 32,
             prefix: str = "") -> list[LayerDiagnostics]:
    """Per MoE layer: expert divergence, load and entropy over `texts`, and with `labels` (one per text) the
    mutual information between chosen expert and label over every real token's assignments."""
    blocks = moe_blocks(embedder)
    if not blocks:
        return []
    if labels is not None and len(labels) != len(texts):
        raise ValueError(f"{len(labels)} labels for {len(texts)} texts")
    names = sorted(set(labels)) if labels is not None else []
    code = {n: j for j, n in enumerate(names)}
    joint = [torch.zeros(len(names), b.num_experts, dtype=torch.long) for _, b in blocks]  # (L, E) per layer
    util = None
    for idx, mask, out in encoder_passes(embedder, texts, batch_size, prefix):
        rows = from_output(out, [i for i, _ in blocks])
        util = rows if util is None else merge(util, rows)
        if labels is not None:
            tok_label = torch.repeat_interleave(torch.tensor([code[labels[i]] for i in idx]), mask.sum(1))  # (N,)
            for j, ((_, block), logits) in enumerate(zip(blocks, out.router_logits)):
                chosen = chosen_experts(block, logits.cpu())  # (N, k)
                flat = tok_label[:, None].expand_as(chosen) * block.num_experts + chosen  # (N, k)
                joint[j] += torch.bincount(flat.flatten(), minlength=joint[j].numel()).view_as(joint[j])
    out = []
    for j, (i, block) in enumerate(blocks):
        div = expert_divergence(block.experts.fc1_weight, block.experts.fc2_weight)
        mi = mutual_information(joint[j]) if labels is not None else (None, None)
        out.append(LayerDiagnostics(i, sum(div) / len(div), util[j], *mi))
    return out


def router_grad_norms(embedder) -> list[float]:
    """‖∂loss/∂W_router‖ of each MoE layer after a backward pass (0 where the router got no gradient)."""
    return [0.0 if b.router.weight.grad is None else float(b.router.weight.grad.norm()) for _, b in moe_blocks(embedder)]


def format_diagnostics(rows: list[LayerDiagnostics]) -> list[str]:
    """One line per layer: divergence, router entropy (and its maximum), largest load share, MI."""
    lines = []
    for r in rows:
        u = r.utilisation
        mi = "" if r.mutual_information is None else (
            f", MI(expert; label) {r.mutual_information:.3f} nats ({100 * r.mi_ratio:.1f}% of H(label))")
        lines.append(f"layer {r.layer + 1}: expert divergence {r.divergence:.4f}, router entropy {u.entropy:.3f} "
                     f"nats (max {math.log(len(u.counts)):.3f}), busiest expert {100 * max(u.fractions):.1f}% of "
                     f"assignments{mi}")
    return lines
