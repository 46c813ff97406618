"""Sweeps: Matryoshka dimensions × output precisions, and retrieval at several maximum lengths.

Matryoshka/precision (arctic-embed-2 §2.5, §3): every task is scored at each (dim, precision); each result
carries the percentage of the full-dimension float32 score it retains (Arctic reports 99% of MTEB-R at 256 of
768 dims for its medium model). int8 ranges come from the model's calibration embeddings; a model without any
is calibrated on the texts of the tasks being evaluated (documents for retrieval), as arctic-embed-2 does with
a sample of its corpus.

Long context (nomic-embed-v1 §5.2.4, LoCo): retrieval tasks at several maximum lengths, each with and without
Dynamic NTK scaling of the rotary base (Eq. 5). Models with learned absolute positions cannot go beyond their
position table: their lengths are capped at `max_position` and the result notes it; Dynamic NTK does not
apply to them and is not toggled.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

from moembed.errors import MoembedError
from moembed.eval.encoding import EmbeddingCache, MemoryCache, View, encode_raw
from moembed.eval.registry import TASK_TYPES
from moembed.eval.runner import TaskResult, run_task
from moembed.eval.task import Task
from moembed.model.embedder import Embedder
from moembed.model.protocol import Quantizes, own_similarity


def retained(results: list[TaskResult]) -> list[TaskResult]:
    """Add `extra["retained_pct"]`: main score as % of the same task's full-dim float32 score."""
    full = {r.task_name: r.main_score for r in results if r.precision == "float32" and r.extra.get("full_dim")}
    for r in results:
        base = full.get(r.task_name)
        if base is not None:
            r.extra["retained_pct"] = round(100.0 * r.main_score / base, 2) if base else None
    return results


def calibration_sample(tasks: Sequence[Task], limit: int = 10_000) -> list[list[str]]:
    """Texts of the evaluated tasks that set int8 ranges (corpus documents first), one list per task, at most
    `limit` in all."""
    sample, n = [], 0
    for t in tasks:
        texts = TASK_TYPES[t.type].texts(t.data)[: limit - n]
        if texts:
            sample.append(texts)
            n += len(texts)
    return sample


def ensure_int8(model, tasks: Sequence[Task], cache: EmbeddingCache | None = None, batch_size: int = 32) -> str:
    """Calibrate the model on task texts if it has no int8 ranges yet; returns a note for the report.

    The sample is embedded through `cache` (in memory without one), one entry per task under the key that task's own
    float32 run uses for the same texts: a retrieval corpus of up to 10,000 documents is embedded once for
    calibration and scoring together (the quickstart's evaluation embedded its 2,772 test documents twice per model
    before, 44% of the texts it embedded). The ranges are each dimension's min and max after truncation and
    normalisation (`int8_ranges`), so normalised embeddings give the ranges that the unnormalised ones of
    `Embedder.calibrate` give."""
    if not isinstance(model, Quantizes):
        raise MoembedError(f"precision int8: model {model.name!r} has no calibrate()")
    if model.calibration is not None:
        return "int8 ranges from the model's stored calibration"
    sample = calibration_sample(tasks)
    prompt = "search_document" if "search_document" in (model.prompts or {}) else None
    cache = cache if cache is not None else MemoryCache()
    view = View(None, "float32", batch_size)
    model.calibration = np.concatenate([encode_raw(model, texts, prompt, view, cache) for texts in sample])
    return f"int8 ranges calibrated on {sum(map(len, sample))} task texts"


def matryoshka_sweep(model, tasks: Sequence[Task], dims: Sequence[int] | None, precisions: Sequence[str],
                     batch_size: int = 32, cache: EmbeddingCache | None = None, use_faiss: bool = False,
                     progress: bool = False) -> list[TaskResult]:
    """Score every task at each (dim, precision); the full dim float32 run is always included as reference."""
    if own_similarity(model) and (set(dims or []) - {model.dim} or set(precisions) - {"float32"}):
        raise MoembedError("--dims/--precisions: this model scores with its own similarity; sweep the base model")
    full = model.dim
    dims = sorted({full, *(dims or [])}, reverse=True)
    for d in dims:
        if not 1 <= d <= full:
            raise MoembedError(f"--dims: {d} is out of range 1..{full}")
    precisions = ["float32", *[p for p in precisions if p != "float32"]]
    cache = cache if cache is not None else MemoryCache()  # every point derived from one encode of each text
    note = ensure_int8(model, tasks, cache, batch_size) if {"int8", "uint8"} & set(precisions) else ""
    out = []
    grid = [(p, d, t) for p in precisions for d in dims for t in tasks]
    for p, d, t in tqdm(grid, desc="sweep", unit="run", disable=not progress):
        r = run_task(model, t, View(d, p, batch_size), cache, use_faiss and p == "float32")
        r.extra["full_dim"] = d == full
        r.note = note if p in ("int8", "uint8") else ""
        out.append(r)
    return retained(out)


def long_context_sweep(model, tasks: Sequence[Task], max_lengths: Sequence[int], batch_size: int = 32,
                       cache: EmbeddingCache | None = None, progress: bool = False) -> list[TaskResult]:
    """Retrieval at each maximum length, with and without Dynamic NTK (rotary models only)."""
    if not isinstance(model, Embedder):
        raise MoembedError("--max-lengths: needs a moembed Embedder (tokenizer and encoder config)")
    tok, cfg = model.tokenizer, model.config
    retrieval = [t for t in tasks if t.type == "retrieval"]
    if not retrieval:
        raise MoembedError("--max-lengths: no retrieval task among the given tasks")
    old_len, old_ntk = tok.max_length, cfg.dynamic_ntk
    rotary = cfg.position == "rotary"
    out = []
    try:
        for length in tqdm(max_lengths, desc="max lengths", unit="length", disable=not progress):
            used, note = length, ""
            if not rotary and length > cfg.max_position:
                used, note = cfg.max_position, f"capped at max_position {cfg.max_position} (absolute positions)"
            tok.set_max_length(used)
            for ntk in (True, False) if rotary else (None,):
                if ntk is not None:
                    cfg.dynamic_ntk = ntk
                for t in retrieval:
                    r = run_task(model, t, View(None, "float32", batch_size), cache)
                    r.note = note
                    r.extra["requested_max_length"] = length
                    out.append(r)
    finally:
        tok.set_max_length(old_len)
        cfg.dynamic_ntk = old_ntk
    return out
