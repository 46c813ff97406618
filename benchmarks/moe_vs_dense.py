"""Does the MoE beat its dense control? Each upcycling option against the dense model, same data, steps, batches.

    python benchmarks/moe_vs_dense.py --out /tmp/moe-study --options dense,copies,groups --seeds 0,1 --workers 2
    python benchmarks/moe_vs_dense.py --out /tmp/big --size large --max-pairs 40000 --data-only     # pools only
    python benchmarks/moe_vs_dense.py --out /tmp/big --size large --max-pairs 40000 --device cuda \
        --batch-size 256 --steps 500 --workers 6 --threads 2                                      # then, on a GPU
    python benchmarks/moe_vs_dense.py --out /tmp/moe-study --summarise-only --figure-with /tmp/big  # one figure
    python benchmarks/moe_vs_dense.py --figure docs/img/moe_vs_dense.png \
        --figure-with benchmarks/results/moe_vs_dense/*.json     # the docs' figure, from the studies' gaps
    python benchmarks/moe_vs_dense.py --out /tmp/ml-study --preset multilingual --workers 2      # the other recipe
    python benchmarks/moe_vs_dense.py --out /tmp/ml-b2 --preset multilingual --pretrain-batch-size 128 \
        --pretrain-steps 15 --batch-size 64 --steps 30 --workers 2      # twice the batches, the same pairs seen
    python benchmarks/moe_vs_dense.py --trend benchmarks/results/moe_vs_dense/*-english-*.json   # where it heads

The quickstart's stages, through its public functions: the data and curated pools are built once (seed 0) in
OUT/shared; then every (option, seed) run gets its own directory that links them, upcycles the base
(`moembed.recipes.training.upcycle`, the option's `upcycling:` keys), trains the one model it is about
(`training.train`; the preset's pretraining stage first where it has one) and evaluates it at full dimension in
float32 on the recipe's held-out test sets and on the built-in dev suite (`moembed.eval.suite`, retrieval tasks of
`--suite-datasets` plus its reranking, classification, clustering and pair tasks). `--preset` picks the recipe
(english, multilingual: moembed.recipes.config.RECIPE_PRESETS), laid under the study's settings and the option's
keys. A seed changes the router initialisation and the order of batches, not the data.

Per run, OUT/runs/<option>-s<seed>/result.json: nDCG@10 per test set, dev-suite main scores, total and active
parameters, training and encoding seconds, the router's gradient norm from InfoNCE alone (no auxiliary loss) on
one training batch before and after training, and the diagnostics of `moembed.model.diagnostics` (divergence,
entropy, load, mutual information between expert and training source) on a sample of training texts, and the recipe.
A run stopped before its result (a killed study, a machine taken back) continues from its stages' last checkpoints
(the recipe's `train.checkpoint_every`, or `--checkpoint-every`) when the same command runs again, bit for bit as
the training loop resumes; its result counts its starts and names each start's CPU
(OUT/runs/<option>-s<seed>/starts.jsonl), and its training seconds count each step once, the time stopped not at all
(`resumed_seconds`).
OUT/table.md and OUT/gap_vs_pairs.png: per option the MoE − dense gap, mean and spread (min..max) over seeds, per test
set (English) or per group of test sets (multilingual: cross-lingual, non-English, English; each set counts once in its
group's mean and in the mean over all); pairs seen count both stages' steps × batch. OUT/gaps.json: what the figure
plots of the study (per option the gap of each seed on the mean test score and on the dev suite, the pairs seen, the
recipe, `--label`); benchmarks/results/moe_vs_dense/ keeps those of the studies in docs/moe.md. The figure also plots
the studies of `--figure-with` (study directories or gaps files: other sizes, batches, recipes), each paired with its
own control. The options (`--options`) are those of moe_options.py; the runs' pairing and the gaps files, moe_gaps.py.

`--trend STUDIES` prints, per option measured at two or more pairs seen, the line through every seed's gap against
log10(pairs seen) that moe_trend.py fits: its slope per tenfold pairs with a 95% interval, and where it would cross
zero. Give it one recipe's studies (it refuses a mix): their gaps are each against a control of their own recipe,
machine and batch.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from moe_figure import figure
from moe_gaps import (
    dump_study, load_study, mean_of, paired, paired_gaps, read_runs, saved_gaps, study_gaps, study_order)
from moe_options import MOE_OPTIONS, OPTIONS


def given(**keys) -> dict:
    """The keys the command line set (the preset keeps the others)."""
    return {k: v for k, v in keys.items() if v is not None}


def config(args, option: str, seed: int):
    """The quickstart config of one run: preset ← the study's settings ← the option's keys."""
    from moembed.recipes.config import RECIPE_PRESETS, QuickstartConfig, merge

    doc = {"preset": args.preset, "size": args.size, "max_pairs": args.max_pairs, "seed": seed, "device": args.device,
           "eval": {"precisions": ["float32"], "suite": False},
           "train": given(steps=args.steps, batch_size=args.batch_size, warmup_steps=args.warmup_steps,
                          chunk_size=args.chunk_size, checkpoint_every=args.checkpoint_every)}
    if pretrain := given(steps=args.pretrain_steps, batch_size=args.pretrain_batch_size):
        doc["pretrain"] = pretrain
    return QuickstartConfig(**merge(merge(RECIPE_PRESETS[args.preset], doc), OPTIONS[option]))


def write_stage(ctx, name: str, result: dict) -> None:
    ctx.stages.mkdir(parents=True, exist_ok=True)
    (ctx.stages / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")


def prepare(args) -> Path:
    """The data and curated pools, once, in OUT/shared (reused when there)."""
    from moembed.recipes.quickstart import Quickstart

    shared = args.out / "shared"
    qs = Quickstart(config(args, "dense", 0), shared, progress=False)
    for name, fn in (("data", qs.build_data), ("curate", qs.curate)):
        if name == "curate" and args.data_only:
            return shared
        qs.run_stage(name, fn)  # skipped when an earlier run finished it
    from moembed.eval.suite import build_suite

    build_suite(args.out / "dev-suite", 0, args.suite_datasets)
    return shared


def router_gradient(model, pairs: list[dict]) -> list[float]:
    """‖∂InfoNCE/∂W_router‖ per MoE layer on one batch of training pairs (eval mode, no auxiliary loss)."""
    from moembed.losses.config import LossConfig
    from moembed.model.diagnostics import router_grad_norms
    from moembed.model.embedder import NOMIC_PROMPTS as P
    from moembed.train.step import contrastive_step

    model.eval()
    model.zero_grad(set_to_none=True)
    q = model.tokenizer([P["search_query"] + r["query"] for r in pairs])
    d = model.tokenizer([P["search_document"] + r["document"] for r in pairs])
    contrastive_step(model, q, d, None, LossConfig(aux_loss_coef=0.0, z_loss_coef=0.0, num_hard_negatives=0))
    norms = router_grad_norms(model)
    model.zero_grad(set_to_none=True)
    return norms


def run(args, option: str, seed: int) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from moembed.cli.models import count_parameters
    from moembed.eval.registry import load_task
    from moembed.eval.runner import View, run_task
    from moembed.eval.suite import build_suite
    from moembed.fileio import iter_jsonl
    from moembed.model.diagnostics import diagnose
    from moembed.model.embedder import Embedder
    from moembed.recipes import training
    from moembed.recipes.curation import held_out_dirs
    from moembed.recipes.quickstart import open_context
    from moembed.recipes.report_text import group_members
    from precision import cpu_flags

    out = args.out / "runs" / f"{option}-s{seed}"
    if (out / "result.json").exists():
        return json.loads((out / "result.json").read_text())
    shared = args.out / "shared"
    (out / "models").mkdir(parents=True, exist_ok=True)
    # the pools, and a base converted from a registry package (OUT/shared/models/base-<name>), are shared
    for d in ["data", "train", "pretrain", *(f"models/{b.name}" for b in (shared / "models").glob("base-*"))]:
        if (shared / d).exists() and not (out / d).exists():
            (out / d).symlink_to(shared / d)
    ctx = open_context(config(args, option, seed), out, progress=False, owns_process=True)
    for name in ("data", "curate"):
        write_stage(ctx, name, json.loads((shared / "stages" / f"{name}.json").read_text()))
    kind = "dense" if option == "dense" else "moe"
    training.upcycle(ctx)
    sources = ctx.stage_result("curate")["train_sources"]
    rows = {s: [r for _, r in iter_jsonl(out / "train" / f"{s}.jsonl")] for s in sources}
    batch = [r for s in sorted(rows) for r in rows[s][:8]][:32]
    grad0 = router_gradient(Embedder.load(out / "models" / f"{kind}-init", device=args.device), batch) if kind == "moe" else []
    stages = ["pretrain", "finetune"] if ctx.cfg.pretrain is not None else ["finetune"]
    # A stopped run (a machine taken back, a killed study) restarts where it stopped: each stage resumes from its
    # last checkpoint, and every start is recorded so that the training time counts the work once.
    with (out / "starts.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), "cpu": cpu_flags()}) + "\n")
    starts = [json.loads(line) for line in (out / "starts.jsonl").read_text().splitlines()]
    t = time.perf_counter()
    for stage in stages:
        training.train(ctx, kind, stage)
    train_s = time.perf_counter() - t
    if len(starts) > 1:
        train_s = resumed_seconds([json.loads(line).get("time") for stage in stages for line in
                                   (out / "runs" / training.run_name(kind, stage) / "metrics.jsonl").open()],
                                  [s["time"] for s in starts])
    model = Embedder.load(out / "runs" / kind / "model", device=args.device)
    grad1 = router_gradient(model, batch) if kind == "moe" else []
    model.eval()
    total, active = count_parameters(model)
    view = View(None, "float32", 64)
    scores, suite, encode_s = {}, {}, 0.0
    for name, path in held_out_dirs(ctx).items():
        r = run_task(model, load_task(path), view)
        scores[name], encode_s = r.main_score, encode_s + r.evaluation_time
    for path in build_suite(args.out / "dev-suite", 0, args.suite_datasets):
        r = run_task(model, load_task(path), view)
        suite[path.name], encode_s = r.main_score, encode_s + r.evaluation_time
    diag = []
    if kind == "moe":
        texts = [(s, r["document"]) for s in sorted(rows) for r in rows[s][:100]]
        diag = [d.as_dict() for d in diagnose(model, [x for _, x in texts], [s for s, _ in texts])]
    test_sets = ctx.stage_result("data").get("test_sets") or {}  # a data suite's, with their languages
    c = ctx.cfg
    result = {"option": option, "seed": seed, "scores": scores, "suite": suite, "total_params": total,
              "active_params": active, "train_seconds": round(train_s, 1), "eval_seconds": round(encode_s, 1),
              "router_grad_step0": grad0, "router_grad_trained": grad1, "diagnostics": diag,
              "pairs_seen": c.train.steps * c.train.batch_size + (c.pretrain.steps * c.pretrain.batch_size
                                                                  if c.pretrain else 0),
              "groups": {g: n for g, n in group_members(test_sets).items() if g != "all"}, "threads": args.threads,
              "preset": args.preset, "starts": len(starts), "cpus": sorted({s["cpu"] for s in starts})}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    # what the result came from stays (the trained model); starting points and checkpoints can be made again
    made_again = [out / "models", out / "runs" / kind / "checkpoints"]
    if "pretrain" in stages:
        made_again.append(out / "runs" / training.run_name(kind, "pretrain"))
    for d in made_again:
        shutil.rmtree(d, ignore_errors=True)
    return result


def resumed_seconds(times: list[float | None], starts: list[float]) -> float:
    """Training seconds of a run that was stopped and restarted, from its logged steps' wall-clock times (the
    stages' metrics.jsonl, in order; None for a record without one) and its starts: each step counts the time since
    the step logged before it, or since the latest restart in between (a resumed stage drops the records of steps
    after its checkpoint, so the steps redone count once and the time stopped not at all)."""
    total, prev = 0.0, starts[0]
    for t in (t for t in times if t is not None):
        total += t - max([s for s in starts if prev < s < t], default=prev)
        prev = t
    return total


def spread(xs: list[float]) -> str:
    m = statistics.fmean(xs)
    return f"{m:+.2f} [{min(xs):+.2f}, {max(xs):+.2f}]"


def columns(result: dict) -> dict[str, list[str]]:
    """The table's test columns: each group of test sets (a multilingual suite), or else each test set."""
    return result.get("groups") or {t: [t] for t in sorted(result["scores"])}


