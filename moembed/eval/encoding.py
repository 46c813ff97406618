"""Embedding texts for evaluation: Matryoshka dim, output precision, an optional disk cache, and similarity.

A model is anything with `encode(texts, prompt=None, dim=None, precision="float32", batch_size=32)`, `name`,
`prompts` and `dim`. Scores go through `model.similarity(a, b) -> (n, m)` when the model defines it (the MoEE
sum form), through cosine similarity otherwise. Quantised outputs are mapped back to float vectors before
scoring: int8 codes are dequantised with the model's calibration ranges (arctic-embed-2 §2.5) and packed
binary codes are unpacked to ±1, whose inner product is d − 2·Hamming distance, so rankings equal Hamming ones.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moembed.errors import MoembedError
from moembed.fileio import atomic_path


@dataclass(frozen=True)
class View:
    """How embeddings are taken: Matryoshka dim (None = full), precision, prompt names used by tasks."""

    dim: int | None = None
    precision: str = "float32"
    batch_size: int = 32


def prompt_name(model, name: str | None) -> str | None:
    """The prompt to pass to `model.encode`: `name` if the model knows it, else None (no prefix)."""
    if name is None:
        return None
    return name if name in (getattr(model, "prompts", None) or {}) else None


def content_hash(model) -> str:
    """A hash of the model's weights (state dict tensors in key order), or of a wrapped model's."""
    if hasattr(model, "content_hash") and isinstance(model.content_hash, str):
        return model.content_hash
    target = model
    for _ in range(3):  # wrappers (MoEE models, sources) hold the weighted model a few levels down
        if hasattr(target, "state_dict"):
            break
        target = next((getattr(target, a) for a in ("model", "source", "embedder", "lm") if hasattr(target, a)), target)
    if not hasattr(target, "state_dict"):
        raise MoembedError(f"model {getattr(model, 'name', '?')!r}: cannot hash its weights for the cache")
    h = hashlib.sha256(type(model).__name__.encode())
    for k, v in target.state_dict().items():
        t = v.detach().cpu()
        t = t.float() if t.is_floating_point() else t  # bf16 has no numpy dtype
        h.update(k.encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def file_hash(path: str | Path) -> str:
    """sha256 (first 16 hex digits) of a file, e.g. a model directory's model.safetensors."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _state_key(model) -> dict:
    """Settings outside the weights that change embeddings: max length and Dynamic NTK."""
    tok = getattr(model, "tokenizer", None)
    enc = getattr(model, "encoder", None)
    cal = getattr(model, "calibration", None)
    return {
        "max_length": getattr(tok, "max_length", None),
        "dynamic_ntk": getattr(getattr(enc, "config", None), "dynamic_ntk", None),
        # int8 codes depend on the calibration ranges
        "calibration": None if cal is None else hashlib.sha256(np.ascontiguousarray(cal).tobytes()).hexdigest()[:16],
    }


class EmbeddingCache:
    """Embeddings on disk keyed by model content hash + texts hash + prompt + dim + precision (+ length)."""

    def __init__(self, directory: str | Path, model_hash: str):
        self.dir = Path(directory)
        self.model_hash = model_hash

    def path(self, model, texts: list[str], prompt: str | None, view: View) -> Path:
        h = hashlib.sha256()
        for t in texts:
            h.update(t.encode("utf-8"))
            h.update(b"\0")
        key = {"model": self.model_hash, "texts": h.hexdigest(), "prompt": prompt, "dim": view.dim,
               "precision": view.precision, **_state_key(model)}
        if view.precision != "int8":
            key.pop("calibration")
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return self.dir / self.model_hash / f"{digest}.npy"

    def get(self, path: Path) -> np.ndarray | None:
        return np.load(path) if path.exists() else None

    def put(self, path: Path, x: np.ndarray) -> None:
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            np.save(fh, x)


def _derivable(model, view: View) -> bool:
    """True when `view` can be computed from the full-dim float32 output (a normalising moembed Embedder).

    Matryoshka truncation then L2 normalisation does not depend on the vector's scale, and int8 / binary are
    functions of the truncated vector, so one full encode serves every sweep point (parity-tested).
    """
    full = view.dim in (None, getattr(model, "dim", None)) and view.precision == "float32"
    return not full and getattr(model, "normalize", None) is True and hasattr(model, "postprocess")


def derive(model, full: np.ndarray, view: View) -> np.ndarray:
    """The `model.encode(dim=view.dim, precision=view.precision)` output from full-dim float32 embeddings."""
    import torch

    return model.postprocess(torch.from_numpy(full), view.dim, view.precision)


def encode(model, texts: list[str], prompt: str | None, view: View, cache: EmbeddingCache | None = None) -> np.ndarray:
    """Embed texts (n, ·) as floats ready for `similarity`; cached when `cache` is given."""
    return to_float(model, encode_raw(model, texts, prompt, view, cache), view)


def encode_raw(model, texts: list[str], prompt: str | None, view: View, cache: EmbeddingCache | None = None):
    """`model.encode` output for `view` (int8 / packed binary stay as such), from the cache when possible."""
    if view.dim is not None and view.dim == getattr(model, "dim", None):
        view = View(None, view.precision, view.batch_size)  # the full dim: one cache entry, however it is asked
    if _derivable(model, view):
        full = encode_raw(model, texts, prompt, View(None, "float32", view.batch_size), cache)
        return derive(model, full, view)
    prompt = prompt_name(model, prompt)
    path = cache.path(model, texts, prompt, view) if cache else None
    raw = cache.get(path) if cache else None
    if raw is None:
        raw = model.encode(texts, prompt=prompt, dim=view.dim, precision=view.precision, batch_size=view.batch_size)
        raw = np.asarray(raw)
        if cache:
            cache.put(path, raw)
    return raw


def to_float(model, raw: np.ndarray, view: View) -> np.ndarray:
    """Map an encode output of `view.precision` back to float32 vectors."""
    if view.precision == "float32":
        return raw.astype(np.float32, copy=False)
    from moembed.model.pooling import dequantize_int8, unpack_binary

    dim = view.dim or model.dim
    if view.precision == "int8":
        return dequantize_int8(raw, model.int8_ranges(view.dim))
    if view.precision == "binary":
        return unpack_binary(raw, dim)
    raise MoembedError(f"precision: unknown {view.precision!r}")


def normalize(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(n, 1e-12)


def similarity(model, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Scores (n, m) of rows of `a` against rows of `b`: model.similarity if defined, else cosine."""
    if hasattr(model, "similarity"):
        return np.asarray(model.similarity(a, b), dtype=np.float32)
    return (normalize(a) @ normalize(b).T).astype(np.float32)


def pairwise(model, a: np.ndarray, b: np.ndarray, block: int = 512) -> np.ndarray:
    """Scores (n,) of row i of `a` with row i of `b`, computed in blocks so memory stays (block, block)."""
    if not hasattr(model, "similarity"):
        return np.sum(normalize(a) * normalize(b), axis=-1).astype(np.float32)
    out = [np.diagonal(similarity(model, a[s : s + block], b[s : s + block])) for s in range(0, len(a), block)]
    return np.concatenate(out).astype(np.float32)
