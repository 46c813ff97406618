"""Teachers for filtering and mining: any model moembed loads, or a sentence-transformers model it cannot convert.

`load_teacher(path)` tries `Embedder.load` first (moembed, Hugging Face BERT, sentence-transformers over BERT).
A sentence-transformers directory with another architecture (e.g. all-mpnet-base-v2, MPNet) falls back to
`SentenceTransformerTeacher`. Both are `Teacher`s: `moembed.model.protocol.EmbeddingModel`s whose `encode` also
takes `normalize_embeddings` and `bf16`. `embed` embeds queries and documents L2-normalised (inner product = cosine) and,
under torchrun, splits the texts across ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from moembed import distributed
from moembed.devices import resolve_device
from moembed.errors import MoembedError
from moembed.model.embedder import Embedder
from moembed.model.protocol import EmbeddingModel, weights_key


@runtime_checkable
class Teacher(EmbeddingModel, Protocol):
    """An embedding model whose `encode` also takes `normalize_embeddings` (L2, for cosine search) and `bf16`
    (autocast)."""

    def encode(self, texts: list[str] | str, prompt_name: str | None = None, prompt: str | None = None, *,
               truncate_dim: int | None = None, precision: str = "float32", batch_size: int = 32,
               normalize_embeddings: bool | None = None, show_progress_bar: bool = False,
               bf16: bool = False) -> np.ndarray: ...


class SentenceTransformerTeacher:
    """A `sentence_transformers.SentenceTransformer` as a `Teacher` (float32 only)."""

    def __init__(self, path: str | Path, device: str | None = "cpu", max_length: int | None = None):
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise MoembedError(f"{path}: needs sentence-transformers; run `pip install sentence-transformers`") from None
        self.model = SentenceTransformer(str(path), device=str(resolve_device(device)), local_files_only=True)
        if max_length is not None:
            self.model.max_seq_length = min(max_length, self.model.max_seq_length or max_length)
        self.name = Path(path).name
        self.prompts = dict(self.model.prompts or {})
        dim_fn = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = dim_fn()

    def encode(self, texts, prompt_name=None, prompt=None, *, truncate_dim=None, precision="float32", batch_size=32,
               normalize_embeddings=True, show_progress_bar=False, bf16=False) -> np.ndarray:
        if precision != "float32":
            raise MoembedError(f"precision: a sentence-transformers teacher gives float32 only, not {precision!r}")
        if prompt is not None and prompt_name is not None:
            raise MoembedError(f"prompt and prompt_name: give one, not both (got {prompt!r} and {prompt_name!r})")
        if prompt_name is not None and prompt_name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise MoembedError(f"prompt_name: unknown {prompt_name!r}; this model knows: {known}")
        prefix = prompt if prompt is not None else self.prompts.get(prompt_name, "") if prompt_name else ""
        x = self.model.encode([prefix + t for t in texts], batch_size=batch_size, convert_to_numpy=True,
                              normalize_embeddings=False, show_progress_bar=show_progress_bar)
        x = x[:, :truncate_dim] if truncate_dim else x
        if normalize_embeddings:
            x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        return x.astype(np.float32)

    def settings_key(self) -> str:
        return weights_key(self.model)


def load_teacher(path: str | Path, device: str | None = "cpu", max_length: int | None = None) -> Teacher:
    """An `Embedder` when moembed reads the directory, else a `SentenceTransformerTeacher`, on `device`; texts cut
    to `max_length` tokens when that is below the model's own limit."""
    try:
        emb = Embedder.load(path, device=device)
        if max_length is not None and max_length < emb.max_length:
            emb.tokenizer.set_max_length(max_length)
        return emb
    except MoembedError as first:
        modules = Path(path) / "modules.json"
        if not modules.exists():
            raise
        try:
            json.loads(modules.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            raise first from None
        return SentenceTransformerTeacher(path, device, max_length)


def _prompt(teacher: Teacher, name: str) -> str | None:
    # A missing prompt means "no prefix" (e.g. all-MiniLM-L6-v2 has none; Nomic models have search_query).
    return name if name in teacher.prompts else None


def embed(teacher: Teacher, texts: list[str], role: str, batch_size: int = 32, bf16: bool = False,
          show_progress: bool = False) -> np.ndarray:
    """L2-normalised float32 (n, d) embeddings; role "query" or "document" picks the search prompt.

    Under torchrun each rank embeds texts[rank::world] and the slices are gathered in input order, so every rank
    returns the full array.
    """
    prompt = _prompt(teacher, "search_query" if role == "query" else "search_document")
    rank, world = distributed.rank(), distributed.world_size()
    mine = texts[rank::world]
    x = teacher.encode(mine, prompt_name=prompt, batch_size=batch_size, normalize_embeddings=True,
                       show_progress_bar=show_progress, bf16=bf16) if mine else None
    if world == 1:
        return x if x is not None else np.zeros((0, 0), np.float32)
    parts = distributed.all_gather_object(x)
    d = next(p.shape[1] for p in parts if p is not None)
    out = np.empty((len(texts), d), np.float32)
    for r, p in enumerate(parts):
        if p is not None:
            out[r::world] = p  # rank r embedded texts r, r + world, r + 2·world, ...
    return out
