"""A process setting of training commands, off against on, on the quickstart's own finetuning, in pairs of fresh
processes.

    OMP_NUM_THREADS=2 python benchmarks/training_settings.py --setting allocator --work /tmp/qs-wp --steps 20 --pairs 3

Settings (each read once, when a process starts or torch loads, so the two cannot share a process):
    wait-policy  OpenMP's default wait policy against OMP_WAIT_POLICY=PASSIVE ("Idle OpenMP workers asleep in
                 training")
    allocator    glibc's malloc (MOEMBED_ALLOCATOR=system) against mimalloc preloaded ("Training on mimalloc")
    primitive-cache  oneDNN's primitive cache capped at 64 against the training cap (moembed.heap)
    grouped-rows     the MoE experts' grouped matmuls unpadded against rows padded per expert
                     (GroupedExperts.grouped_rows)
    grouped-rows-cache  both: unpadded and capped at 64 against padded and the training cap
    purge-delay  mimalloc returning freed pages after its own 10 ms against moembed.heap.PURGE_DELAY_MS

Builds the quickstart's data, curated pools and starting models in `--work` once (shared with
benchmarks/recompute.py), then trains the dense or MoE model as `moembed quickstart` does for `--steps` steps, in
a fresh process per run, with the command's other settings. Runs alternate off / on (the order flips every pair)
so a drift in the machine's speed weighs on both; each pair's CPU-time (user + system of the child), wall-time and
peak-RSS ratios (on / off) are printed, then their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GROUPED_ROWS = "EXPERT_ROW_MULTIPLE"  # read by the child only: GroupedExperts.row_multiple for its run

# setting: (environment of the "off" run, of the "on" run); None removes the variable
SETTINGS = {
    "wait-policy": ({"OMP_WAIT_POLICY": None}, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "allocator": ({"MOEMBED_ALLOCATOR": "system"}, {"MOEMBED_ALLOCATOR": None}),
    "primitive-cache": ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}, {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": None}),
    "grouped-rows": ({GROUPED_ROWS: "1"}, {GROUPED_ROWS: None}),
    "grouped-rows-cache": ({GROUPED_ROWS: "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"},
                           {GROUPED_ROWS: None, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": None}),
    "purge-delay": ({"MIMALLOC_PURGE_DELAY": "10"}, {"MIMALLOC_PURGE_DELAY": None}),
}


def child(work: Path, kind: str, steps: int, setting: str) -> None:
    """One training run, with the setting this process was started with; prints its peak RSS (MiB)."""
    from moembed.heap import configure_process, start_on_mimalloc

    start_on_mimalloc([__file__, *sys.argv[1:]])  # as the `moembed` command does (unless MOEMBED_ALLOCATOR=system)
    configure_process(training=setting != "wait-policy")  # the command's settings; the wait policy is the parent's
    from recompute import prepare

    from moembed.heap import bounded_heap
    from moembed.recipes import training
    from moembed.train.loop import train

    if GROUPED_ROWS in os.environ:
        from moembed.model.fast.experts import GroupedExperts  # the trainer's experts (backends.for_training)

        GroupedExperts.row_multiple = int(os.environ[GROUPED_ROWS])
    ctx = prepare(work, None)
    cfg = training.train_config(ctx, kind).model_copy(update={"steps": steps, "output_dir": str(run_dir(work, kind))})
    with bounded_heap():  # as `moembed train` runs it (a no-op on mimalloc)
        train(cfg)
    print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run_dir(work: Path, kind: str) -> Path:
    return work / f"settings-{kind}"  # emptied before every run, so no run resumes from the one before


def run(args, kind: str, on: bool) -> tuple[float, float, float]:
    """(CPU s, wall s, peak RSS MiB) of one child process."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    for key, value in SETTINGS[args.setting][on].items():
        env.pop(key, None)
        if value is not None:
            env[key] = value
    cmd = [sys.executable, __file__, "--child", "--setting", args.setting, "--work", str(args.work), "--kind", kind,
           "--steps", str(args.steps)]
    shutil.rmtree(run_dir(args.work, kind), ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"training_settings: the {kind} run failed:\n{done.stderr[-2000:]}")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_mib"]
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", choices=sorted(SETTINGS), required=True)
    ap.add_argument("--work", type=Path, required=True, help="quickstart work directory (its first stages are reused)")
    ap.add_argument("--kind", choices=("dense", "moe", "both"), default="both")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=3, help="pairs per kind")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    kinds = ("dense", "moe") if args.kind == "both" else (args.kind,)
    if args.child:
        child(args.work, kinds[0], args.steps, args.setting)
        return
    from recompute import prepare

    prepare(args.work, None)  # once, before anything is timed
    rows = []
    for kind in kinds:
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {on: run(args, kind, on) for on in order}
            (cpu_a, wall_a, rss_a), (cpu_b, wall_b, rss_b) = got[False], got[True]
            rows.append({"kind": kind, "cpu_off": round(cpu_a, 1), "cpu_on": round(cpu_b, 1),
                         "cpu_ratio": round(cpu_b / cpu_a, 3), "wall_off": round(wall_a, 1),
                         "wall_on": round(wall_b, 1), "wall_ratio": round(wall_b / wall_a, 3),
                         "peak_off": round(rss_a), "peak_on": round(rss_b), "peak_ratio": round(rss_b / rss_a, 3)})
            r = rows[-1]
            print(f"{kind} pair {i + 1}: CPU {r['cpu_off']} -> {r['cpu_on']} s ({r['cpu_ratio']:.2f}x), "
                  f"wall {r['wall_off']} -> {r['wall_on']} s ({r['wall_ratio']:.2f}x), "
                  f"peak {r['peak_off']} -> {r['peak_on']} MiB", flush=True)
    report = {"setting": args.setting, "steps": args.steps, "threads": os.environ.get("OMP_NUM_THREADS"),
              "pairs": rows}
    for figure in ("cpu", "wall", "peak"):
        report[f"median_{figure}_ratio"] = statistics.median(r[f"{figure}_ratio"] for r in rows)
    print(f"medians, on / off ({args.setting}): CPU {report['median_cpu_ratio']:.3f}x, "
          f"wall {report['median_wall_ratio']:.3f}x, peak {report['median_peak_ratio']:.3f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
