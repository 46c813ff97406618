"""The recipe's data stages: build the pairs (built-in corpora or the user's files), then curate them.

    build_data(ctx)  OUT/data/train.jsonl and the held-out BEIR test (and dev) sets, from the user's files
                     (`data.files`), a data suite (`data_suite`, moembed.recipes.config.DATA_SUITES: one source
                     per language or language pair, test sets per language and cross-lingual) or the built-in
                     corpora (`datasets`), in that order of precedence
    curate(ctx)      consistency filtering + positive-aware mining with the teacher (moembed.data.curate), one
                     embedding pass for both; then one training file per source, OUT/train/<source>.jsonl, so
                     every batch comes from a single source (nomic-embed-v1 §4.2.2). With a pretraining stage
                     also OUT/pretrain/<source>.jsonl: the larger, noisier pool (a looser top-k, no negative
                     needed) that stage 1 trains on, of which the finetuning pairs are a subset

Negatives given in the user's records (`given_negatives` in train.jsonl) are combined with mined ones as
`data.negatives` says (moembed.recipes.config.UserData).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from moembed.errors import MoembedError
from moembed.fileio import atomic_dir, iter_jsonl, write_jsonl

if TYPE_CHECKING:
    from moembed.recipes.context import RecipeContext

log = logging.getLogger("moembed")


def held_out_dirs(ctx: RecipeContext) -> dict[str, Path]:
    """Name → BEIR test directory of every held-out set the recipe evaluates on (besides the dev suite)."""
    if ctx.cfg.user_data:
        from moembed.recipes.userdata import task_name

        return {task_name(ctx.cfg): ctx.out / "data" / "user" / "test"}
    if ctx.cfg.data_suite:
        return {name: Path(t["path"]) for name, t in ctx.stage_result("data")["test_sets"].items()}
    return {name: ctx.out / "data" / name / "test" for name in ctx.cfg.datasets}


def suite_function(name: str):
    """The builder registered as DATA_SUITES[name] ("module:function", or the function itself)."""
    import importlib

    from moembed.recipes.config import DATA_SUITES

    target = DATA_SUITES[name]
    if callable(target):
        return target
    module, _, fn = target.partition(":")
    try:
        return getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise MoembedError(f"data_suite {name!r}: {target} is not available in this installation ({e})") from None


def _count_lines(path: Path) -> int:
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def _build_suite(ctx: RecipeContext) -> dict:
    """A data suite's sources → OUT/data/train.jsonl (each row tagged with its source's label), test sets listed
    with their languages in the stage result."""
    c = ctx.cfg
    sources, tests = suite_function(c.data_suite)(ctx.out / "data" / c.data_suite, c.size, c.seed)
    per_source = {}

    def rows():
        for src in sources:
            n = 0
            for _, r in iter_jsonl(src.path):
                n += 1
                yield {"query": r[src.query_field], "document": r[src.document_field], "source": src.label,
                       "lang": src.lang or ""}
            per_source[src.label] = n

    n = write_jsonl(ctx.out / "data" / "train.jsonl", rows())
    test_sets = {name: {"path": str(t.path), "query_lang": t.query_lang, "doc_lang": t.doc_lang,
                        "queries": _count_lines(Path(t.path) / "queries.jsonl"),
                        "documents": _count_lines(Path(t.path) / "corpus.jsonl")} for name, t in tests.items()}
    datasets = {name: {"train": per_source.get(name), "test": {"queries": t["queries"], "documents": t["documents"]}}
                for name, t in test_sets.items()}
    return {"train_pairs": n, "suite": c.data_suite, "train_sources": per_source, "test_sets": test_sets,
            "datasets": datasets}


def build_data(ctx: RecipeContext) -> dict:
    if not ctx.cfg.user_data and ctx.cfg.data_suite:
        return _build_suite(ctx)
    if ctx.cfg.user_data:
        from moembed.recipes.userdata import prepare_user_data

        meta = prepare_user_data(ctx.cfg, ctx.out / "data" / "user")
        shutil.copy2(ctx.out / "data" / "user" / "train.jsonl", ctx.out / "data" / "train.jsonl")
        name = next(iter(held_out_dirs(ctx)))
        return {"train_pairs": meta["train"], "user": meta,
                "datasets": {name: {"train": meta["train"], "test": meta["test"]}}}
    from moembed.data.corpora import build_dataset

    size = ctx.cfg.split_sizes()
    counts = {}
    for name in ctx.cfg.datasets:
        d = ctx.out / "data" / name
        if (d / "meta.json").exists():
            counts[name] = json.loads((d / "meta.json").read_text())
            continue
        counts[name] = build_dataset(name, d, seed=ctx.cfg.seed, **size)
    rows = (r for name in ctx.cfg.datasets for _, r in iter_jsonl(ctx.out / "data" / name / "train.jsonl"))
    n = write_jsonl(ctx.out / "data" / "train.jsonl", rows)
    return {"train_pairs": n, "datasets": {k: {"train": v["train"], "test": v["test"]} for k, v in counts.items()}}


def _negatives(row: dict, mode: str, k: int) -> list[str]:
    """The row's training negatives: given ones first, then mined ones up to k (mode "combine")."""
    given, mined = row.pop("given_negatives", []), row.get("negatives") or []
    row.pop("negative_scores", None)
    if mode == "given":
        return given
    if mode == "mined":
        return mined
    seen = set(given)
    return given + [n for n in mined if n not in seen][: max(k - len(given), 0)]


