"""The Embedder: encoder + pooling + normalisation + task prefixes + Matryoshka + output precision.

    >>> emb = Embedder.load("path/to/model")
    >>> vecs = emb.encode(["what is a sparse MoE?"], prompt="search_query", dim=256)   # (1, 256) float32

An embedding never depends on the other texts of its batch: batches are formed by length only to save padding,
padding is removed before any computation (encoder.py), and int8 ranges come from stored calibration data.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from moembed.errors import MoembedError
from moembed.model.config import EncoderConfig
from moembed.model.encoder import Encoder, EncoderOutput
from moembed.model.pooling import (
    POOLINGS,
    PRECISIONS,
    binarize,
    int8_ranges,
    pool,
    quantize_int8,
    truncate,
)
from moembed.model.tokenizer import TextTokenizer

log = logging.getLogger("moembed")

# Task prefixes of nomic-embed-v1 §4 (also used by Nomic v2): the default for models moembed trains.
NOMIC_PROMPTS = {
    "search_query": "search_query: ",
    "search_document": "search_document: ",
    "classification": "classification: ",
    "clustering": "clustering: ",
}


@dataclass
class EmbedOutput:
    embeddings: torch.Tensor  # (B, d) pooled, not normalised
    encoder: EncoderOutput


class Embedder(nn.Module):
    def __init__(
        self,
        encoder: Encoder,
        tokenizer: TextTokenizer,
        pooling: str = "mean",
        normalize: bool = True,
        prompts: dict[str, str] | None = None,
        name: str = "moembed-model",
        calibration: np.ndarray | None = None,
    ):
        super().__init__()
        if pooling not in POOLINGS:
            raise MoembedError(f"pooling: unknown mode {pooling!r}; choose one of {', '.join(POOLINGS)}")
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.normalize = normalize
        self.prompts = dict(NOMIC_PROMPTS if prompts is None else prompts)
        self.name = name
        self.calibration = calibration  # (n, d) float32 sample of embeddings for int8 ranges, or None

    @property
    def config(self) -> EncoderConfig:
        return self.encoder.config

    @property
    def dim(self) -> int:
        return self.config.hidden_size

    @property
    def max_length(self) -> int:
        return self.tokenizer.max_length

    # ---- model ------------------------------------------------------------------------------------------------

    def forward(self, input_ids, attention_mask=None, token_type_ids=None) -> EmbedOutput:
        out = self.encoder(input_ids, attention_mask, token_type_ids)
        lengths = out.attention_mask.sum(1)  # (B,)
        emb = pool(out.packed_hidden, out.batch_index, lengths, self.pooling)  # (B, d)
        return EmbedOutput(emb, out)

    def prefix(self, prompt: str | None) -> str:
        """The text prefix for a prompt name (None → no prefix). Unknown names raise, listing the known ones."""
        if prompt is None:
            return ""
        if prompt not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise MoembedError(f"prompt: unknown name {prompt!r}; this model knows: {known}")
        return self.prompts[prompt]

    # ---- inference --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def embed_tensor(
        self,
        texts: list[str],
        prefix: str = "",
        batch_size: int = 32,
        bf16: bool = False,
        show_progress: bool = False,
        desc: str = "encode",
    ) -> torch.Tensor:
        """Pooled float32 embeddings (n, d), not normalised, in input order."""
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise MoembedError(f"texts[{i}]: expected a string, got {type(t).__name__}")
        if batch_size < 1:
            raise MoembedError(f"batch_size: must be >= 1, got {batch_size}")
        was_training = self.training
        self.eval()
        ids, truncated = self.tokenizer.encode_ids([prefix + t for t in texts])
        if truncated:
            log.warning("%d of %d texts were longer than %d tokens and were truncated", truncated, len(texts), self.max_length)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # longest first: little padding per batch
        device = next(self.parameters()).device
        out = torch.empty(len(ids), self.dim, dtype=torch.float32)
        amp = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
        bar = tqdm(total=len(ids), desc=desc, unit="text", disable=not show_progress, leave=False)
        with amp:
            for s in range(0, len(order), batch_size):
                idx = order[s : s + batch_size]
                input_ids, mask = self.tokenizer.pad([ids[i] for i in idx])
                emb = self(input_ids.to(device), mask.to(device)).embeddings
                out[idx] = emb.float().cpu()
                bar.update(len(idx))
        bar.close()
        self.train(was_training)
        return out

    def encode(
        self,
        texts: list[str] | str,
        prompt: str | None = None,
        dim: int | None = None,
        precision: str = "float32",
        batch_size: int = 32,
        normalize: bool | None = None,
        show_progress: bool = False,
        bf16: bool = False,
    ) -> np.ndarray:
        """Embed texts → numpy (n, dim): float32, int8, or packed binary uint8 (n, ceil(dim / 8)).

        prompt: a prefix name from `self.prompts` (e.g. "search_query"); dim: Matryoshka truncation to the first
        `dim` components (renormalised); normalize: L2-normalise (default: the model's setting).
        """
        single = isinstance(texts, str)
        texts = [texts] if single else list(texts)
        if precision not in PRECISIONS:
            raise MoembedError(f"precision: unknown {precision!r}; choose one of {', '.join(PRECISIONS)}")
        if dim is not None and not 1 <= dim <= self.dim:
            raise MoembedError(f"dim: {dim} is out of range 1..{self.dim}")
        if precision == "int8" and self.calibration is None:
            raise MoembedError("precision: int8 needs calibration embeddings; call calibrate(texts) first")
        emb = self.embed_tensor(texts, self.prefix(prompt), batch_size, bf16, show_progress)
        x = self.postprocess(emb, dim, precision, normalize)
        return x[0] if single else x

    def postprocess(self, emb: torch.Tensor, dim: int | None = None, precision: str = "float32",
                    normalize: bool | None = None) -> np.ndarray:
        """Pooled embeddings (n, d) from `embed_tensor` → truncated, normalised, quantised numpy output.

        Lets callers that need several dims or precisions of the same texts (evaluation sweeps) encode once.
        """
        norm = self.normalize if normalize is None else normalize
        x = truncate(emb, dim, norm).numpy()
        if precision == "int8":
            return quantize_int8(x, self.int8_ranges(dim, norm))
        if precision == "binary":
            return binarize(x)
        return x

    def calibrate(self, texts: list[str], prompt: str | None = None, max_samples: int = 10_000) -> None:
        """Store a sample of embeddings from which int8 ranges are taken (arctic-embed-2 §2.5)."""
        texts = list(texts)[:max_samples]
        if not texts:
            raise MoembedError("calibrate: no texts given")
        self.calibration = self.embed_tensor(texts, self.prefix(prompt)).numpy()

    def int8_ranges(self, dim: int | None, normalize: bool = True) -> np.ndarray:
        """Per-dimension ranges for the requested truncation, from the stored calibration sample."""
        if self.calibration is None:
            raise MoembedError("precision: int8 needs calibration embeddings; call calibrate(texts) first")
        cal = truncate(torch.from_numpy(self.calibration), dim, normalize).numpy()
        return int8_ranges(cal)

    # ---- I/O --------------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, **kwargs) -> "Embedder":
        """Load a moembed, Hugging Face BERT or sentence-transformers directory."""
        from moembed.model.io import load_embedder

        return load_embedder(path, **kwargs)

    def save(self, path: str | Path) -> None:
        from moembed.model.io import save_embedder

        save_embedder(self, path)
