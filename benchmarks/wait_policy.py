"""OpenMP's default wait policy against OMP_WAIT_POLICY=PASSIVE on the quickstart's own finetuning, in pairs of
fresh processes.

    OMP_NUM_THREADS=2 python benchmarks/wait_policy.py --work /tmp/qs-recompute --steps 20 --pairs 3 [--kind both]

Builds the quickstart's data, curated pools and starting models in `--work` once (shared with
benchmarks/recompute.py), then trains the dense or MoE model as `moembed quickstart` does for `--steps` steps, in
a fresh process per run: OpenMP reads its wait policy once, when torch loads it, so the two settings cannot share a
process. Runs alternate default / PASSIVE (the order flips every pair) so a drift in the machine's speed weighs on
both; each pair's CPU-time (user + system of the child) and wall-time ratios are printed, then their medians.
`moembed train` and `moembed quickstart` set PASSIVE (moembed.heap.process_settings); this is the measurement
behind that choice (BENCHMARKS.md, "Idle OpenMP workers asleep in training").
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


def child(work: Path, kind: str, steps: int) -> None:
    """One training run, with the wait policy this process was started with."""
    from moembed.heap import configure_process

    configure_process()  # the command's other settings (huge pages, oneDNN cache); the wait policy is the parent's
    from recompute import prepare

    from moembed.recipes import training
    from moembed.train.loop import train

    qs = prepare(work, None)
    cfg = training.train_config(qs, kind).model_copy(update={"steps": steps, "output_dir": str(run_dir(work, kind))})
    train(cfg)


def run_dir(work: Path, kind: str) -> Path:
    return work / f"wait-policy-{kind}"  # emptied before every run, so no run resumes from the one before


def run(args, kind: str, passive: bool) -> tuple[float, float]:
    """(CPU s, wall s) of one child process."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    cmd = [sys.executable, __file__, "--child", "--work", str(args.work), "--kind", kind, "--steps", str(args.steps)]
    shutil.rmtree(run_dir(args.work, kind), ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"wait_policy: the {kind} run failed:\n{done.stderr[-2000:]}")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="quickstart work directory (its first stages are reused)")
    ap.add_argument("--kind", choices=("dense", "moe", "both"), default="both")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=3, help="pairs per kind")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    kinds = ("dense", "moe") if args.kind == "both" else (args.kind,)
    if args.child:
        child(args.work, kinds[0], args.steps)
        return
    from recompute import prepare

    prepare(args.work, None)  # once, before anything is timed
    rows = []
    for kind in kinds:
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {passive: run(args, kind, passive) for passive in order}
            (cpu_a, wall_a), (cpu_b, wall_b) = got[False], got[True]
            rows.append({"kind": kind, "cpu_default": round(cpu_a, 1), "cpu_passive": round(cpu_b, 1),
                         "cpu_ratio": round(cpu_b / cpu_a, 3), "wall_default": round(wall_a, 1),
                         "wall_passive": round(wall_b, 1), "wall_ratio": round(wall_b / wall_a, 3)})
            r = rows[-1]
            print(f"{kind} pair {i + 1}: CPU {r['cpu_default']} -> {r['cpu_passive']} s ({r['cpu_ratio']:.2f}x), "
                  f"wall {r['wall_default']} -> {r['wall_passive']} s ({r['wall_ratio']:.2f}x)", flush=True)
    report = {"steps": args.steps, "threads": os.environ.get("OMP_NUM_THREADS"), "pairs": rows,
              "median_cpu_ratio": statistics.median(r["cpu_ratio"] for r in rows),
              "median_wall_ratio": statistics.median(r["wall_ratio"] for r in rows)}
    print(f"medians, PASSIVE / default: CPU {report['median_cpu_ratio']:.2f}x, wall {report['median_wall_ratio']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
