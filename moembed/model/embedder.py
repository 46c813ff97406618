"""The Embedder: encoder + pooling + normalisation + task prefixes + Matryoshka + output precision.

    >>> emb = Embedder.load("path/to/model")
    >>> vecs = emb.encode(["what is a sparse MoE?"], prompt="search_query", dim=256)   # (1, 256) float32

An embedding never depends on the other texts of its batch: batches are formed by length only to save padding
(`moembed.model.inference`), padding is removed before any computation (encoder.py), and int8 ranges come from
stored calibration data. The Embedder implements `moembed.model.protocol.EmbeddingModel` and its `DerivesViews`
and `Quantizes` capabilities.

Inference in three layers, each usable on its own:
    token_ids(texts, prefix)  → token-id lists (truncated to max_length)
    embed_ids(ids)            → (n, d) pooled float32, one padded forward pass, not normalised
    embed_tensor / encode     → length-sorted batches of the above; encode adds truncation, normalisation, precision
"""

from __future__ import annotations

import json
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from moembed.errors import MoembedError
from moembed.model.config import EncoderConfig
from moembed.model.encoder import Encoder, EncoderOutput
from moembed.model.inference import run_batches
from moembed.model.io import ModelParts, read_parts, save_parts
from moembed.model.pooling import (
    POOLINGS,
    PRECISIONS,
    binarize,
    int8_ranges,
    pool,
    quantize_int8,
    truncate,
)
from moembed.model.protocol import short_hash, weights_key
from moembed.model.tokenizer import TextTokenizer
from moembed.progress import Progress, bar

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
    """An encoder with its tokenizer and output settings.

    source_dir: the directory the model was loaded from (or last saved to); its tokenizer files are copied on save
    so that nothing of the original tokenizer configuration is lost. None for a model built in memory.
    """

    def __init__(
        self,
        encoder: Encoder,
        tokenizer: TextTokenizer,
        pooling: str = "mean",
        normalize: bool = True,
        prompts: dict[str, str] | None = None,
        name: str = "moembed-model",
        calibration: np.ndarray | None = None,
        source_dir: str | Path | None = None,
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
        self.source_dir = Path(source_dir) if source_dir is not None else None

    @property
    def config(self) -> EncoderConfig:
        return self.encoder.config

    @property
    def dim(self) -> int:
        return self.config.hidden_size

    @property
    def max_length(self) -> int:
        return self.tokenizer.max_length

    def derive(self, encoder: Encoder, **changes) -> Embedder:
        """A new Embedder around `encoder` with this one's tokenizer and settings; keyword arguments (pooling,
        normalize, prompts, name, calibration, source_dir) replace them. Used by `moembed.model.convert`."""
        settings = dict(tokenizer=self.tokenizer, pooling=self.pooling, normalize=self.normalize, prompts=self.prompts,
                        name=self.name, calibration=self.calibration, source_dir=self.source_dir)
        settings.update(changes)
        return Embedder(encoder, **settings).train(self.training)

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

    def token_ids(self, texts: list[str], prefix: str = "") -> tuple[list[list[int]], int]:
        """Token ids of `prefix + text` per text (special tokens included, truncated to `max_length`) and the
        number of texts that were truncated."""
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise MoembedError(f"texts[{i}]: expected a string, got {type(t).__name__}")
        return self.tokenizer.encode_ids([prefix + t for t in texts])

    @torch.inference_mode()
    def embed_ids(self, ids: list[list[int]]) -> torch.Tensor:
        """Pooled embeddings (n, d) float32 on the CPU, not normalised, of already tokenized texts: one padded
        forward pass (call on a model in eval mode, as `load` returns it)."""
        device = next(self.parameters()).device
        input_ids, mask = self.tokenizer.pad(ids)  # (n, T) each
        return self(input_ids.to(device), mask.to(device)).embeddings.float().cpu()

    @torch.inference_mode()
    def embed_tensor(
        self,
        texts: list[str],
        prefix: str = "",
        batch_size: int = 32,
        bf16: bool = False,
        show_progress: bool = False,
        desc: str = "encode",
        progress: Progress | None = None,
    ) -> torch.Tensor:
        """Pooled float32 embeddings (n, d), not normalised, in input order.

        progress: called with (done, total) after each batch; show_progress draws a bar instead.
        """
        ids, truncated = self.token_ids(texts, prefix)
        if batch_size < 1:
            raise MoembedError(f"batch_size: must be >= 1, got {batch_size}")
        if truncated:
            log.warning("%d of %d texts were longer than %d tokens and were truncated", truncated, len(texts), self.max_length)
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        amp = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
        try:
            with amp, bar(desc, enabled=show_progress and progress is None) as shown:
                (out,) = run_batches(ids, batch_size, self.embed_ids, (self.dim,), progress or shown)
        finally:
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

    def settings_key(self) -> str:
        """Weights plus everything that changes `encode`'s float output: max length, Dynamic NTK, pooling,
        normalisation and the prompt prefixes (16 hex digits). int8 codes also depend on `calibration`."""
        settings = {"weights": weights_key(self), "max_length": self.max_length, "dynamic_ntk": self.config.dynamic_ntk,
                    "pooling": self.pooling, "normalize": self.normalize, "prompts": self.prompts}
        return short_hash(json.dumps(settings, sort_keys=True))

    # ---- I/O: parts ↔ Embedder (moembed.model.io reads and writes the parts) -----------------------------------

    def parts(self) -> ModelParts:
        """Everything `save` writes: config, weights (detached, on the CPU), tokenizer and settings."""
        sd = {k: v.detach().cpu() for k, v in self.encoder.state_dict().items()}
        return ModelParts(self.config, sd, self.tokenizer, self.pooling, self.normalize, self.prompts, self.name,
                          self.calibration, self.source_dir)

    @classmethod
    def from_parts(cls, parts: ModelParts) -> Embedder:
        """An Embedder in eval mode; weights that do not fit the config raise, naming the file and the weight."""
        encoder = Encoder(parts.config)
        _check_state(encoder, parts.state_dict, parts.weights_path)
        encoder.load_state_dict(parts.state_dict)
        return cls(encoder, parts.tokenizer, pooling=parts.pooling, normalize=parts.normalize, prompts=parts.prompts,
                   name=parts.name, calibration=parts.calibration, source_dir=parts.source_dir).eval()

    @classmethod
    def load(cls, path: str | Path, max_length: int | None = None) -> Embedder:
        """Load a moembed, Hugging Face (see `moembed.model.families`) or sentence-transformers directory."""
        return cls.from_parts(read_parts(path, max_length))

    def save(self, path: str | Path) -> None:
        """Write the moembed format atomically; the directory becomes this model's `source_dir`."""
        save_parts(self.parts(), path)
        self.source_dir = Path(path)


def _check_state(encoder: Encoder, sd: dict[str, torch.Tensor], source: Path | None) -> None:
    own = encoder.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise MoembedError(f"{source}: weights do not match the config ({what})")
    for k, v in sd.items():
        if own[k].shape != v.shape:
            raise MoembedError(f"{source}: weight {k!r} has shape {tuple(v.shape)}, config expects {tuple(own[k].shape)}")
