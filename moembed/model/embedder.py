"""The Embedder: encoder + pooling + normalisation + task prefixes + Matryoshka + output precision.

    >>> emb = Embedder.load("path/to/model", device="auto")
    >>> q = emb.encode_query(["what is a sparse MoE?"], truncate_dim=256)      # (1, 256) float32, "search_query: "
    >>> d = emb.encode(["Experts are MLPs."], prompt_name="search_document", precision="ubinary")   # (1, 48) uint8
    >>> emb.similarity(q, emb.encode_document(["Experts are MLPs."], truncate_dim=256))     # (1, 1) tensor

`encode` takes sentence-transformers' arguments with their meanings (docs/models.md maps every call).

An embedding never depends on the other texts of its batch: batches are formed by length only to save padding
(`moembed.model.inference`), padding is removed before any computation (encoder.py), and int8 ranges come from
stored calibration data. The Embedder implements `moembed.model.protocol.EmbeddingModel` and its `DerivesViews`
and `Quantizes` capabilities.

Inference in three layers, each usable on its own:
    token_ids(texts, prefix)  → token-id lists (truncated to max_length; with the prompt's length, `mark_prompt`)
    embed_ids(ids)            → (n, d) pooled float32, one padded forward pass, not normalised
    embed_tensor / encode     → length-sorted batches of the above; encode adds truncation, normalisation, precision

Device-agnostic: inputs go to the weights' device; `autocast` (from `load`'s dtype) picks bf16 / fp16 autocast.
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

from moembed.devices import INT8, resolve_device, resolve_dtype
from moembed.errors import MoembedError
from moembed.model.card import CardInfo
from moembed.model.config import EncoderConfig
from moembed.model.encoder import Encoder, EncoderOutput
from moembed.model import backends
from moembed.model.inference import length_sorted_batches, run_batches
from moembed.model.io import ModelParts, check_state, read_parts, save_parts
from moembed.model.quantize import is_int8, quantize_int8
from moembed.model.settings import Settings, apply
from moembed.model.pooling import POOLINGS, PRECISIONS, SCALAR, int8_ranges, pack_bits, pool, quantize_scalar, truncate
from moembed.model.prompts import (NOMIC_PROMPTS, mark_prompt, prefix_of, prompt_lengths, prompt_text,
                                   prompt_token_count, role_args, role_prompt)
from moembed.model.protocol import short_hash, weights_key
from moembed.model.similarity import check_fn, similarity, similarity_pairwise
from moembed.model.tokenizer import TextTokenizer
from moembed.progress import Progress, bar

log = logging.getLogger("moembed")

OUTPUT_VALUES = ("sentence_embedding", "token_embeddings")
UNCALIBRATED = "needs calibration embeddings; call calibrate(texts) first, or run `moembed calibrate MODEL TEXTS`"


def _alias(name: str, value, old: str, old_value):
    """One value from an argument and its older moembed alias; both given is an error."""
    if old_value is None:
        return value
    if value is not None:
        raise MoembedError(f"{old}: an alias of {name}; give one of them, not both")
    return old_value


@dataclass
class EmbedOutput:
    embeddings: torch.Tensor  # (B, d) pooled, not normalised
    encoder: EncoderOutput


class Embedder(nn.Module):
    """An encoder with its tokenizer and output settings.

    source_dir: the directory the model was loaded from (or last saved to); its tokenizer files are copied on save
    so that nothing of the original tokenizer configuration is lost. None for a model built in memory.
    autocast: the dtype inference runs matmuls in (torch.bfloat16 / torch.float16), None for float32.
    similarity_fn_name: "cosine" or "dot", what `similarity` computes.
    default_prompt_name: the prompt `encode` applies when given none, as sentence-transformers' (None: no prefix).
    include_prompt: False leaves a prompt's tokens out of the pooling (`moembed.model.prompts`).
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
        autocast: torch.dtype | None = None,
        similarity_fn_name: str = "cosine",
        default_prompt_name: str | None = None,
        include_prompt: bool = True,
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
        self.autocast = autocast
        self.backend: backends.Backend | None = None  # how `load` set inference up (moembed.model.backends)
        self.similarity_fn_name = similarity_fn_name
        if default_prompt_name is not None:
            prefix_of(self.prompts, None, default_prompt_name)  # an unknown name raises, listing the known ones
        self.default_prompt_name = default_prompt_name
        self.include_prompt = include_prompt

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
        normalize, prompts, include_prompt, name, calibration, source_dir, ...) replace them. Used by
        `moembed.model.convert`."""
        settings = dict(tokenizer=self.tokenizer, pooling=self.pooling, normalize=self.normalize, prompts=self.prompts,
                        name=self.name, calibration=self.calibration, source_dir=self.source_dir,
                        autocast=self.autocast, similarity_fn_name=self.similarity_fn_name)
        settings.update(default_prompt_name=self.default_prompt_name, include_prompt=self.include_prompt)
        settings.update(changes)
        return Embedder(encoder, **settings).train(self.training)

    # ---- model ------------------------------------------------------------------------------------------------

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, prompt_lengths=None) -> EmbedOutput:
        """prompt_lengths (B,): leading positions of each sequence pooling leaves out (None: none)."""
        out = self.encoder(input_ids, attention_mask, token_type_ids)
        lengths = out.attention_mask.sum(1)  # (B,)
        skip = torch.as_tensor(prompt_lengths, dtype=lengths.dtype) if prompt_lengths is not None else None
        emb = pool(out.packed_hidden, out.batch_index, lengths, self.pooling, skip)  # (B, d)
        return EmbedOutput(emb, out)

    # ---- prompts (`moembed.model.prompts`) --------------------------------------------------------------------

    def prefix(self, prompt: str | None) -> str:
        """The text prefix for a prompt name (None → the default prompt's, if any); unknown names raise."""
        return prefix_of(self.prompts, self.default_prompt_name, prompt)

    def prompt_text(self, prompt_name: str | None = None, prompt: str | None = None) -> str:
        """The prefix for `encode`'s prompt arguments: the literal `prompt`, or the text of `prompt_name` (not both)."""
        return prompt_text(self.prompts, self.default_prompt_name, prompt_name, prompt)

    def role_prompt(self, role: str) -> str | None:
        """The prompt name this model gives a "query" or a "document", None when it has none."""
        return role_prompt(self.prompts, role)

    def mark_prompt(self, ids: list[list[int]], prefix: str) -> list[list[int]]:
        """Token ids of `prefix + text` marked with the prefix's token count when pooling leaves it out
        (include_prompt false), so that `embed_ids` and the server pool them as sentence-transformers does."""
        if self.include_prompt or not prefix:
            return ids
        return mark_prompt(ids, prompt_token_count(self.tokenizer, prefix))  # one short tokenization

    # ---- inference --------------------------------------------------------------------------------------------

    def token_ids(self, texts: list[str], prefix: str = "") -> tuple[list[list[int]], int]:
        """Token ids of `prefix + text` per text (special tokens included, truncated to `max_length`) and the
        number of texts that were truncated. A long text is cut before tokenization, exactly: it costs what the
        model reads, not its length (`moembed.model.tokenizer`); a lone surrogate names its text. With
        include_prompt false each list carries the prefix's token count (`mark_prompt`)."""
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise MoembedError(f"texts[{i}]: expected a string, got {type(t).__name__}")
        ids, truncated = self.tokenizer.encode_ids(texts, prefix)
        return self.mark_prompt(ids, prefix), truncated

    @torch.inference_mode()
    def embed_ids(self, ids: list[list[int]]) -> torch.Tensor:
        """Pooled embeddings (n, d) float32 on the CPU, not normalised, of already tokenized texts: one padded
        forward pass (call on a model in eval mode, as `load` returns it)."""
        device = next(self.parameters()).device
        input_ids, mask = self.tokenizer.pad(ids)  # (n, T) each
        return self(input_ids.to(device), mask.to(device), prompt_lengths=prompt_lengths(ids)).embeddings.float().cpu()

    @torch.inference_mode()
    def embed_tensor(
        self,
        texts: list[str],
        prefix: str = "",
        batch_size: int = 32,
        amp: torch.dtype | None = None,
        show_progress: bool = False,
        desc: str = "encode",
        progress: Progress | None = None,
    ) -> torch.Tensor:
        """Pooled float32 embeddings (n, d), not normalised, in input order.

        amp: autocast dtype (torch.bfloat16 / torch.float16) or None; progress: called with (done, total) after
        each batch; show_progress draws a bar instead.
        """
        ids, truncated = self.token_ids(texts, prefix)
        if truncated:
            log.warning("%d of %d texts were longer than %d tokens and were truncated", truncated, len(texts), self.max_length)
        with bar(desc, enabled=show_progress and progress is None) as shown:
            return self.embed_batches(ids, batch_size, amp, progress or shown)

    @torch.inference_mode()
    def embed_batches(self, ids: list[list[int]], batch_size: int = 32, amp: torch.dtype | None = None,
                      progress: Progress | None = None) -> torch.Tensor:
        """Pooled float32 embeddings (n, d) of tokenized texts (`token_ids`) in input order: length-sorted batches
        of `embed_ids`, in eval mode, under autocast to `amp` when given."""
        if batch_size < 1:
            raise MoembedError(f"batch_size: must be >= 1, got {batch_size}")
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        cast = torch.autocast(device.type, dtype=amp) if amp is not None else nullcontext()
        try:
            with cast:
                (out,) = run_batches(ids, batch_size, self.embed_ids, (self.dim,), progress)
        finally:
            self.train(was_training)
        return out

    @torch.inference_mode()
    def token_embeddings(self, texts: list[str], prefix: str = "", batch_size: int = 32,
                         amp: torch.dtype | None = None) -> list[torch.Tensor]:
        """The last hidden states of each text's real tokens: one (tokens, hidden) float32 CPU tensor per text."""
        ids, _ = self.token_ids(texts, prefix)
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        out: list[torch.Tensor] = [torch.empty(0)] * len(ids)
        cast = torch.autocast(device.type, dtype=amp) if amp is not None else nullcontext()
        try:
            with cast:
                for idx in length_sorted_batches([len(x) for x in ids], batch_size):
                    input_ids, mask = self.tokenizer.pad([ids[i] for i in idx])  # (B, T) each
                    enc = self.encoder(input_ids.to(device), mask.to(device))
                    lengths = enc.attention_mask.sum(1).tolist()
                    # a sequence's tokens are contiguous and in order in the packed layout (encoder.py)
                    for i, rows in zip(idx, enc.packed_hidden.float().cpu().split(lengths)):
                        out[i] = rows  # (tokens_i, hidden)
        finally:
            self.train(was_training)
        return out

    def encode(
        self,
        sentences: list[str] | str,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        output_value: str = "sentence_embedding",
        precision: str = "float32",
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        device: str | None = None,
        normalize_embeddings: bool | None = None,
        truncate_dim: int | None = None,
        *,
        dim: int | None = None,
        normalize: bool | None = None,
        show_progress: bool | None = None,
        bf16: bool = False,
    ) -> np.ndarray | torch.Tensor | list[torch.Tensor]:
        """Embed sentences, with sentence-transformers' arguments and meanings (table in docs/models.md).

        prompt_name: a key of `self.prompts` (e.g. "search_query"); prompt: a literal prefix string (not both).
        precision: "float32" | "int8" | "uint8" (codes of the stored calibration's ranges, see `calibrate`) |
        "binary" (int8, signed packed bits) | "ubinary" (uint8, packed bits); packed outputs have ceil(dim / 8)
        columns. truncate_dim: Matryoshka truncation to the first components. normalize_embeddings: L2-normalise
        after truncation; None (default) follows the model (`self.normalize`), so a normalising model's truncated
        vectors are unit length again. output_value: "sentence_embedding" or "token_embeddings" (a list of
        (tokens, hidden) float32 tensors, one per sentence). device: move the model there first ("cpu", "cuda",
        "mps", "auto"). Output: numpy (n, ·) by default; a tensor with convert_to_tensor; a list of (·,) tensors
        with convert_to_numpy=False; one row for a single string.
        Aliases (moembed's older names): dim = truncate_dim, normalize = normalize_embeddings, show_progress =
        show_progress_bar. bf16: bfloat16 autocast for this call (else the autocast dtype `load` chose).
        """
        truncate_dim = _alias("truncate_dim", truncate_dim, "dim", dim)
        normalize_embeddings = _alias("normalize_embeddings", normalize_embeddings, "normalize", normalize)
        show = bool(_alias("show_progress_bar", show_progress_bar, "show_progress", show_progress))
        single = isinstance(sentences, str)
        texts = [sentences] if single else list(sentences)
        if precision not in PRECISIONS:
            raise MoembedError(f"precision: unknown {precision!r}; choose one of {', '.join(PRECISIONS)}")
        if output_value not in OUTPUT_VALUES:
            raise MoembedError(f"output_value: unknown {output_value!r}; choose one of {', '.join(OUTPUT_VALUES)}")
        if truncate_dim is not None and not 1 <= truncate_dim <= self.dim:
            raise MoembedError(f"truncate_dim: {truncate_dim} is out of range 1..{self.dim}")
        if precision in SCALAR and self.calibration is None:
            raise MoembedError(f"precision: {precision} {UNCALIBRATED}")
        prefix = self.prompt_text(prompt_name, prompt)
        if device is not None:
            self.to(resolve_device(device))
        amp = torch.bfloat16 if bf16 else self.autocast
        if output_value == "token_embeddings":
            tokens = self.token_embeddings(texts, prefix, batch_size, amp)
            return tokens[0] if single else tokens
        emb = self.embed_tensor(texts, prefix, batch_size, amp=amp, show_progress=show)
        x = self.postprocess(emb, truncate_dim, precision, normalize_embeddings)
        out = torch.from_numpy(x) if convert_to_tensor or not convert_to_numpy else x
        if not convert_to_tensor and not convert_to_numpy:
            out = list(out)
        return out[0] if single else out

    def encode_query(self, sentences: list[str] | str, prompt_name: str | None = None, prompt: str | None = None,
                     **kwargs):
        """`encode` with the model's query prompt ("query", else "search_query") unless a prompt is given."""
        return self.encode(sentences, *role_args(self.prompts, "query", prompt_name, prompt), **kwargs)

    def encode_document(self, sentences: list[str] | str, prompt_name: str | None = None, prompt: str | None = None,
                        **kwargs):
        """`encode` with the model's document prompt ("document", "passage", else "search_document")."""
        return self.encode(sentences, *role_args(self.prompts, "document", prompt_name, prompt), **kwargs)

    @property
    def similarity_fn_name(self) -> str:
        """"cosine" (default) or "dot": what `similarity` computes."""
        return self._similarity_fn

    @similarity_fn_name.setter
    def similarity_fn_name(self, name: str) -> None:
        self._similarity_fn = check_fn(name)

    def similarity(self, a, b) -> torch.Tensor:
        """Scores (n, m) float32 of embeddings a (n, d) against b (m, d), by `similarity_fn_name`."""
        return similarity(a, b, self.similarity_fn_name)

    def similarity_pairwise(self, a, b) -> torch.Tensor:
        """Scores (n,) float32 of row i of a with row i of b."""
        return similarity_pairwise(a, b, self.similarity_fn_name)

    def postprocess(self, emb: torch.Tensor, dim: int | None = None, precision: str = "float32",
                    normalize: bool | None = None) -> np.ndarray:
        """Pooled embeddings (n, d) from `embed_tensor` → truncated, normalised, quantised numpy output.

        Lets callers that need several dims or precisions of the same texts (evaluation sweeps) encode once.
        """
        norm = self.normalize if normalize is None else normalize
        x = truncate(emb, dim, norm).numpy()
        if precision in SCALAR:
            return quantize_scalar(x, self.int8_ranges(dim, norm), precision)
        if precision in ("binary", "ubinary"):
            return pack_bits(x, precision)
        return x

    def calibrate(self, texts: list[str], prompt_name: str | None = None, prompt: str | None = None,
                  max_samples: int = 10_000) -> None:
        """Store a sample of embeddings from which int8 / uint8 ranges are taken (arctic-embed-2 §2.5).

        The ranges are each dimension's min and max over the sample, after the same truncation and normalisation
        as the output: sentence-transformers' `quantize_embeddings(x, precision, calibration_embeddings=...)`
        given the sample's embeddings computes the same codes. `save` stores the sample with the model
        (`moembed.model.calibration` says which texts moembed samples when it trains or converts a model)."""
        texts = list(texts)[:max_samples]
        if not texts:
            raise MoembedError("calibrate: no texts given")
        self.calibration = self.embed_tensor(texts, self.prompt_text(prompt_name, prompt), amp=self.autocast).numpy()

    def int8_ranges(self, dim: int | None, normalize: bool = True) -> np.ndarray:
        """Per-dimension (low, high) ranges (2, dim) for the requested truncation, from the stored calibration."""
        if self.calibration is None:
            raise MoembedError(f"precision: int8 / uint8 output {UNCALIBRATED}")
        cal = truncate(torch.from_numpy(self.calibration), dim, normalize).numpy()
        return int8_ranges(cal)

    @property
    def compute(self) -> str:
        """The precision `encode` computes in: "float32", "bfloat16" / "float16" (the autocast `load` chose) or
        "int8" (`moembed.model.quantize.quantize_int8` switched on)."""
        if is_int8(self.encoder):
            return INT8
        return str(self.autocast).removeprefix("torch.") if self.autocast is not None else "float32"

    def settings_key(self) -> str:
        """Weights plus everything that changes `encode`'s float output: max length, Dynamic NTK, pooling,
        normalisation, the prompt prefixes and a compute precision other than float32 (16 hex digits). int8
        codes also depend on `calibration`."""
        settings = {"weights": weights_key(self), "max_length": self.max_length, "dynamic_ntk": self.config.dynamic_ntk,
                    "pooling": self.pooling, "normalize": self.normalize, "prompts": self.prompts}
        if self.default_prompt_name is not None:  # keys of models without one stay as they were
            settings["default_prompt"] = self.prefix(None)
        if not self.include_prompt:
            settings["include_prompt"] = False
        if self.compute != "float32":  # float32's key as it always was: caches made before stay valid
            settings["compute"] = self.compute
        return short_hash(json.dumps(settings, sort_keys=True))

    # ---- I/O: parts ↔ Embedder (moembed.model.io reads and writes the parts) -----------------------------------

    def parts(self) -> ModelParts:
        """Everything `save` writes: config, weights (detached, on the CPU), tokenizer and settings."""
        sd = {k: v.detach().cpu() for k, v in self.encoder.state_dict().items()}
        return ModelParts(self.config, sd, self.tokenizer, self.pooling, self.normalize, self.prompts, self.name,
                          self.calibration, self.source_dir, similarity_fn_name=self.similarity_fn_name,
                          default_prompt_name=self.default_prompt_name, include_prompt=self.include_prompt)

    @classmethod
    def from_parts(cls, parts: ModelParts) -> Embedder:
        """An Embedder in eval mode; weights that do not fit the config raise, naming the file and the weight."""
        encoder = Encoder.for_weights(parts.config)  # every weight is loaded below (`check_state`)
        check_state(encoder.state_dict(), parts.state_dict, parts.weights_path)
        encoder.load_state_dict(parts.state_dict)
        return cls(encoder, parts.tokenizer, pooling=parts.pooling, normalize=parts.normalize, prompts=parts.prompts,
                   name=parts.name, calibration=parts.calibration, source_dir=parts.source_dir,
                   similarity_fn_name=parts.similarity_fn_name,
                   default_prompt_name=parts.default_prompt_name, include_prompt=parts.include_prompt).eval()

    @classmethod
    def load(cls, path: str | Path, max_length: int | None = None, device: str | None = "cpu",
             dtype: str | None = "float32", pooling: str | None = None, backend: str = "auto") -> Embedder:
        """Load a moembed, Hugging Face (see `moembed.model.families`) or sentence-transformers directory.

        device: "cpu" (default), "cuda", "cuda:N", "mps" or "auto" (the accelerator when there is one); dtype: the
        inference autocast, "float32" (default), "bfloat16", "float16" or "auto" (bfloat16 on an accelerator), or
        "int8": dynamic int8 linear layers and experts, CPU only (`moembed.model.quantize.quantize_int8`); pooling:
        replaces the directory's (`pooling.POOLINGS`; a bare checkpoint pools by mean, as sentence-transformers does).
        backend: how inference runs (`moembed.model.backends`: "auto", "torch", "fast"), recorded in `backend`.
        Only local directories are read: a Hub name raises, saying how to download the model elsewhere."""
        dev = resolve_device(device)
        amp = resolve_dtype(dtype, dev)  # checks "int8" against the device before the weights are read
        settings = Settings.for_backend(backend)  # and the backend's name
        emb = apply(cls.from_parts(read_parts(path, max_length, pooling)).to(dev), settings)
        emb.autocast = amp
        if dtype == INT8:
            try:
                quantize_int8(emb)
            except RuntimeError as e:
                raise MoembedError(f"dtype: {e}") from None  # e: "int8: ..."
        emb.backend = backends.setup(emb, backend, settings, amp)
        return emb

    def save(self, path: str | Path, card: CardInfo | None = None) -> None:
        """Write the moembed format atomically, with a model card (`card`: what the caller knows of the model's
        training, `moembed.model.card`); the directory becomes this model's `source_dir`."""
        save_parts(self.parts(), path, card)
        self.source_dir = Path(path)

