"""MoEE: combining hidden-state (HS) and routing-weight (RW) embeddings (MoEE §3.3).

- `MoEEModel(source, mode)`: mode "hs" or "rw" gives that embedding L2-normalised; "concat" gives
  MoEE(concat) = [HS/‖HS‖ ; RW/‖RW‖] (the default). (With both blocks unit length, the cosine of two concat
  vectors is (cos_HS + cos_RW) / 2, i.e. it ranks like MoEE(sum) with α = 1.) "concat_raw" gives the paper's own
  MoEE(concat), e_final = [e_HS ; e_RW] ∈ R^{d_HS + d_RW} (§3.3), with neither block rescaled: the HS block, whose
  norm is typically orders of magnitude above RW's (each RW layer block sums to 1), then dominates its cosine.
- `SumModel(source, alpha)`: MoEE(sum), a model with its own similarity sim = cos_HS + α·cos_RW (eq. 6). Its
  `encode` returns the same concatenation, and `similarity(a, b)` splits it at `split` = d_HS.

Both implement `moembed.model.protocol.EmbeddingModel` (`encode`, `name`, `prompts`, `dim`, `settings_key`);
`SumModel` also has the `OwnSimilarity` capability. Unlike the reference code, nothing is standardised per
batch: an embedding never depends on the other texts of its batch.

    >>> m = load_moee("path/to/OLMoE-1B-7B", mode="sum", alpha=1.0, prompt="prompteol")
    >>> e = m.encode(["a cat", "a dog"]); m.similarity(e, e)   # (2, 2)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moembed.errors import MoembedError
from moembed.model.protocol import short_hash
from moembed.moee.extract import ExtractConfig, Features

MODES = ("hs", "rw", "concat", "concat_raw")


def combine(f: Features, mode: str) -> torch.Tensor:
    """Features → the embedding of `mode` (n, ·), float32."""
    if mode == "hs":
        return F.normalize(f.hs, dim=-1)
    if mode == "rw":
        return F.normalize(f.rw, dim=-1)
    if mode == "concat":
        return torch.cat([F.normalize(f.hs, dim=-1), F.normalize(f.rw, dim=-1)], dim=-1)  # (n, d_HS + d_RW)
    if mode == "concat_raw":  # MoEE §3.3: e_final = [e_HS ; e_RW], as extracted
        return torch.cat([f.hs.float(), f.rw.float()], dim=-1)  # (n, d_HS + d_RW)
    raise MoembedError(f"mode: unknown {mode!r}; choose one of {', '.join(MODES)}")


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity matrix (n, m) of rows of a (n, k) and b (m, k)."""
    a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
    return a @ b.T


class MoEEModel:
    """HS, RW or MoEE(concat) embeddings of an MoE source (`HFMoESource` or `EncoderMoESource`)."""

    def __init__(self, source, mode: str = "concat"):
        if mode not in MODES:
            raise MoembedError(f"mode: unknown {mode!r}; choose one of {', '.join(MODES)}")
        self.source = source
        self.mode = mode
        self.name = f"{source.name}+moee-{mode}"
        self.prompts = dict(source.prompts)

    def settings_key(self) -> str:
        """The source's key (weights and settings) and the mode: what keys evaluation caches."""
        return short_hash(json.dumps([self.source.settings_key(), self.mode], sort_keys=True))

    @property
    def dim(self) -> int:
        return {"hs": self.source.hs_dim, "rw": self.source.rw_dim}.get(self.mode, self.source.hs_dim + self.source.rw_dim)

    def _check(self, dim: int | None, precision: str) -> None:
        if dim is not None and dim != self.dim:
            raise MoembedError(f"truncate_dim: MoEE embeddings are not Matryoshka-trained; only the full {self.dim} is available")
        if precision != "float32":
            raise MoembedError(f"precision: MoEE embeddings are float32 only, got {precision!r}")

    def features(self, texts: list[str], prompt: str | None = None, batch_size: int = 32,
                 show_progress: bool = False) -> Features:
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise MoembedError(f"texts[{i}]: expected a string, got {type(t).__name__}")
        return self.source.features(texts, prompt=prompt, batch_size=batch_size, show_progress=show_progress)

    def encode(self, texts: list[str] | str, prompt_name: str | None = None, prompt: str | None = None, *,
               truncate_dim: int | None = None, precision: str = "float32", batch_size: int = 32,
               show_progress_bar: bool = False) -> np.ndarray:
        """Embed texts → float32 (n, dim); prompt_name as the source takes it (a prompt name of an encoder, a
        Table 2 template of a language model: see the source's docstring). A literal `prompt` is not supported."""
        if prompt is not None:
            raise MoembedError("prompt: MoEE models take prompt_name (a name of their prompts or templates), not a "
                               "literal prompt")
        self._check(truncate_dim, precision)
        single = isinstance(texts, str)
        texts = [texts] if single else list(texts)
        x = combine(self.features(texts, prompt_name, batch_size, show_progress_bar), self.mode).numpy()
        return x[0] if single else x


