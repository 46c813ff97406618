"""Masked language modelling, the first training stage (nomic-embed-v1 §4.1; nomic-embed-v2 §4.1, Table 2).

- 30% of the non-special tokens are selected (Portes et al. 2023, as nomic-embed-v1 §4.1.2); of those 80% become
  [MASK], 10% a random token, 10% stay unchanged (Devlin et al. 2019).
- Documents are tokenised, concatenated and cut into rows of exactly `seq_len` tokens (sequence packing), so no
  compute is spent on padding.
- Vocabulary logits are computed only at the selected positions (M ≈ 0.3·B·T rows instead of B·T).
- Per-language sources are drawn one per batch with p ∝ n^α, α = 0.3 (Nomic v2 Table 2, after XLM-R).
- The MoE load-balancing term is computed by `MLMModel.loss` from routing fractions it is given: the stage's
  step (train/stages.py) takes them from all ranks' counts, so the model's forward runs no collective.
The mNomic-BERT step (absolute → rotary positions before MLM continues, nomic-embed-v2 §4.1) is
`moembed.model.convert.rotary.to_rotary`, applied by the MLM stage when `mlm.to_rotary` is set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moembed.data.batching import SourceSampler
from moembed.data.sources import SourceStats, TextSource
from moembed.errors import MoembedError
from moembed.losses.moe_aux import load_balancing_loss, routing_fractions
from moembed.model.config import EncoderConfig
from moembed.model.embedder import Embedder
from moembed.model.tokenizer import TextTokenizer

IGNORE = -100
_SPECIAL = ("[CLS]", "[SEP]", "[PAD]", "<s>", "</s>", "<pad>", "<cls>", "<sep>")


# ---- model --------------------------------------------------------------------------------------------------


class MLMHead(nn.Module):
    """BERT's prediction head: dense → GELU → LayerNorm → decoder whose weight is the word-embedding matrix."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        d = config.hidden_size
        self.dense = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, h: torch.Tensor, word_weight: torch.Tensor) -> torch.Tensor:
        """h (M, d) hidden states at masked positions, word_weight (V, d) → logits (M, V)."""
        return F.linear(self.norm(F.gelu(self.dense(h))), word_weight, self.bias)


@dataclass
class MLMForward:
    """One forward pass: the MLM loss and what the load-balancing term needs."""

    mlm: torch.Tensor  # cross-entropy at the masked positions (scalar, with gradient)
    num_masked: int
    router_logits: tuple[torch.Tensor, ...]  # one (N, E) per MoE layer
    expert_counts: tuple[torch.Tensor, ...]  # one (E,) per MoE layer


@dataclass
class MLMOutput:
    loss: torch.Tensor  # mlm + aux
    mlm: torch.Tensor
    aux: torch.Tensor
    num_masked: int
    expert_counts: tuple[torch.Tensor, ...]


class MLMModel(nn.Module):
    """An Embedder plus an MLM head. The decoder is tied to `embedder.encoder.embeddings.word.weight`.

        out = model.loss(model(input_ids, labels))      # one process; a distributed step passes global fractions
    """

    def __init__(self, embedder: Embedder, aux_loss_coef: float = 0.0):
        super().__init__()
        self.embedder = embedder
        self.head = MLMHead(embedder.config)
        self.aux_loss_coef = aux_loss_coef

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None) -> MLMForward:
        enc = self.embedder.encoder
        out = enc(input_ids, attention_mask)
        sel = labels != IGNORE  # (B, T)
        h = out.last_hidden_state[sel]  # (M, d): only masked positions reach the vocabulary projection
        logits = self.head(h, enc.embeddings.word.weight)  # (M, V)
        mlm = F.cross_entropy(logits.float(), labels[sel])
        return MLMForward(mlm, int(sel.sum()), out.router_logits, out.expert_counts)

    def loss(self, out: MLMForward, fractions: list[torch.Tensor] | None = None, share: float = 1.0) -> MLMOutput:
        """mlm + aux_loss_coef · load balancing (nomic-embed-v2 Eq. 1) on this forward's router logits.

        fractions: r_i per MoE layer, (E,) each; None takes them from this forward's own expert counts (one
        process). share: the weight that makes the mean over ranks the global loss (`step.global_routing`).
        """
        aux = torch.zeros((), device=out.mlm.device)
        if out.router_logits and self.aux_loss_coef > 0:
            if fractions is None:
                fractions = routing_fractions(out.expert_counts)
            top_k = self.embedder.config.moe.top_k
            aux = load_balancing_loss(out.router_logits, top_k, alpha=self.aux_loss_coef, fractions=fractions) * share
        return MLMOutput(out.mlm + aux, out.mlm.detach(), aux.detach(), out.num_masked, out.expert_counts)


