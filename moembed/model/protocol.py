"""What "a model that embeds" is: the protocol evaluation, curation, MoEE and serving are written against.

`EmbeddingModel` is what every model offers: a name, its prompts, its dimension, `encode` and a settings key.
moembed's `Embedder`, the MoEE models (`moembed.moee`) and the sentence-transformers teacher
(`moembed.data.teacher`) implement it. What only some models can do is declared by a protocol of its own, so
callers test for a capability with `isinstance(model, Capability)`:

- `OwnSimilarity`: scores pairs with its own `similarity` instead of the cosine (MoEE(sum));
- `DerivesViews`: its output at any Matryoshka dim and precision is a function of its full float32 output
  (`postprocess`), so one encode serves a whole sweep;
- `Quantizes`: int8 output from per-dimension ranges of a calibration sample.

`encode`'s keywords are handled in one place per implementation (`Embedder.encode`, `MoEEModel.encode`,
`SentenceTransformerTeacher.encode`) and callers pass them in one place each (eval `encode_raw`, the teacher's
`embed`, the MTEB adapter).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import nn


@runtime_checkable
class EmbeddingModel(Protocol):
    """A model that embeds texts.

    name: a label for reports; prompts: prompt name → text prefix (may be empty); dim: the full output dimension.
    `encode(texts, prompt_name, prompt, truncate_dim, precision, batch_size, show_progress_bar)` → numpy
    (n, dim) (one row for a single string), with sentence-transformers' meanings: prompt_name is a name from
    `prompts` (None: no prefix), prompt a literal prefix (models that cannot take one raise), truncate_dim a
    Matryoshka truncation, precision "float32" | "int8" | "uint8" | "binary" | "ubinary" (what the model
    supports). Callers pass these as keywords. `settings_key()` identifies the weights and every
    setting that changes `encode`'s output (max length, pooling, ...): equal keys, equal embeddings; caches use it.
    """

    name: str
    prompts: dict[str, str]

    @property
    def dim(self) -> int: ...

    def encode(self, texts: list[str] | str, prompt_name: str | None = None, prompt: str | None = None, *,
               truncate_dim: int | None = None, precision: str = "float32", batch_size: int = 32,
               show_progress_bar: bool = False) -> np.ndarray: ...

    def settings_key(self) -> str: ...


@runtime_checkable
class OwnSimilarity(Protocol):
    """A model whose embeddings are compared with `similarity(a (n, k), b (m, k)) -> (n, m)`, not the cosine.

    The Embedder has a `similarity` too (sentence-transformers' API); it counts as its own only when its
    `similarity_fn_name` is not "cosine" (see `own_similarity`)."""

    def similarity(self, a: np.ndarray, b: np.ndarray) -> np.ndarray: ...


@runtime_checkable
class DerivesViews(Protocol):
    """A model whose encode output at (dim, precision) is `postprocess(full float32 pooled output, dim, precision)`.

    Matryoshka truncation followed by L2 normalisation does not depend on the vector's scale, so when `normalize`
    is on, one full-dimension encode serves every sweep point.
    """

    normalize: bool

    def postprocess(self, emb: torch.Tensor, dim: int | None = None, precision: str = "float32",
                    normalize: bool | None = None) -> np.ndarray: ...


@runtime_checkable
class Quantizes(Protocol):
    """A model with int8 output: ranges per dimension from a stored calibration sample (arctic-embed-2 §2.5)."""

    calibration: np.ndarray | None

    def calibrate(self, texts: list[str], prompt_name: str | None = None, prompt: str | None = None,
                  max_samples: int = 10_000) -> None: ...

    def int8_ranges(self, dim: int | None, normalize: bool = True) -> np.ndarray: ...


def own_similarity(model) -> bool:
    """Whether scores must go through `model.similarity`: an `OwnSimilarity` that is not plain cosine."""
    return isinstance(model, OwnSimilarity) and getattr(model, "similarity_fn_name", None) != "cosine"


# ---- helpers for settings keys ----------------------------------------------------------------------------------


def short_hash(text: str) -> str:
    """sha256 of a string, first 16 hex digits (the length of every moembed key)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def weights_key(module: nn.Module) -> str:
    """sha256 (16 hex digits) of a module's state dict, tensors in key order with their names.

    Hashing reads every weight, so the result is kept on the module and recomputed only when a tensor was
    replaced or changed in place (its storage or version counter moved: `load_state_dict`, an in-place update) or
    an optimizer stepped (a fused one moves neither: `moembed.model.updates`).
    """
    from moembed.model.updates import optimizer_steps  # torch's, loaded by a caller that holds a module

    sd = module.state_dict()
    stamp = (optimizer_steps(), *((k, v.data_ptr(), v._version) for k, v in sd.items()))
    cached = getattr(module, "_weights_key", None)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    h = hashlib.sha256(type(module).__name__.encode())
    for k, v in sd.items():
        t = v.detach().cpu()
        t = t.float() if t.is_floating_point() else t  # bf16 has no numpy dtype
        h.update(k.encode())
        h.update(t.contiguous().numpy().tobytes())
    key = h.hexdigest()[:16]
    module._weights_key = (stamp, key)
    return key
