"""Shard-by-shard curation of a pair file: consistency filtering and/or hard-negative mining, resumable.

    curate("pairs.jsonl", "kept.jsonl", "path/to/teacher", CurateConfig(shard_size=1_000_000, top_k=2))

The input is cut into shards of `shard_size` pairs; within a shard, documents compete with the other documents
of the same source (nomic-embed-v2 §4.2 filters each language in 1M-pair segments). For each shard the teacher
embeds the distinct queries and documents once; those embeddings serve both filtering and mining, so
`moembed mine --filter-top-k 2` curates in one pass. With `cache_embeddings` they are also kept in the work
directory (shard-NNNNN.emb.npz) and reused by a later run over the same input and teacher.

Each finished shard is written atomically into the work directory (shard-NNNNN.jsonl + shard-NNNNN.json with its
counts and a fingerprint of input rows and settings); a rerun skips shards whose fingerprint matches, so an
interrupted run resumes where it stopped and gives the same output. The final file is the concatenation of the
shards, written atomically, with a report (OUT.report.json) of kept fractions per source.

Under torchrun every rank reads the input and embeds its slice of each shard (`moembed.data.teacher.embed`);
rank 0 searches and writes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from moembed import distributed
from moembed.data.filtering import positive_rank
from moembed.data.mining import MiningConfig, mine
from moembed.data.pairs import ReadStats, iter_shards
from moembed.data.search import BACKENDS
from moembed.data.teacher import Teacher, embed, load_teacher
from moembed.devices import resolve_device
from moembed.errors import MoembedError
from moembed.fileio import atomic_path


class CurateConfig(BaseModel):
    """What to do with each shard: filter (top_k), mine (mining), or both."""

    model_config = ConfigDict(extra="forbid")

    shard_size: int = Field(1_000_000, ge=1)
    top_k: int | None = Field(2, ge=1)  # None: no consistency filtering
    mining: MiningConfig | None = None  # None: no mining
    batch_size: int = Field(32, ge=1)
    backend: str = "auto"
    bf16: bool = False
    cache_embeddings: bool = False
    device: str = "cpu"  # where the teacher runs: cpu | cuda | cuda:N | mps | auto (moembed.devices)
    # The teacher's token limit (None: its own). Give the training's lengths so that a pair is judged, and negatives
    # mined, on the text the model will be trained on; long passages then also cost no more than training sees.
    # Applies to a teacher given by path.
    max_length: int | None = Field(None, ge=2)

    @model_validator(mode="after")
    def _check(self) -> CurateConfig:
        if self.top_k is None and self.mining is None:
            raise ValueError("nothing to do: set top_k (filtering) and/or mining")
        resolve_device(self.device)  # an unknown or absent device fails here, listing the choices
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        return self


def _fingerprint(rows: list[dict], cfg: CurateConfig, teacher: str) -> str:
    h = hashlib.sha1()
    settings = cfg.model_dump(exclude={"batch_size", "bf16", "cache_embeddings", "backend", "device"})
    h.update(json.dumps([settings, str(teacher)], sort_keys=True).encode())
    for r in rows:
        h.update(json.dumps(r, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def _unique(texts: list[str]) -> tuple[list[str], np.ndarray]:
    """Distinct texts in first-seen order and the index of each input text among them."""
    ids: dict[str, int] = {}
    pos = np.array([ids.setdefault(t, len(ids)) for t in texts], dtype=np.int64)
    return list(ids), pos


def _embed_shard(teacher_fn, queries: list[str], docs: list[str], cfg: CurateConfig, cache: Path | None):
    key = hashlib.sha1(json.dumps([str(teacher_fn.path), queries, docs]).encode()).hexdigest()
    if cache is not None and cache.exists():
        with np.load(cache) as z:
            if str(z["key"]) == key:
                return z["q"], z["d"]
    teacher = teacher_fn()
    q = embed(teacher, queries, "query", cfg.batch_size, cfg.bf16)
    d = embed(teacher, docs, "document", cfg.batch_size, cfg.bf16)
    if cache is not None and distributed.rank() == 0:
        with atomic_path(cache) as tmp, open(tmp, "wb") as fh:
            np.savez(fh, q=q, d=d, key=np.array(key))
    return q, d


def _search_shard(rows, q_emb, q_pos, docs, d_emb, d_pos, cfg: CurateConfig) -> tuple[list[dict], dict]:
    """Filter and/or mine each source of the shard; rows come back in input order, with per-source counts."""
    sources: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        sources.setdefault(str(r["source"]), []).append(i)
    kept_rows: dict[int, dict] = {}
    counts = {}
    for source, sel in sources.items():
        sel = np.array(sel)
        doc_ids, own = np.unique(d_pos[sel], return_inverse=True)  # the source's documents; own: (n,) local
        Q, D = q_emb[q_pos[sel]], d_emb[doc_ids]  # (n, d), (m, d)
        rank = positive_rank(Q, D, own, cfg.top_k, cfg.backend) if cfg.top_k else np.zeros(len(sel), np.int64)
        keep = rank < (cfg.top_k or 1)  # consistency_keep's rule, with each kept pair's rank recorded
        counts[source] = {"pairs": len(sel), "kept": int(keep.sum())}
        k = np.flatnonzero(keep)
        negatives = [None] * len(k)
        if cfg.mining is not None:
            by_query: dict[int, set[int]] = {}
            for qi, di in zip(q_pos[sel], own):
                by_query.setdefault(int(qi), set()).add(int(di))
            positives = [by_query[int(q_pos[sel[j]])] for j in k]
            negatives = zip(*mine(Q[k], D, own[k], positives, cfg.mining, cfg.backend))
        for j, mined in zip(k, negatives):
            row = dict(rows[sel[j]])
            if cfg.top_k:
                row["positive_rank"] = int(rank[j])  # documents the teacher ranks above the pair's own (0: first)
            if mined is not None:
                row["negatives"] = [docs[doc_ids[x]] for x in mined[0]]
                row["negative_scores"] = mined[1]
            kept_rows[int(sel[j])] = row
    return [kept_rows[i] for i in sorted(kept_rows)], counts


class _LazyTeacher:
    """Loads the teacher on first use, so a fully resumed run never loads it. Also accepts a loaded `Teacher`."""

    def __init__(self, teacher: Teacher | str | Path, device: str = "cpu", max_length: int | None = None):
        loaded = not isinstance(teacher, (str, Path))
        self.device, self.max_length = device, max_length
        self._model = teacher if loaded else None
        self.path = str(teacher.name) if loaded else str(teacher)

    def __call__(self):
        if self._model is None:
            self._model = load_teacher(self.path, self.device, self.max_length)
        return self._model


def curate(data, out, teacher, cfg: CurateConfig, work_dir=None, skip_bad: bool = False,
           show_progress: bool = True) -> dict:
    """Filter and/or mine `data` into `out`; returns (and writes to OUT.report.json) the report."""
    from tqdm.auto import tqdm

    data, out = Path(data), Path(out)
    own_work = work_dir is None
    work = Path(work_dir) if work_dir is not None else out.with_name(out.name + ".work")
    if distributed.rank() == 0:
        work.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    teacher_fn = _LazyTeacher(teacher, cfg.device, cfg.max_length)
    stats, per_source, shards, resumed = ReadStats(), {}, 0, 0
    timing = {"embed_seconds": 0.0, "search_seconds": 0.0}
    bar = tqdm(desc="curate", unit="pair", disable=not show_progress or distributed.rank() != 0)
    for n, rows in enumerate(iter_shards(data, cfg.shard_size, skip_bad, stats)):
        shards += 1
        base = work / f"shard-{n:05d}"
        fp = _fingerprint(rows, cfg, teacher_fn.path)
        done = base.with_suffix(".json")
        finished = done.exists() and json.loads(done.read_text()).get("fingerprint") == fp
        if distributed.all_gather_object(finished)[0]:  # rank 0 decides for every rank
            counts = json.loads(done.read_text())["sources"]
            resumed += 1
        else:
            counts = _run_shard(rows, teacher_fn, cfg, base, fp, timing)
        for s, c in counts.items():
            acc = per_source.setdefault(s, {"pairs": 0, "kept": 0})
            acc["pairs"] += c["pairs"]
            acc["kept"] += c["kept"]
        bar.update(len(rows))
    bar.close()
    report = _report(data, out, stats, per_source, shards, resumed, timing)
    if distributed.rank() == 0:
        _concatenate(work, shards, out)
        with atomic_path(out.with_name(out.name + ".report.json")) as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n")
        if own_work:
            shutil.rmtree(work)
    distributed.barrier()
    return report


def _run_shard(rows, teacher_fn, cfg, base: Path, fp: str, timing: dict) -> dict:
    t0 = time.perf_counter()
    queries, q_pos = _unique([r["query"] for r in rows])
    docs, d_pos = _unique([r["document"] for r in rows])
    cache = base.with_suffix(".emb.npz") if cfg.cache_embeddings else None
    q_emb, d_emb = _embed_shard(teacher_fn, queries, docs, cfg, cache)
    t1 = time.perf_counter()
    timing["embed_seconds"] += t1 - t0
    if distributed.rank() != 0:
        return {}
    kept, counts = _search_shard(rows, q_emb, q_pos, docs, d_emb, d_pos, cfg)
    timing["search_seconds"] += time.perf_counter() - t1
    with atomic_path(base.with_suffix(".jsonl")) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for r in kept:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    with atomic_path(base.with_suffix(".json")) as tmp:
        tmp.write_text(json.dumps({"fingerprint": fp, "sources": counts}))
    return counts


def _concatenate(work: Path, shards: int, out: Path) -> None:
    with atomic_path(out) as tmp, open(tmp, "wb") as fh:
        for n in range(shards):
            part = work / f"shard-{n:05d}.jsonl"
            if not part.exists():
                raise MoembedError(f"{part}: missing shard result; rerun to complete it")
            fh.write(part.read_bytes())


def _report(data, out, stats: ReadStats, per_source: dict, shards: int, resumed: int, timing: dict) -> dict:
    for c in per_source.values():
        c["kept_fraction"] = c["kept"] / c["pairs"] if c["pairs"] else 0.0
    pairs = sum(c["pairs"] for c in per_source.values())
    kept = sum(c["kept"] for c in per_source.values())
    return {
        "input": str(data), "out": str(out), "pairs": pairs, "kept": kept,
        "kept_fraction": kept / pairs if pairs else 0.0, "dropped_empty": stats.dropped_empty,
        "bad_lines": len(stats.bad_lines), "bad_line_numbers": stats.bad_lines[:100], "shards": shards,
        "resumed_shards": resumed, **{k: round(v, 3) for k, v in timing.items()}, "sources": per_source,
    }