def curate(ctx: RecipeContext) -> dict:
    from moembed.data.curate import CurateConfig
    from moembed.data.curate import curate as run_curate
    from moembed.data.mining import MiningConfig

    c = ctx.cfg
    mode = c.data.negatives if c.user_data else "mined"
    mine = mode != "given"
    top_k = c.curation_top_k
    data, curated = ctx.out / "data" / "train.jsonl", ctx.out / "data" / "curated.jsonl"
    report = None
    if top_k is None and not mine:
        shutil.copy2(data, curated)
    else:
        cfg = CurateConfig(
            shard_size=1_000_000, top_k=top_k, batch_size=64, device=c.device,
            max_length=max(c.train.max_query_length, c.train.max_doc_length),  # judged as trained
            mining=MiningConfig(num_negatives=c.num_negatives, margin=c.margin) if mine else None,
        )
        report = run_curate(data, curated, str(ctx.teacher), cfg, work_dir=ctx.out / "work" / "curate",
                            show_progress=ctx.progress)
    need_negatives = c.train.hard_negatives > 0
    shared = top_k != c.filter_top_k  # curated at the pretraining pool's looser top-k: finetuning takes a subset

    def finetune_row(row: dict) -> dict | None:
        if shared and row["positive_rank"] >= c.filter_top_k:
            return None  # in the pretraining pool only
        row = {**row, "negatives": _negatives(row, mode, c.num_negatives)}
        # no negative to draw: not trained on (as the training reader would skip it)
        return row if row["negatives"] or not need_negatives else None

    def pretrain_row(row: dict) -> dict:
        # Pretraining draws in-batch negatives only: every curated pair, no mined negative needed or kept.
        return {k: v for k, v in row.items() if k not in ("negatives", "negative_scores", "given_negatives")}

    pools = {"train": _Pool(ctx.out / "train", c.train.batch_size, finetune_row)}
    if c.pretrain is not None:
        pools["pretrain"] = _Pool(ctx.out / "pretrain", c.pretrain.batch_size, pretrain_row)
    _write_pools(curated, pools)
    fine = pools["train"]
    if fine.dropped:
        log.info("sources with fewer pairs than a batch, not finetuned on: %s", fine.dropped)
    if not fine.kept:
        raise MoembedError("quickstart: no source has a full batch of curated pairs; give more data (or a larger "
                           "--size, a smaller --batch-size)")
    out = {"filter": report, "filter_top_k": top_k, "train_sources": fine.kept, "too_small": fine.dropped,
           "negatives_mode": mode, "negatives_per_query": fine.negatives_per_pair}
    if c.pretrain is not None:
        pre = pools["pretrain"]
        if not pre.kept:
            raise MoembedError("quickstart: no source has a full pretraining batch of curated pairs; give more data "
                               "(or a larger --size, a smaller pretrain.batch_size)")
        out.update(pretrain_sources=pre.kept, pretrain_too_small=pre.dropped)
    return out


@dataclass
class _Pool:
    """One training pool cut from the curated pairs: the rows `select(row)` returns (None: left out), written to
    out_dir/<source>.jsonl, one file per source so that every batch comes from one source."""

    out_dir: Path
    batch_size: int
    select: Callable[[dict], dict | None]
    kept: dict = field(default_factory=dict)  # {source: pairs} with at least one batch
    dropped: dict = field(default_factory=dict)  # {source: pairs} below one batch, removed
    negatives_per_pair: float = 0.0


def _write_pools(curated: Path, pools: dict[str, _Pool]) -> None:
    """Stream OUT/data/curated.jsonl once into every pool's files (each written whole or not at all)."""
    counts = {name: {} for name in pools}
    n_neg = dict.fromkeys(pools, 0)
    with ExitStack() as stack:
        tmps = {name: stack.enter_context(atomic_dir(p.out_dir)) for name, p in pools.items()}
        handles = {name: {} for name in pools}
        try:
            for _, row in iter_jsonl(curated):
                for name, pool in pools.items():
                    picked = pool.select(row)
                    if picked is None:
                        continue
                    s = str(picked["source"])
                    if s not in handles[name]:
                        handles[name][s] = open(tmps[name] / f"{s}.jsonl", "w", encoding="utf-8")
                    handles[name][s].write(json.dumps(picked, ensure_ascii=False) + "\n")
                    counts[name][s] = counts[name].get(s, 0) + 1
                    n_neg[name] += len(picked.get("negatives") or [])
        finally:
            for fh in (fh for per_pool in handles.values() for fh in per_pool.values()):
                fh.close()
        for name, pool in pools.items():
            pool.dropped = {s: n for s, n in sorted(counts[name].items()) if n < pool.batch_size}
            for s in pool.dropped:
                (tmps[name] / f"{s}.jsonl").unlink()
            pool.kept = {s: n for s, n in sorted(counts[name].items()) if s not in pool.dropped}
            total = sum(counts[name].values())
            pool.negatives_per_pair = round(n_neg[name] / total, 2) if total else 0.0
