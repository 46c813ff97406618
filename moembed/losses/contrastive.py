"""InfoNCE with in-batch and hard negatives, false-negative masking and Matryoshka prefixes, as pure functions.

Layout of the document matrix used throughout (one process, or the gathered batch of all ranks):

    docs = [d_0, ..., d_{B-1},                         # (B, d)   the positives, d_i belongs to query i
            n_{0,0}, ..., n_{0,H-1}, n_{1,0}, ...]     # (B·H, d) the hard negatives, query by query

Every query scores against every row, so the positives of other queries and the hard negatives of every query
are negatives (nomic-embed-v1 Eq. 2). Similarities are cosines; scale = 1/temperature (τ = 0.02 ⇔ scale 50).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from moembed.errors import MoembedError


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """Half-precision embeddings are scored in float32 (logits at scale 50 overflow bf16's mantissa)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def text_ids(texts: Sequence[str]) -> torch.Tensor:
    """(n,) int64 identities of texts, equal exactly when the texts are equal and the same on every process
    (blake2b, unlike Python's salted `hash`)."""
    digests = [hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest() for t in texts]
    return torch.tensor([int.from_bytes(d, "little", signed=True) for d in digests], dtype=torch.long)


def sequence_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) int64 identities of tokenised sequences (B, T): equal exactly when the real tokens are equal."""
    ids = input_ids.detach().cpu().long()
    lengths = attention_mask.detach().cpu().bool().sum(1)
    digests = [hashlib.blake2b(row[:n].numpy().tobytes(), digest_size=8).digest() for row, n in zip(ids, lengths)]
    return torch.tensor([int.from_bytes(d, "little", signed=True) for d in digests], dtype=torch.long)


def false_negative_mask(doc_ids: torch.Tensor, positive_index: torch.Tensor) -> torch.Tensor:
    """(B, M) bool, True where document j is a copy of query i's positive but not the positive itself.

    doc_ids: (M,) identities of the documents (`text_ids` / `sequence_ids`), in the `docs` layout.
    positive_index: (B,) row of each query's positive in `docs`.
    """
    doc_ids = doc_ids.to(positive_index.device)
    mask = doc_ids[positive_index][:, None] == doc_ids[None, :]  # (B, M)
    mask[torch.arange(len(positive_index), device=mask.device), positive_index] = False
    return mask


def info_nce(
    q: torch.Tensor,
    docs: torch.Tensor,
    positive_index: torch.Tensor,
    temperature: float,
    symmetric: bool = False,
    false_negative_mask: torch.Tensor | None = None,
    all_queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean InfoNCE loss of the queries `q` (nomic-embed-v1 Eq. 1–2), a scalar.

        L = -1/B Σ_i log( exp(s(q_i, d⁺_i)/τ) / Σ_j exp(s(q_i, docs_j)/τ) )   with s the cosine similarity.

    Args:
        q: (B, d) query embeddings (normalised here).
        docs: (M, d) documents in the layout of the module docstring (normalised here).
        positive_index: (B,) long, the row of `docs` holding each query's positive.
        temperature: τ > 0; logits are cosines × 1/τ.
        symmetric: average with the document→query term, where each query's positive scores against
            `all_queries` and must pick out its own query.
        false_negative_mask: (B, M) bool, True for documents to drop from query i's denominator (see
            `false_negative_mask`); its first `len(all_queries)` columns also mask the document→query term.
        all_queries: (Bg, d) the queries the document→query term ranks, with docs[:Bg] their positives in order
            (all ranks' queries when distributed); defaults to `q`, whose positives are then docs[:B].
    Example:
        >>> q, d = torch.randn(4, 8), torch.randn(4, 8)
        >>> float(info_nce(q, d, torch.arange(4), 0.05)) > 0
        True
    """
    q, docs = F.normalize(_as_float(q), dim=-1), F.normalize(_as_float(docs), dim=-1)
    logits = q @ docs.T / temperature  # (B, M)
    if false_negative_mask is not None:
        logits = logits.masked_fill(false_negative_mask, float("-inf"))
    loss = F.cross_entropy(logits, positive_index)
    if not symmetric:
        return loss
    queries = q if all_queries is None else F.normalize(_as_float(all_queries), dim=-1)
    # Row i: query i's positive against every query; its own query sits at column positive_index[i].
    reverse = docs[positive_index] @ queries.T / temperature  # (B, Bg)
    if false_negative_mask is not None:
        reverse = reverse.masked_fill(false_negative_mask[:, : queries.shape[0]], float("-inf"))
    return (loss + F.cross_entropy(reverse, positive_index)) / 2


def matryoshka_info_nce(
    q: torch.Tensor,
    docs: torch.Tensor,
    positive_index: torch.Tensor,
    temperature: float,
    dims: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
    symmetric: bool = False,
    false_negative_mask: torch.Tensor | None = None,
    all_queries: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Weighted sum of `info_nce` over embedding prefixes (Matryoshka Representation Learning, Kusupati et al.):

        L = Σ_k w_k · InfoNCE(q[:, :m_k], docs[:, :m_k])

    Each prefix is re-normalised before scoring, as truncated embeddings are at inference
    (`moembed.model.pooling.truncate`). nomic-embed-v2 §4 trains m = 768 and 256; arctic-embed-2 adds 256 to the
    full dimension. `dims=None` scores the full dimension only; `weights=None` weighs every prefix 1.
    Returns (total, {m_k: loss at m_k}).
    """
    full = q.shape[-1]
    dims = [full] if dims is None else list(dims)
    weights = [1.0] * len(dims) if weights is None else list(weights)
    if len(weights) != len(dims):
        raise MoembedError(f"matryoshka_weights: {len(weights)} weights for {len(dims)} dims")
    bad = [m for m in dims if not 1 <= m <= full]
    if bad:
        raise MoembedError(f"matryoshka_dims: {bad} out of range 1..{full}")
    per_dim: dict[int, torch.Tensor] = {}
    total = q.new_zeros((), dtype=_as_float(q).dtype)
    for m, w in zip(dims, weights):
        aq = None if all_queries is None else all_queries[:, :m]
        per_dim[m] = info_nce(q[:, :m], docs[:, :m], positive_index, temperature, symmetric, false_negative_mask, aq)
        total = total + w * per_dim[m]
    return total, per_dim
