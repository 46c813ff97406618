"""Embedding texts for evaluation: Matryoshka dim, output precision, an optional disk cache, and similarity.

A model is a `moembed.model.protocol.EmbeddingModel`: `encode(texts, prompt_name=None, truncate_dim=None,
precision="float32", batch_size=32)`, `name`, `prompts`, `dim`, `settings_key()` (the cache key; only needed with a cache). Scores go
through the model's own `similarity(a, b) -> (n, m)` when it is not plain cosine (`own_similarity`: the MoEE sum
form, an Embedder with similarity_fn_name "dot"), through cosine similarity otherwise. Quantised outputs are mapped back to float vectors before scoring:
int8 / uint8 codes are dequantised with the model's calibration ranges (arctic-embed-2 §2.5) and packed binary
codes (signed "binary" or unsigned "ubinary": the same bits) are unpacked to ±1, whose inner product is d − 2·Hamming distance, so rankings equal Hamming ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moembed.errors import MoembedError
from moembed.fileio import atomic_path
from moembed.model.protocol import DerivesViews, Quantizes, own_similarity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class View:
    """How embeddings are taken: Matryoshka dim (None = full), precision, prompt names used by tasks."""

    dim: int | None = None
    precision: str = "float32"
    batch_size: int = 32


def prompt_name(model, name: str | None) -> str | None:
    """The prompt to pass to `model.encode`: `name` if the model knows it, else None (no prefix)."""
    return name if name is not None and name in model.prompts else None


def file_hash(path: str | Path) -> str:
    """sha256 (first 16 hex digits) of a file, e.g. a model directory's model.safetensors."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


