"""Training stages as objects: MLM, contrastive pretraining and finetuning behind one small interface.

A stage builds the module it optimises (from the run's Embedder) and its data stream, runs one step — forward,
backward and the gradient average over ranks, returning a log record and the number of items consumed — and
writes its extras beside the final model. The Trainer (loop.py) does everything else identically for every
stage: optimizer and schedule, the non-finite check of every rank's loss and gradients (skip or stop together),
clipping, checkpoints, evaluation, metrics.

Collectives run only inside `step` (gathering embeddings, routing counts and gradients across ranks); with one
process they are the identity (moembed.distributed).

Adding a stage is one `Stage` subclass here and one entry in `STAGES` (and its name in TrainConfig.stage).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

import moembed.train.step as steps  # looked up at call time: tests replace `contrastive_step`
from moembed import distributed as dist
from moembed.data.sources import SourceStats
from moembed.model.convert.rotary import to_rotary
from moembed.model.embedder import Embedder
from moembed.model.tokenizer import Batch, TextTokenizer
from moembed.train.balance_window import RoutingWindow
from moembed.train.build import build_pair_stream, build_text_stream
from moembed.train.config import TrainConfig
from moembed.train.mlm import MLMForward, MLMModel, MLMOutput, mask_id, mask_tokens, special_ids


def tokenize(tok: TextTokenizer, texts: list[str], max_length: int, device: torch.device) -> Batch:
    """Tokenise with a temporary max length (queries and documents have their own)."""
    keep = tok.max_length
    tok.set_max_length(max_length)
    try:
        b = tok(texts)
    finally:
        tok.set_max_length(keep)
    return Batch(b.input_ids.to(device), b.attention_mask.to(device), b.token_type_ids.to(device), b.truncated)


def _scalar(x) -> float | None:
    if x is None:
        return None
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def expert_load(counts) -> list[list[float]]:
    """Per MoE layer, the fraction of routing assignments each expert received."""
    out = []
    for c in counts or ():
        c = c.detach().float().cpu()
        out.append((c / c.sum().clamp_min(1)).tolist())
    return out


class Stage:
    """The interface every stage implements."""

    name: ClassVar[str]
    rate_unit: ClassVar[str]  # metrics key of the throughput: items per second

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def build_module(self, embedder: Embedder) -> nn.Module:
        """The module to optimise, built around the run's starting model."""
        raise NotImplementedError

    def embedder(self, module: nn.Module) -> Embedder:
        """The Embedder inside `module` (what is saved as the final model)."""
        raise NotImplementedError

    def build_stream(self, tokenizer: TextTokenizer, stats: SourceStats, rank: int, world: int):
        """The data stream: `next()` gives this rank's share of a global batch; `state()` / `load_state()`."""
        raise NotImplementedError

    def step(self, module: nn.Module, stream, device: torch.device, step: int, rank: int) -> tuple[dict, int]:
        """Forward and backward of one batch, gradients averaged over ranks (`distributed.synchronised_gradients`
        on `module`); (log record, items consumed). The record holds at least "source" and "loss", and
        "rank_loss" (this rank's own term) when "loss" is averaged over ranks. `step` is the number of steps done
        before this one. The step never decides to stop: the Trainer checks losses and gradients of all ranks."""
        raise NotImplementedError

    def state(self) -> dict:
        """What the stage carries from step to step besides the model, optimizer and data (JSON, saved with each
        checkpoint; the same on every rank)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Restore `state()` from a checkpoint."""

    def write_extras(self, module: nn.Module, directory: Path) -> None:
        """Files besides the model that the next run of this stage needs (written by rank 0 only)."""