class SumModel(MoEEModel):
    """MoEE(sum): `encode` gives [HS/‖HS‖ ; RW/‖RW‖]; `similarity` gives cos_HS + α·cos_RW (MoEE eq. 6)."""

    def __init__(self, source, alpha: float = 1.0):
        super().__init__(source, mode="concat")
        if not np.isfinite(alpha):
            raise MoembedError(f"alpha: must be a finite number, got {alpha}")
        self.alpha = float(alpha)
        self.split = source.hs_dim  # columns [:split] are HS, [split:] are RW
        self.name = f"{source.name}+moee-sum{self.alpha:g}"

    def similarity(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(n, m) = cos(HS_a, HS_b) + α·cos(RW_a, RW_b) for encodings a (n, dim) and b (m, dim)."""
        a, b = np.atleast_2d(a), np.atleast_2d(b)
        if a.shape[-1] != self.dim or b.shape[-1] != self.dim:
            raise MoembedError(f"similarity: expected {self.dim} columns, got {a.shape[-1]} and {b.shape[-1]}")
        s = self.split
        return cosine(a[:, :s], b[:, :s]) + self.alpha * cosine(a[:, s:], b[:, s:])


def load_source(path: str | Path, extract: ExtractConfig | None = None, prompt: str | None = None,
                bf16: bool = True, load_in_8bit: bool = False, max_length: int | None = None, device: str | None = "cpu"):
    """An HS/RW source from a directory: a Hugging Face MoE causal LM, or a moembed MoE encoder.

    For a language model: `extract` picks the Table 5 variant, `prompt` the default Table 2 template, bf16 the
    weight dtype. For an encoder: HS is its pooled output and RW the mean over real tokens, so `extract` must be None or
    say mean pooling; `prompt` is unused (pass the model's prompt names to `encode(prompt_name=...)`).
    device: where the model runs ("cpu", "cuda", "mps", "auto": `moembed.devices`); 8-bit weights stay where
    bitsandbytes puts them.
    """
    from moembed.devices import resolve_device

    from moembed.moee.hf import is_hf_moe_dir, load_hf_moe

    path = Path(path)
    if is_hf_moe_dir(path):
        dev = resolve_device(device)
        source = load_hf_moe(path, dtype="bfloat16" if bf16 else "float32", load_in_8bit=load_in_8bit,
                             max_length=max_length or 512, extract=extract, prompt=prompt)
        if not load_in_8bit:
            source.decoder.to(dev)
        return source
    from moembed.model.embedder import Embedder
    from moembed.moee.encoder import EncoderMoESource

    if extract is not None and extract != ExtractConfig(rw_pooling="mean", hs_pooling="mean"):
        raise MoembedError(f"{path}: pooling options apply to language models; an encoder uses its own pooling for HS and the token mean for RW")
    if load_in_8bit:
        raise MoembedError(f"{path}: load_in_8bit applies to Hugging Face language models only")
    return EncoderMoESource(Embedder.load(path, max_length=max_length, device=device), bf16=bf16)


def load_moee(path: str | Path, mode: str = "concat", alpha: float = 1.0, **kwargs) -> MoEEModel:
    """`MoEEModel` (mode hs | rw | concat) or `SumModel` (mode "sum", weight `alpha`) for a model directory;
    other keyword arguments go to `load_source`."""
    if mode not in MODES + ("sum",):
        raise MoembedError(f"mode: unknown {mode!r}; choose one of {', '.join(MODES + ('sum',))}")
    source = load_source(path, **kwargs)
    return SumModel(source, alpha) if mode == "sum" else MoEEModel(source, mode)
