"""Top-k inner-product search: FAISS (`faiss-cpu`, IndexFlatIP) or an exact blockwise numpy fallback.

Both take L2-normalised float32 queries (n, d) and documents (m, d) — so scores are cosines — and return
`(scores, indices)`, each (n, k) with k = min(k, m), best first.
"""

from __future__ import annotations

import logging

import numpy as np

from moembed.errors import MoembedError

BACKENDS = ("auto", "faiss", "exact")


def search_exact(queries: np.ndarray, docs: np.ndarray, k: int, block: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by blocks of `block` queries: memory is block × m scores, not n × m."""
    k = min(k, docs.shape[0])
    n = queries.shape[0]
    scores, idx = np.empty((n, k), np.float32), np.empty((n, k), np.int64)
    for s in range(0, n, block):
        sim = queries[s : s + block] @ docs.T  # (b, m)
        part = np.argpartition(-sim, k - 1, axis=1)[:, :k]  # (b, k) unordered top-k
        part_scores = np.take_along_axis(sim, part, axis=1)
        order = np.argsort(-part_scores, axis=1, kind="stable")  # (b, k) best first
        idx[s : s + block] = np.take_along_axis(part, order, axis=1)
        scores[s : s + block] = np.take_along_axis(part_scores, order, axis=1)
    return scores, idx


def _import_faiss():
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # it reports which SIMD build it loaded
    import faiss

    return faiss


def search_faiss(queries: np.ndarray, docs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    faiss = _import_faiss()

    k = min(k, docs.shape[0])
    index = faiss.IndexFlatIP(docs.shape[1])
    index.add(np.ascontiguousarray(docs, dtype=np.float32))
    scores, idx = index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
    return scores, idx.astype(np.int64)


def search(queries: np.ndarray, docs: np.ndarray, k: int, backend: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """Top-k by inner product; backend "auto" uses FAISS when installed, else the exact fallback."""
    if backend not in BACKENDS:
        raise MoembedError(f"backend: unknown {backend!r}; choose one of {', '.join(BACKENDS)}")
    if k < 1:
        raise MoembedError(f"top_k: must be >= 1, got {k}")
    if docs.shape[0] == 0:
        return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
    if backend == "auto":
        try:
            _import_faiss()
            backend = "faiss"
        except ImportError:
            backend = "exact"
    if backend == "faiss":
        return search_faiss(queries, docs, k)
    return search_exact(queries, docs, k)
