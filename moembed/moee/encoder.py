"""moembed's own MoE encoders as sources of HS and RW embeddings (MoEE §3.1 carried over to encoders).

An encoder routes only real tokens (padding is removed before the MLPs, see model/encoder.py), and it is
bidirectional, so no single token summarises the text the way a decoder's last token does. Hence:
- RW = per MoE layer the mean over the sequence's real tokens of softmax(router logits), concatenated;
- HS = the Embedder's pooled output (its own pooling, e.g. mean), not normalised.
"""

from __future__ import annotations

import json

import torch

from moembed.errors import MoembedError
from moembed.model.embedder import Embedder
from moembed.model.inference import run_batches
from moembed.model.protocol import short_hash
from moembed.moee.extract import Features, packed_routing_weights
from moembed.progress import bar


class EncoderMoESource:
    """HS and RW features of a moembed `Embedder` whose encoder has MoE layers.

    prompt: a prefix name from the Embedder's `prompts` (e.g. "search_query"); a name the model lacks means no
    prefix, so tasks can ask for any prompt.
    """

    def __init__(self, embedder: Embedder, bf16: bool = False):
        layers = embedder.config.moe_layers()
        if not layers:
            raise MoembedError(f"{embedder.name}: the encoder has no MoE layers, so it has no routing weights")
        self.embedder = embedder.eval()
        self.name = embedder.name
        self.prompts = dict(embedder.prompts)
        self.moe_layers = layers
        self.bf16 = bf16  # bfloat16 autocast

    @property
    def hs_dim(self) -> int:
        return self.embedder.dim

    @property
    def rw_dim(self) -> int:
        return len(self.moe_layers) * self.embedder.config.moe.num_experts

    def settings(self) -> dict:
        """Everything besides the weights that changes the features."""
        return {"bf16": self.bf16, "max_length": self.embedder.max_length, "pooling": self.embedder.pooling}

    def settings_key(self) -> str:
        """The encoder's own key (weights, lengths, pooling) and this source's settings."""
        return short_hash(json.dumps([self.embedder.settings_key(), self.settings()], sort_keys=True))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> Features:
        """One padded batch (B, T) → Features (B, ·)."""
        out = self.embedder(input_ids, mask)
        rw = packed_routing_weights(out.encoder.router_logits, out.encoder.batch_index, input_ids.shape[0])
        return Features(out.embeddings.float(), rw)

    def _forward_ids(self, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(self.embedder.parameters()).device
        input_ids, mask = self.embedder.tokenizer.pad(ids)  # right padding, (B, T) each
        f = self.forward(input_ids.to(device), mask.to(device))
        return f.hs, f.rw

    def features(self, texts: list[str], prompt: str | None = None, batch_size: int = 32,
                 show_progress: bool = False) -> Features:
        """HS and RW of `texts` (n, ·), in input order, independent of batching."""
        if batch_size < 1:
            raise MoembedError(f"batch_size: must be >= 1, got {batch_size}")
        prefix = self.prompts.get(prompt, "") if prompt is not None else ""
        ids, _ = self.embedder.token_ids(texts, prefix)
        device = next(self.embedder.parameters()).device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16), \
                bar("moee", enabled=show_progress) as progress:
            hs, rw = run_batches(ids, batch_size, self._forward_ids, (self.hs_dim, self.rw_dim), progress)
        return Features(hs, rw)