class ContrastiveStage(Stage):
    """InfoNCE on (query, document, hard negatives) batches, one source per batch (train/step.py)."""

    name = "contrastive"
    rate_unit = "pairs_per_s"

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.window = RoutingWindow(cfg.loss.balance_window)  # load balancing over the last W steps

    def state(self) -> dict:
        return {"routing_window": self.window.state()}

    def load_state(self, state: dict) -> None:
        self.window.load_state(state.get("routing_window", []))

    def build_module(self, embedder: Embedder) -> nn.Module:
        return embedder

    def embedder(self, module: nn.Module) -> Embedder:
        return module

    def build_stream(self, tokenizer, stats, rank, world):
        return build_pair_stream(self.cfg, stats, rank, world)

    def step(self, module, stream, device, step, rank):
        cfg = self.cfg
        b = stream.next()
        tok = module.tokenizer
        q = tokenize(tok, b.queries, cfg.max_query_length, device)
        d = tokenize(tok, b.documents, cfg.max_doc_length, device)
        n = tokenize(tok, b.negatives, cfg.max_doc_length, device) if b.negatives else None
        # Gradients come back averaged over ranks; false negatives are found by document text.
        res = steps.contrastive_step(module, q, d, n, cfg.loss, cfg.chunk_size,
                                     doc_ids=b.documents + (b.negatives or []), routing_history=self.window.history())
        self.window.push(res.global_counts)
        rec = {"source": b.source, "loss": _scalar(res.loss), "rank_loss": _scalar(res.rank_loss),
               "contrastive": _scalar(res.contrastive), "aux": _scalar(res.aux), "z": _scalar(res.z)}
        if res.per_dim:
            rec["per_dim"] = {str(k): _scalar(v) for k, v in res.per_dim.items()}
        rec["expert_load"] = expert_load(res.expert_counts)
        return rec, cfg.batch_size


class FinetuneStage(ContrastiveStage):
    """Contrastive finetuning: the same step, typically with mined hard negatives and a smaller learning rate."""

    name = "finetune"


def mlm_loss(model: MLMModel, out: MLMForward) -> MLMOutput:
    """The MLM step's loss: the load-balancing term takes r_i of nomic-embed-v2 Eq. 1 from all ranks' routing
    counts and is weighted by this rank's token share (`step.global_routing`, a collective), so the mean over
    ranks is the loss of the whole batch."""
    if out.router_logits and model.aux_loss_coef > 0:
        fractions, share, _ = steps.global_routing(out.expert_counts)
        return model.loss(out, fractions, share)
    return model.loss(out)


class MLMStage(Stage):
    """Masked language modelling on packed text, one language (source) per batch (train/mlm.py)."""

    name = "mlm"
    rate_unit = "tokens_per_s"
    HEAD_FILE = "mlm_head.safetensors"

    def build_module(self, embedder: Embedder) -> nn.Module:
        if self.cfg.mlm.to_rotary and embedder.config.position == "absolute":
            embedder = to_rotary(embedder)
        module = MLMModel(embedder, self.cfg.mlm.aux_loss_coef)
        head = Path(self.cfg.model) / self.HEAD_FILE
        if head.exists():  # continuing MLM from a model this stage saved: keep its prediction head
            from safetensors.torch import load_file

            module.head.load_state_dict(load_file(str(head)))
        return module

    def embedder(self, module: nn.Module) -> Embedder:
        return module.embedder

    def build_stream(self, tokenizer, stats, rank, world):
        return build_text_stream(self.cfg, tokenizer, stats, rank, world)

    def step(self, module, stream, device, step, rank):
        cfg = self.cfg
        name, ids = stream.next()
        tok = module.embedder.tokenizer
        # Masks come from a generator seeded by (seed, step, rank): identical after a resume, different per rank.
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + rank)
        inputs, labels = mask_tokens(ids, cfg.mlm.mask_prob, mask_id(tok), module.embedder.config.vocab_size,
                                     special_ids(tok), g)
        out = mlm_loss(module, module(inputs.to(device), labels.to(device)))
        with dist.synchronised_gradients(module) as last_backward, last_backward():
            out.loss.backward()
        rec = {"source": name, "loss": _scalar(out.loss), "mlm": _scalar(out.mlm), "aux": _scalar(out.aux),
               "masked": out.num_masked, "expert_load": expert_load(out.expert_counts)}
        return rec, cfg.batch_size * cfg.mlm.seq_len

    def write_extras(self, module: nn.Module, directory: Path) -> None:
        from safetensors.torch import save_file

        from moembed.fileio import atomic_path

        with atomic_path(directory / self.HEAD_FILE) as tmp:
            save_file({k: v.detach().cpu().contiguous() for k, v in module.head.state_dict().items()}, str(tmp))


# The registry: TrainConfig.stage → its stage.
STAGES: dict[str, type[Stage]] = {s.name: s for s in (MLMStage, ContrastiveStage, FinetuneStage)}