def summarise(args, results: list[dict]) -> str:
    """Markdown table of MoE − dense (×100) per option: mean over seeds [min, max], seeds paired."""
    dense = [r for r in results if r["option"] == "dense"]
    tests = columns(dense[0]) if dense else {}
    lines = ["| option | seeds | " + " | ".join(f"{t} ({len(n)})" if len(n) > 1 else t for t, n in tests.items())
             + " | mean test | dev suite | params active / total | train s | eval s | router grad step 0 → trained |",
             "|" + "---|" * (len(tests) + 8)]
    for option in OPTIONS:
        runs = paired(results, option)
        if not runs:
            continue
        cells = [spread(paired_gaps(results, option, mean_of("scores", names))) for names in tests.values()]
        mean_test = paired_gaps(results, option, mean_of("scores"))
        dev = paired_gaps(results, option, mean_of("suite"))
        m = runs[0][0]
        g0 = [statistics.fmean(r["router_grad_step0"]) for r, _ in runs if r["router_grad_step0"]]
        g1 = [statistics.fmean(r["router_grad_trained"]) for r, _ in runs if r["router_grad_trained"]]
        grads = f"{statistics.fmean(g0):.2g} → {statistics.fmean(g1):.2g}" if g0 else "-"
        label = option + (" (absolute)" if option == "dense" else "")
        lines.append(f"| {label} | {len(runs)} | " + " | ".join(cells) + f" | {spread(mean_test)} | {spread(dev)} | "
                     f"{m['active_params'] / 1e6:.1f}M / {m['total_params'] / 1e6:.1f}M | "
                     f"{statistics.fmean(r['train_seconds'] for r, _ in runs):.0f} | "
                     f"{statistics.fmean(r['eval_seconds'] for r, _ in runs):.0f} | {grads} |")
    return "\n".join(lines)


