"""One contrastive training step: encode, score, backpropagate (plainly or with GradCache), average gradients.

The step does not touch the optimiser: the caller zeroes gradients before and steps after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from moembed import distributed as dist
from moembed.errors import MoembedError
from moembed.losses.cached import Encoded, cached_backward, plain_backward
from moembed.losses.config import LossConfig
from moembed.losses.contrastive import false_negative_mask, matryoshka_info_nce, sequence_ids, text_ids
from moembed.losses.moe_aux import load_balancing_loss, router_z_loss, routing_fractions
from moembed.model.embedder import Embedder
from moembed.model.tokenizer import Batch


@dataclass
class StepResult:
    """Losses of one step, averaged over ranks (the global-batch values), for logging."""

    loss: float  # contrastive + aux_loss_coef·aux + z_loss_coef·z
    contrastive: float  # Matryoshka-weighted InfoNCE
    aux: float  # load-balancing loss (without its coefficient), 0 for dense models
    z: float  # router z-loss (without its coefficient), 0 for dense models
    per_dim: dict[int, float] = field(default_factory=dict)  # InfoNCE at each Matryoshka dimension
    num_queries: int = 0  # queries in the global batch (all ranks)
    expert_counts: list[torch.Tensor] = field(default_factory=list)  # per MoE layer (E,), this rank, all passes
    global_counts: torch.Tensor | None = None  # (L, E) the step's routing assignments of all ranks; None: dense
    rank_loss: float = 0.0  # this rank's own term of `loss` before averaging (says where a NaN arose)


def unwrap(model: nn.Module) -> Embedder:
    """The bare Embedder inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def contrastive_step(
    model: nn.Module,
    queries: Batch,
    documents: Batch,
    negatives: Batch | None,
    loss: LossConfig,
    chunk_size: int | None = None,
    doc_ids: torch.Tensor | Sequence[str] | None = None,
    routing_history: torch.Tensor | None = None,
) -> StepResult:
    """Forward and backward of the contrastive objective on this rank's share of a batch.

    Args:
        model: the `Embedder` being trained. Pass the bare model and do NOT wrap it in DDP: gradients are averaged
            over ranks here, in buckets whose all-reduces overlap the last backward pass (the only one after
            which they are final when GradCache replays several chunks; `distributed.GradientSync`), which DDP's
            per-backward hooks cannot do. A DDP wrapper is accepted and unwrapped (its hooks stay idle). Every rank must start from the
            same weights (`moembed.distributed.broadcast_parameters`).
        queries: (B, Tq) tokenised queries; documents: (B, Td) their positives, row i for query i.
        negatives: (B·H, Tn) hard negatives, query by query (rows i·H .. i·H+H-1 for query i),
            H = loss.num_hard_negatives; None when H = 0.
        loss: the objective's settings.
        chunk_size: GradCache chunk (sequences per forward pass) when smaller than a batch; None: plain.
        doc_ids: identities of the B + B·H documents (positives then negatives) for false-negative masking:
            texts (hashed) or an int64 tensor. Default: the documents' token ids.
        routing_history: (L, E) routing assignments of all ranks in earlier steps, added to this step's when
            counting the load-balancing fractions (`balance_window.RoutingWindow.history`); None: this step only.
    Embeddings of all ranks are gathered with gradient, so every rank's documents are negatives for every query;
    each rank's contrastive term is its queries' share of the global mean, so averaging gradients over ranks
    gives the gradient of the global-batch loss. The MoE auxiliary losses likewise: the load-balancing loss takes
    its routing fractions r from the expert counts of every rank's whole batch (all passes, all GradCache chunks;
    see `global_routing`), and both auxiliary losses are weighted by this rank's share of the global tokens, so
    the averaged gradient is that of the global-batch losses. Run inside `torch.autocast` for bf16.
    """
    bare = unwrap(model)
    B = queries.input_ids.shape[0]
    _check_shapes(B, documents, negatives, loss)
    if chunk_size is not None and chunk_size < 1:
        raise MoembedError(f"chunk_size: must be a positive number of texts, got {chunk_size}")
    batches = [queries, documents] + ([negatives] if negatives is not None else [])
    ids = _document_ids(doc_ids, documents, negatives, B)
    sizes = dist.gather_sizes(B)
    top_k = bare.config.moe.top_k if bare.config.moe is not None else 1
    device = next(bare.parameters()).device

    def forward(batch: Batch):
        out = bare(batch.input_ids.to(device), batch.attention_mask.to(device), batch.token_type_ids.to(device))
        return out.embeddings, out.encoder.router_logits, out.encoder.expert_counts

    def objective(enc: Encoded):
        return _objective(enc, loss, ids, sizes, top_k, routing_history)

    # Gradients are averaged over ranks in buckets whose all-reduces overlap the last backward pass.
    with dist.synchronised_gradients(bare) as last_backward:
        if chunk_size is not None and any(b.input_ids.shape[0] > chunk_size for b in batches):
            parts = cached_backward(forward, batches, objective, chunk_size, device, last_backward)
        else:
            parts = plain_backward(forward, batches, objective, last_backward)
    return _result(parts, sum(sizes))


def _check_shapes(B: int, documents: Batch, negatives: Batch | None, loss: LossConfig) -> None:
    if documents.input_ids.shape[0] != B:
        raise MoembedError(f"documents: {documents.input_ids.shape[0]} documents for {B} queries")
    H = loss.num_hard_negatives
    n = 0 if negatives is None else negatives.input_ids.shape[0]
    if n != B * H:
        raise MoembedError(f"num_hard_negatives: expected {B}×{H} = {B * H} negatives, got {n}")


