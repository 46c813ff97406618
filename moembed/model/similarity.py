"""Similarity functions between embeddings, named as sentence-transformers names them.

    >>> similarity(a, b, "cosine")            # (n, m) float32 tensor
    >>> similarity_pairwise(a, b, "dot")      # (n,)   row i of a with row i of b

Inputs are numpy arrays or tensors of shape (n, d) / (m, d) (a single vector (d,) counts as one row); integer
inputs (int8 / uint8 codes) are compared as their float values. The result is a float32 CPU tensor.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from moembed.errors import MoembedError

SIMILARITY_FNS = ("cosine", "dot")


def _rows(x) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).detach().cpu().float()
    return t.unsqueeze(0) if t.dim() == 1 else t  # (n, d)


def check_fn(name: str) -> str:
    if name not in SIMILARITY_FNS:
        raise MoembedError(f"similarity_fn_name: unknown {name!r}; choose one of {', '.join(SIMILARITY_FNS)}")
    return name


def similarity(a, b, fn: str = "cosine") -> torch.Tensor:
    """Scores (n, m) of every row of `a` (n, d) against every row of `b` (m, d)."""
    a, b = _rows(a), _rows(b)
    if check_fn(fn) == "cosine":
        a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    return a @ b.T


def similarity_pairwise(a, b, fn: str = "cosine") -> torch.Tensor:
    """Scores (n,) of row i of `a` with row i of `b` (both (n, d))."""
    a, b = _rows(a), _rows(b)
    if a.shape != b.shape:
        raise MoembedError(f"similarity_pairwise: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
    if check_fn(fn) == "cosine":
        a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    return (a * b).sum(-1)