def main() -> None:
    from moembed.recipes.config import RECIPE_PRESETS, QuickTrain

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="the study's directory (runs, table, figure, gaps)")
    p.add_argument("--options", default="dense,copies,groups")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--preset", default="english", choices=list(RECIPE_PRESETS), help="the recipe")
    p.add_argument("--size", default="small", choices=["tiny", "small", "medium", "large"])
    p.add_argument("--max-pairs", type=int, default=None, help="training pairs per built-in dataset (default: by --size)")
    p.add_argument("--steps", type=int, default=None, help="finetuning steps (default: the quickstart's)")
    p.add_argument("--batch-size", type=int, default=None, help="finetuning batch (default: the quickstart's)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="finetuning warmup steps (default: the quickstart's; fewer with fewer, larger batches)")
    p.add_argument("--pretrain-steps", type=int, default=None, help="pretraining steps (a preset with that stage)")
    p.add_argument("--pretrain-batch-size", type=int, default=None, help="pretraining batch (ditto)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="GradCache chunk in both stages: texts per forward pass with gradient (a large batch's memory)")
    default_every = QuickTrain.model_fields["checkpoint_every"].default
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help=f"steps between checkpoints in both stages (default: the quickstart's {default_every}); "
                        "a run of a few long steps wants a few, so that a stopped run loses little. Saving does not "
                        "change the training")
    p.add_argument("--suite-datasets", default="gcide", help="dev suite retrieval corpora, comma-separated")
    p.add_argument("--workers", type=int, default=1, help="runs at a time, each in its own process")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default: cores / workers)")
    p.add_argument("--device", default="cpu", help="where runs train and evaluate: cpu, cuda, cuda:N")
    p.add_argument("--data-only", action="store_true",
                   help="only build the data pools (the curate stage then runs with the first study, e.g. on a GPU)")
    p.add_argument("--summarise-only", action="store_true", help="only rebuild the table and figure from OUT/runs")
    p.add_argument("--figure-with", type=Path, nargs="*", default=[],
                   help="more studies the figure plots beside OUT's: study directories or their gaps.json files")
    p.add_argument("--figure", type=Path, default=None,
                   help="where the figure goes (default OUT/gap_vs_pairs.png); without --out, only the figure")
    p.add_argument("--label", default=None, help="the study's name in the figure's legend (default: OUT's name)")
    p.add_argument("--trend", type=Path, nargs="+", default=None,
                   help="only print where each option's gap heads with pairs seen, fitted over these studies "
                        "(one recipe's study directories or gaps files)")
    args = p.parse_args()
    if args.trend:
        from moe_trend import trend_table

        paths = sorted(args.trend, key=study_order)
        studies = [load_study(path) for path in paths]
        if len({s["preset"] for s in studies if "preset" in s}) > 1:  # each gap is against its own recipe's control
            p.error("--trend: one recipe's studies at a time; these are " + ", ".join(
                f"{path.name} ({s.get('preset', 'recipe not recorded')})" for path, s in zip(paths, studies)))
        print(trend_table(studies))
        return
    args.figure_with = sorted(args.figure_with, key=study_order)  # the legend in the studies' numbering
    if args.out is None:
        if args.figure is None or not args.figure_with:
            p.error("--out is required, unless --figure draws the studies of --figure-with alone")
        figure(args.figure, [load_study(path) for path in args.figure_with], MOE_OPTIONS)
        return
    if (args.pretrain_steps or args.pretrain_batch_size) and RECIPE_PRESETS[args.preset].get("pretrain") is None:
        p.error(f"--pretrain-steps / --pretrain-batch-size: the {args.preset} recipe has no pretraining stage")
    args.out = args.out.resolve()  # the runs link the shared pools by absolute path
    args.suite_datasets = [s for s in args.suite_datasets.split(",") if s]
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    options = args.options.split(",")
    bad = [o for o in options if o not in OPTIONS]
    if bad:
        sys.exit(f"unknown options {bad}; choose from {', '.join(OPTIONS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.data_only:
        prepare(args)
        return
    if not args.summarise_only:
        prepare(args)
        jobs = [(o, s) for s in seeds for o in options]
        # spawn: the data stages may have initialised CUDA in this process, which a forked child cannot reuse
        with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for r in pool.map(run, [args] * len(jobs), *zip(*jobs)):
                print(f"{r['option']} seed {r['seed']}: mean test {100 * statistics.fmean(r['scores'].values()):.2f}, "
                      f"train {r['train_seconds']} s", flush=True)
    results = read_runs(args.out)
    gaps = study_gaps(results, args.label or saved_gaps(args.out).get("label", args.out.name), args.preset)
    table = summarise(args, results)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "gaps.json").write_text(dump_study(gaps))
    figure(args.figure or args.out / "gap_vs_pairs.png", [gaps, *map(load_study, args.figure_with)], MOE_OPTIONS)
    print(table)


if __name__ == "__main__":
    main()
