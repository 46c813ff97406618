"""Run the real MTEB with a moembed model: `MtebEncoder` implements mteb 2.x's `EncoderProtocol`.

    >>> import mteb
    >>> from moembed.eval.mteb_adapter import MtebEncoder
    >>> enc = MtebEncoder("path/to/model", device="auto")          # or MtebEncoder(an EmbeddingModel)
    >>> mteb.evaluate(enc, mteb.get_tasks(tasks=["SciFact"]))       # needs internet for the task data

The protocol: `__init__(model_name, revision, *, device)`, `encode(inputs, *, task_metadata, hf_split,
hf_subset, prompt_type, **kwargs)`, `similarity(a, b)` (n, m) and `similarity_pairwise(a, b)` (n,), and
`mteb_model_meta`. mteb calls `encode(inputs, *, task_metadata, hf_split, hf_subset, prompt_type=None, **kwargs)` with a DataLoader
of batches {"text": [...]} and expects an array (n, d). The prefix is that of the matching moembed task type
(`moembed.eval.registry.TASK_TYPES`, the Nomic convention of nomic-embed-v1 §5.1): retrieval-like tasks use
"search_query" for queries and "search_document" for documents; classification uses "classification",
clustering "clustering"; STS, pair classification, bitext mining, summarization and regression (symmetric
tasks, read as STS) use "classification". A model without the named prompt gets no prefix. `similarity` and
`similarity_pairwise` are the model's own when it scores otherwise than by cosine (MoEE sum form, an Embedder
with similarity_fn_name "dot"), cosine otherwise; mteb's STS and pair-classification "similarity" scores use them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moembed.eval.encoding import pairwise, prompt_name
from moembed.eval.encoding import similarity as _similarity
from moembed.eval.registry import TASK_TYPES

# MTEB's task types → the moembed task type whose prompts they take.
MTEB_TYPES = {
    "Retrieval": "retrieval",
    "InstructionRetrieval": "retrieval",
    "Reranking": "reranking",
    "InstructionReranking": "reranking",
    "Classification": "classification",
    "MultilabelClassification": "classification",
    "Clustering": "clustering",
    "STS": "sts",
    "PairClassification": "pair_classification",
    "BitextMining": "sts",
    "Summarization": "sts",
    "Regression": "sts",
}


def prompt_for(task_type: str, prompt_type: Any | None) -> str | None:
    """The moembed prompt name for an MTEB task type and PromptType ("query" | "document" | None).

    An explicit query or document role takes the retrieval prompts, whatever the task type."""
    kind = getattr(prompt_type, "value", prompt_type)
    own = TASK_TYPES["retrieval"] if kind in ("query", "document") else TASK_TYPES.get(MTEB_TYPES.get(task_type, ""))
    if own is None:
        return None
    return own.document_prompt if kind == "document" else own.query_prompt


def _texts(inputs) -> list[str]:
    """Texts from a DataLoader of {"text": [...]} batches (or from a plain list of strings)."""
    if isinstance(inputs, str):
        return [inputs]
    texts: list[str] = []
    for item in inputs:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, dict):
            texts.extend(item["text"])
        else:
            raise TypeError(f"mteb input: expected strings or batches with a 'text' field, got {type(item).__name__}")
    return texts


class MtebEncoder:
    """mteb EncoderProtocol over a moembed `EmbeddingModel` (`encode`, `name`, `prompts`, `dim`, `settings_key`)."""

    def __init__(self, model, revision: str | None = None, *, device: str | None = None, batch_size: int = 32,
                 dim: int | None = None):
        """model: an `EmbeddingModel`, or the path of a model directory, loaded with `Embedder.load` on `device`
        ("auto" when None); revision: unused (a directory is its own revision, see `mteb_model_meta`)."""
        if isinstance(model, (str, Path)):
            from moembed.model.embedder import Embedder

            model = Embedder.load(model, device=device or "auto")
        self.model = model
        self.batch_size = batch_size
        self.dim = dim

    def encode(self, inputs, *, task_metadata, hf_split: str = "", hf_subset: str = "", prompt_type=None,
               **kwargs) -> np.ndarray:
        prompt = prompt_name(self.model, prompt_for(task_metadata.type, prompt_type))
        texts = _texts(inputs)
        x = self.model.encode(texts, prompt_name=prompt, truncate_dim=self.dim,
                              batch_size=kwargs.get("batch_size", self.batch_size))
        return np.asarray(x, dtype=np.float32)

    def similarity(self, embeddings1, embeddings2) -> np.ndarray:
        return _similarity(self.model, np.atleast_2d(np.asarray(embeddings1)), np.atleast_2d(np.asarray(embeddings2)))

    def similarity_pairwise(self, embeddings1, embeddings2) -> np.ndarray:
        return pairwise(self.model, np.atleast_2d(np.asarray(embeddings1)), np.atleast_2d(np.asarray(embeddings2)))

    @property
    def mteb_model_meta(self):
        from mteb.models.model_meta import ModelMeta

        name = self.model.name if "/" in self.model.name else f"moembed/{self.model.name}"
        try:
            revision = self.model.settings_key()
        except Exception:  # a model without a settings key still runs; MTEB only files results by revision
            revision = "unknown"
        fn = getattr(self.model, "similarity_fn_name", "cosine")
        return ModelMeta.create_empty({"name": name, "revision": revision, "embed_dim": self.dim or self.model.dim,
                                       "similarity_fn_name": fn, "framework": ["PyTorch"]})