class EmbeddingCache:
    """Embeddings on disk, keyed by the model's settings key + texts + prompt + dim + precision (+ the int8
    calibration sample), one directory per model key."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)

    def path(self, model, texts: list[str], prompt: str | None, view: View) -> Path:
        h = hashlib.sha256()
        for t in texts:
            h.update(t.encode("utf-8"))
            h.update(b"\0")
        model_key = self.model_key(model)
        key = {"model": model_key, "texts": h.hexdigest(), "prompt": prompt, "dim": view.dim,
               "precision": view.precision}
        if view.precision in ("int8", "uint8") and isinstance(model, Quantizes) and model.calibration is not None:
            # the codes depend on the calibration ranges and on the bucketing (floor into 256 buckets, as
            # sentence-transformers' quantize_embeddings; earlier entries rounded)
            key["quantizer"] = "floor256"
            key["calibration"] = hashlib.sha256(np.ascontiguousarray(model.calibration).tobytes()).hexdigest()[:16]
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return self.dir / model_key / f"{digest}.npy"

    def model_key(self, model) -> str:
        return model.settings_key()

    def get(self, path: Path) -> np.ndarray | None:
        return np.load(path) if path.exists() else None

    def put(self, path: Path, x: np.ndarray) -> None:
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            np.save(fh, x)


class MemoryCache(EmbeddingCache):
    """The same keys, held in memory for one run: a sweep without a cache directory embeds each text once, not once
    per (dim, precision) point. At most `budget` bytes are held (the full-dimension float32 embeddings of the texts
    evaluated: 1.5 GB for a million 384-dim documents); past it, entries are not kept and are embedded again when
    asked for, as without any cache, and a warning says to give a cache directory."""

    def __init__(self, budget: int = 2 << 30):
        super().__init__("memory")
        self.budget, self.held_bytes, self.warned = budget, 0, False
        self._held: dict[Path, np.ndarray] = {}
        self._models: dict[int, object] = {}

    def model_key(self, model) -> str:
        """The model's settings key, or this object's identity for a model without one (the cache keeps a reference,
        so that no other object takes the identity while its entries are held)."""
        if hasattr(model, "settings_key"):
            return model.settings_key()
        self._models[id(model)] = model
        return f"object-{id(model)}"

    def get(self, path: Path) -> np.ndarray | None:
        return self._held.get(path)

    def put(self, path: Path, x: np.ndarray) -> None:
        if self.held_bytes + x.nbytes > self.budget:
            if not self.warned:
                log.warning("embeddings past %.1f GB are not held in memory and are embedded again for each sweep "
                            "point; give a cache directory (--cache-dir) to keep them on disk", self.budget / 1e9)
                self.warned = True
            return
        self._held[path] = x
        self.held_bytes += x.nbytes


def _derivable(model, view: View) -> bool:
    """True when `view` is not the full float32 output and can be computed from it (see `DerivesViews`)."""
    full = view.dim in (None, model.dim) and view.precision == "float32"
    return not full and isinstance(model, DerivesViews) and model.normalize is True


def derive(model: DerivesViews, full: np.ndarray, view: View) -> np.ndarray:
    """The `model.encode(truncate_dim=view.dim, precision=view.precision)` output from full-dim float32 embeddings."""
    import torch

    return model.postprocess(torch.from_numpy(full), view.dim, view.precision)


def encode(model, texts: list[str], prompt: str | None, view: View, cache: EmbeddingCache | None = None) -> np.ndarray:
    """Embed texts (n, ·) as floats ready for `similarity`; cached when `cache` is given."""
    return to_float(model, encode_raw(model, texts, prompt, view, cache), view)


def encode_raw(model, texts: list[str], prompt: str | None, view: View, cache: EmbeddingCache | None = None):
    """`model.encode` output for `view` (int8 / packed binary stay as such), from the cache when possible."""
    if view.dim is not None and view.dim == model.dim:
        view = View(None, view.precision, view.batch_size)  # the full dim: one cache entry, however it is asked
    if _derivable(model, view):
        full = encode_raw(model, texts, prompt, View(None, "float32", view.batch_size), cache)
        return derive(model, full, view)
    prompt = prompt_name(model, prompt)
    path = cache.path(model, texts, prompt, view) if cache else None
    raw = cache.get(path) if cache else None
    if raw is None:
        raw = model.encode(texts, prompt_name=prompt, truncate_dim=view.dim, precision=view.precision,
                           batch_size=view.batch_size)
        raw = np.asarray(raw)
        if cache:
            cache.put(path, raw)
    return raw


def to_float(model, raw: np.ndarray, view: View) -> np.ndarray:
    """Map an encode output of `view.precision` back to float32 vectors."""
    if view.precision == "float32":
        return raw.astype(np.float32, copy=False)
    from moembed.model.pooling import SCALAR, dequantize_scalar, unpack_bits

    if view.precision in SCALAR:
        if not isinstance(model, Quantizes):
            raise MoembedError(f"precision {view.precision}: model {model.name!r} has no scalar-quantised output")
        return dequantize_scalar(raw, model.int8_ranges(view.dim))
    if view.precision in ("binary", "ubinary"):
        return unpack_bits(raw, view.dim or model.dim)
    raise MoembedError(f"precision: unknown {view.precision!r}")


def normalize(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(n, 1e-12)


def similarity(model, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Scores (n, m) of rows of `a` against rows of `b`: the model's own similarity if it has one, else cosine."""
    if own_similarity(model):
        return np.asarray(model.similarity(a, b), dtype=np.float32)
    return (normalize(a) @ normalize(b).T).astype(np.float32)


def pairwise(model, a: np.ndarray, b: np.ndarray, block: int = 512) -> np.ndarray:
    """Scores (n,) of row i of `a` with row i of `b`, computed in blocks so memory stays (block, block)."""
    if not own_similarity(model):
        return np.sum(normalize(a) * normalize(b), axis=-1).astype(np.float32)
    out = [np.diagonal(similarity(model, a[s : s + block], b[s : s + block])) for s in range(0, len(a), block)]
    return np.concatenate(out).astype(np.float32)
