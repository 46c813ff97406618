"""Retrieval on a BEIR-layout task: nDCG@10 (main), MRR@10, Recall@100.

Memory stays bounded on large corpora: the corpus is encoded `chunk_size` documents at a time, each chunk is
scored against the queries `query_block` at a time, and only a running top-k (k = 100, what the metrics need)
per query is kept — (n_queries, k) scores and indices, never the full (n_queries, n_docs) matrix nor all corpus
embeddings at once. With `use_faiss` each chunk is searched with an exact FAISS inner-product index instead
(cosine models only). Prefixes: queries "search_query", documents "search_document" (nomic-embed-v1 §5.2).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moembed.errors import MoembedError
from moembed.eval import readers
from moembed.eval.encoding import EmbeddingCache, View, encode, normalize, similarity
from moembed.eval.metrics import retrieval_scores
from moembed.eval.task import RunOptions, Task, TaskType
from moembed.model.protocol import own_similarity

TOP_K = 100


def merge_topk(best_s: np.ndarray, best_i: np.ndarray, s: np.ndarray, i: np.ndarray, k: int):
    """Merge candidate scores s (B, m) / indices i (B, m) into running top-k (B, k'), best first."""
    all_s = np.concatenate([best_s, s], axis=1)  # (B, k' + m)
    all_i = np.concatenate([best_i, i], axis=1)
    kk = min(k, all_s.shape[1])
    part = np.argpartition(-all_s, kk - 1, axis=1)[:, :kk] if kk < all_s.shape[1] else np.argsort(-all_s, axis=1)
    top_s = np.take_along_axis(all_s, part, 1)
    top_i = np.take_along_axis(all_i, part, 1)
    order = np.lexsort((top_i, -top_s), axis=1)  # by score desc, then index asc: deterministic ties
    return np.take_along_axis(top_s, order, 1), np.take_along_axis(top_i, order, 1)


def _chunk_topk(model, q: np.ndarray, d: np.ndarray, k: int, query_block: int, use_faiss: bool):
    """Top-k of one corpus chunk for every query: scores (n_q, k'), chunk-local indices (n_q, k')."""
    k = min(k, len(d))
    if use_faiss:
        import faiss

        index = faiss.IndexFlatIP(d.shape[1])
        index.add(np.ascontiguousarray(normalize(d), dtype=np.float32))
        s, i = index.search(np.ascontiguousarray(normalize(q), dtype=np.float32), k)
        return s, i.astype(np.int64)
    out_s, out_i = [], []
    for b in range(0, len(q), query_block):
        sims = similarity(model, q[b : b + query_block], d)  # (B, chunk)
        empty = np.empty((len(sims), 0))
        s, i = merge_topk(empty.astype(np.float32), empty.astype(np.int64), sims,
                          np.broadcast_to(np.arange(len(d)), sims.shape), k)
        out_s.append(s)
        out_i.append(i)
    return np.concatenate(out_s), np.concatenate(out_i)


def search(model, q: np.ndarray, corpus_chunks, k: int = TOP_K, query_block: int = 256, use_faiss: bool = False):
    """Top-k documents per query over an iterable of (offset, embeddings) corpus chunks.

    Returns scores (n_q, k) float32 and global corpus indices (n_q, k) int64, best first.
    """
    best_s = np.empty((len(q), 0), np.float32)
    best_i = np.empty((len(q), 0), np.int64)
    for offset, d in corpus_chunks:
        s, i = _chunk_topk(model, q, d, k, query_block, use_faiss)
        best_s, best_i = merge_topk(best_s, best_i, s.astype(np.float32), i + offset, k)
    return best_s, best_i


def run_retrieval(model, task: Task, view: View, cache: EmbeddingCache | None = None, chunk_size: int = 10_000,
                  query_block: int = 256, use_faiss: bool = False) -> dict[str, float]:
    """Scores of `model` on a loaded retrieval task."""
    if use_faiss and own_similarity(model):
        raise MoembedError("--faiss: this model scores with its own similarity function; FAISS needs cosine")
    data = task.data
    qids = sorted(data["qrels"])
    doc_ids = list(data["corpus"])
    q = encode(model, [data["queries"][x] for x in qids], Retrieval.query_prompt, view, cache)

    def chunks():
        for s in range(0, len(doc_ids), chunk_size):
            texts = [data["corpus"][x] for x in doc_ids[s : s + chunk_size]]
            yield s, encode(model, texts, Retrieval.document_prompt, view, cache)

    scores, idx = search(model, q, chunks(), TOP_K, query_block, use_faiss)
    run = {qid: {doc_ids[j]: float(s) for s, j in zip(scores[r], idx[r])} for r, qid in enumerate(qids)}
    return retrieval_scores(run, data["qrels"])


def read_retrieval(path: Path, split: str) -> dict:
    """corpus.jsonl, queries.jsonl and qrels/<split>.tsv; qrels must name known ids."""
    corpus = readers.id_texts(path / "corpus.jsonl", with_title=True)
    queries = readers.id_texts(path / "queries.jsonl", with_title=False)
    qfile = path / "qrels" / f"{split}.tsv"
    qrels: dict[str, dict[str, int]] = {}
    for i, qid, did, score in readers.read_qrels(qfile):
        if qid not in queries:
            raise MoembedError(f"{qfile}:{i}: unknown query-id {qid!r} (not in queries.jsonl)")
        if did not in corpus:
            raise MoembedError(f"{qfile}:{i}: unknown corpus-id {did!r} (not in corpus.jsonl)")
        qrels.setdefault(qid, {})[did] = score
    qrels = {q: d for q, d in qrels.items() if any(s > 0 for s in d.values())}
    if not qrels:
        raise MoembedError(f"{qfile}: empty task (no query has a relevant document)")
    return {"corpus": corpus, "queries": queries, "qrels": qrels}


class Retrieval(TaskType):
    """BEIR layout: `corpus.jsonl` {"_id","title","text"}, `queries.jsonl` {"_id","text"},
    `qrels/<split>.tsv` with header `query-id  corpus-id  score`."""

    name = "retrieval"
    main_score = "ndcg_at_10"
    query_prompt, document_prompt = "search_query", "search_document"
    detect_files = ("corpus.jsonl", "queries.jsonl", "qrels")

    def read(self, path: Path, split: str) -> dict:
        return read_retrieval(path, split)

    def run(self, model, task: Task, view: View, cache: EmbeddingCache | None, options: RunOptions) -> dict[str, float]:
        return run_retrieval(model, task, view, cache, options.chunk_size, options.query_block, options.use_faiss)

    def texts(self, data: dict) -> list[str]:
        return list(data["corpus"].values())