def _document_ids(doc_ids, documents: Batch, negatives: Batch | None, B: int) -> torch.Tensor:
    """(B + B·H,) int64 identities of this rank's documents in the loss layout (positives, then negatives)."""
    if doc_ids is None:
        parts = [sequence_ids(documents.input_ids, documents.attention_mask)]
        if negatives is not None:
            parts.append(sequence_ids(negatives.input_ids, negatives.attention_mask))
        return torch.cat(parts)
    ids = doc_ids if isinstance(doc_ids, torch.Tensor) else text_ids(list(doc_ids))
    expected = B + (0 if negatives is None else negatives.input_ids.shape[0])
    if ids.shape != (expected,):
        raise MoembedError(f"doc_ids: expected {expected} identities (positives then negatives), got {len(ids)}")
    return ids.long()


def _objective(enc: Encoded, cfg: LossConfig, ids: torch.Tensor, sizes: list[int], top_k: int,
               history: torch.Tensor | None):
    """The loss on this rank's encoded batches, against the documents of all ranks."""
    q, d = enc.embeddings[0], enc.embeddings[1]  # (B, dim) each
    B, Bg, W = q.shape[0], sum(sizes), len(sizes)
    all_q, all_d = dist.all_gather_with_grad(q), dist.all_gather_with_grad(d)  # (Bg, dim)
    docs = all_d
    if len(enc.embeddings) > 2:
        docs = torch.cat([all_d, dist.all_gather_with_grad(enc.embeddings[2])])  # (Bg + Bg·H, dim)
    positive = sum(sizes[: dist.rank()]) + torch.arange(B, device=q.device)  # (B,) this rank's rows in docs
    mask = None
    if cfg.mask_false_negatives:
        all_ids = _gather_ids(ids.to(q.device), B, sizes)
        mask = false_negative_mask(all_ids.to(q.device), positive)  # (B, Bg + Bg·H)
    dims, weights = cfg.dims_and_weights(q.shape[-1])
    contrastive, per_dim = matryoshka_info_nce(
        q, docs, positive, cfg.temperature, dims, weights, cfg.symmetric, mask, all_q
    )
    # This rank's queries' share of the global mean: the mean over ranks of `share · local mean` is the global mean.
    share = B * W / Bg
    contrastive = contrastive * share
    zero = contrastive.new_zeros(())
    aux = z = zero
    counts = None
    if enc.router_logits:
        # r_i of Eq. 1 over the global batch (and the window's earlier steps); `share` makes the mean over ranks the
        # global loss (as for InfoNCE).
        fractions, token_share, counts = global_routing(enc.expert_counts, history)
        aux = load_balancing_loss(enc.router_logits, top_k, fractions=fractions).to(zero) * token_share
        z = router_z_loss(enc.router_logits).to(zero) * token_share
    total = contrastive + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
    logged = torch.stack([total, contrastive, aux, z] + [v * share for v in per_dim.values()]).detach()
    return total, (logged, list(per_dim), enc.expert_counts, counts)


def global_routing(
    expert_counts: Sequence[torch.Tensor], history: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], float, torch.Tensor]:
    """Routing fractions of the global batch and this rank's token share, for the MoE auxiliary losses.

    expert_counts: this rank's routing assignments per MoE layer, (E,) each, over all of its tokens in the step
        (every forward pass; under GradCache, the counts of the no-grad pass over all chunks).
    Returns (r, share, counts): r per layer (E,), the fractions of the counts summed over ranks (r_i of nomic-embed-v2
    Eq. 1 for the global batch); share = W·N_rank / N_global, the weight that makes the mean over ranks of the
    per-rank losses equal the global-batch loss (see `load_balancing_loss`). In one process: local r, share 1.
    history: (L, E) assignments of all ranks in earlier steps (the same on every rank), added before r is taken.
    The third value is this step's (L, E) assignments of all ranks, for the window.
    """
    local = torch.stack([c.detach() for c in expert_counts])  # (L, E) assignments of this rank
    total = dist.all_reduce_sum(local)  # (L, E) assignments of all ranks
    # Every MoE layer routes every real token, so any layer's N·k gives the token share (k cancels).
    share = dist.world_size() * float(local[0].sum()) / max(float(total[0].sum()), 1.0)
    counted = total if history is None else total + history.to(total)
    return routing_fractions(counted), share, total


def _gather_ids(ids: torch.Tensor, B: int, sizes: list[int]) -> torch.Tensor:
    """(Bg + Bg·H,) identities of all ranks' documents in the gathered layout (all positives, then all negatives)."""
    with torch.no_grad():
        positives = dist.all_gather_with_grad(ids[:B])
        if ids.shape[0] == B:
            return positives
        return torch.cat([positives, dist.all_gather_with_grad(ids[B:])])


def _result(parts, num_queries: int) -> StepResult:
    logged, dims, counts, global_counts = parts
    local = logged[0]
    logged = dist.all_reduce_mean(logged).tolist()
    return StepResult(
        loss=logged[0], contrastive=logged[1], aux=logged[2], z=logged[3],
        per_dim=dict(zip(dims, logged[4:])), num_queries=num_queries, expert_counts=list(counts),
        global_counts=global_counts, rank_loss=float(local),
    )