# ---- masking --------------------------------------------------------------------------------------------------


def special_ids(tok: TextTokenizer) -> list[int]:
    ids = {tok.tokenizer.token_to_id(t) for t in _SPECIAL} | {tok.pad_id}
    return sorted(i for i in ids if i is not None)


def mask_id(tok: TextTokenizer) -> int:
    for t in ("[MASK]", "<mask>"):
        i = tok.tokenizer.token_to_id(t)
        if i is not None:
            return i
    raise MoembedError("mlm: the tokenizer has no [MASK] or <mask> token")


def mask_tokens(ids: torch.Tensor, prob: float, mask_token: int, vocab_size: int, special: list[int],
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, T) → (inputs (B, T), labels (B, T) with IGNORE at unselected positions). 80/10/10 replacement."""
    maskable = ~torch.isin(ids, torch.tensor(special, dtype=ids.dtype))
    selected = (torch.rand(ids.shape, generator=generator) < prob) & maskable
    labels = torch.where(selected, ids, torch.full_like(ids, IGNORE))
    r = torch.rand(ids.shape, generator=generator)
    rand_tokens = torch.randint(vocab_size, ids.shape, generator=generator, dtype=ids.dtype)
    inputs = torch.where(selected & (r < 0.8), torch.full_like(ids, mask_token), ids)
    inputs = torch.where(selected & (r >= 0.8) & (r < 0.9), rand_tokens, inputs)
    return inputs, labels


# ---- packed text stream ---------------------------------------------------------------------------------------


class Packer:
    """Concatenates tokenised documents ([CLS] … [SEP] each) and cuts rows of exactly `seq_len` tokens."""

    def __init__(self, source: TextSource, tok: TextTokenizer, seq_len: int):
        self.source, self.tok, self.seq_len = source, tok, seq_len
        self.buffer: list[int] = []

    def row(self) -> list[int]:
        while len(self.buffer) < self.seq_len:
            keep = self.tok.max_length
            self.tok.set_max_length(1_000_000)  # whole documents: packing decides the cut, not truncation
            try:
                ids, _ = self.tok.encode_ids([self.source.next()])
            finally:
                self.tok.set_max_length(keep)
            self.buffer.extend(ids[0])
        row, self.buffer = self.buffer[: self.seq_len], self.buffer[self.seq_len :]
        return row

    def state(self) -> dict:
        return {"reader": self.source.state(), "buffer": list(self.buffer)}

    def load_state(self, s: dict) -> None:
        self.source.load_state(s["reader"])
        self.buffer = [int(x) for x in s["buffer"]]


class PackedTextStream:
    """Batches (B, seq_len) of packed token ids, one language (source) per batch, p ∝ n^α."""

    def __init__(self, sources: list[TextSource], tok: TextTokenizer, batch_size: int, seq_len: int, alpha: float,
                 seed: int, stats: SourceStats, rank: int = 0, world_size: int = 1):
        if batch_size % world_size:
            raise ValueError(f"batch_size ({batch_size}) must be divisible by the number of processes ({world_size})")
        self.packers = [Packer(s, tok, seq_len) for s in sources]
        self.batch_size, self.rank, self.world, self.stats = batch_size, rank, world_size, stats
        # p ∝ (w·n)^α is the general formula with temperature 1/α.
        self.sampler = SourceSampler([s.size for s in sources], [s.cfg.weight for s in sources], 1.0 / alpha, seed)

    def next(self) -> tuple[str, torch.Tensor]:
        packer = self.packers[self.sampler.next()]
        rows = [packer.row() for _ in range(self.batch_size)]
        per = self.batch_size // self.world
        return packer.source.name, torch.tensor(rows[self.rank * per : (self.rank + 1) * per], dtype=torch.long)

    def state(self) -> dict:
        return {
            "sampler": self.sampler.state(),
            "sources": {p.source.name: p.state() for p in self.packers},
            "stats": self.stats.as_dict(),
        }

    def load_state(self, s: dict) -> None:
        self.sampler.load_state(s["sampler"])
        for p in self.packers:
            if p.source.name in s["sources"]:
                p.load_state(s["sources"][p.source.name])
        for k, v in s.get("stats", {}).items():
            getattr(self.stats, k).clear()
            getattr(self.stats, k).update(v)
