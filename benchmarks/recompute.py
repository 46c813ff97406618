"""Recomputed MLP activations against kept ones, batch for batch, on the quickstart's own finetuning.

    OMP_NUM_THREADS=2 python benchmarks/recompute.py --work /tmp/qs-recompute --steps 40 [--kind dense] [--device cuda]

Builds the quickstart's data, curated pools and starting models in `--work` (kept between runs), then trains the
MoE (or dense) model as `moembed quickstart` does, with one change: every step's batch runs forward and backward
twice, once with `recompute_activations` off and once on (the order alternates by step), before the optimizer
step. Both modes thus see the same batches and the same weights in one process, so a machine that speeds up or
slows down during the run weighs on both alike. Reports each mode's CPU time (on a GPU: synchronised wall time)
over steps 2..N, the median per-step ratio, and the peak memory during each mode's passes (on a CPU the resident
set, sampled every 10 ms; on a GPU torch's peak allocation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moembed.heap import configure_process, start_on_mimalloc  # noqa: E402
from quickstart_profile import RssSampler  # noqa: E402


def prepare(work: Path, device: str | None):
    """The quickstart's context with its first three stages done in `work` (data, curation, upcycling), once."""
    from moembed.recipes.quickstart import Quickstart, load_quickstart_config

    qs = Quickstart(load_quickstart_config(None, device=device), work, progress=False, owns_process=True)
    first = [("data", qs.build_data), ("curate", qs.curate), ("upcycle", qs.upcycle)]
    for i, (name, fn) in enumerate(first):
        qs.run_stage(name, fn, i + 1, len(first))  # skipped when an earlier run finished it
    return qs.ctx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="quickstart work directory (its first stages are reused)")
    ap.add_argument("--kind", choices=("moe", "dense"), default="moe")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default=None, help="auto | cpu | cuda | mps (default: the recipe's, auto)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    start_on_mimalloc([__file__, *sys.argv[1:]])  # the command's allocator (MOEMBED_ALLOCATOR=system: glibc's)
    configure_process(training=True)  # the settings `moembed quickstart` trains with, before torch loads

    import torch

    import moembed.distributed as dist
    import moembed.train.step as steps
    from moembed.heap import bounded_heap
    from moembed.model.recompute import set_recompute
    from moembed.recipes import training
    from moembed.train.loop import Trainer

    ctx = prepare(args.work, args.device)
    cfg = training.train_config(ctx, args.kind).model_copy(update={"output_dir": str(args.work / "recompute-run")})
    cuda = ctx.device.type == "cuda"
    sampler = None if cuda else RssSampler(period=0.01)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    peak: dict[bool, float] = {False: 0.0, True: 0.0}
    trainer: list[Trainer] = []
    step_once = steps.contrastive_step

    def twice(*a, **k):  # replaces the step the training stage calls: both modes on this batch, the second's result
        order = (False, True) if len(seconds[False]) % 2 == 0 else (True, False)
        for on in order:
            set_recompute(trainer[0].module, on)
            trainer[0].module.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            else:
                sampler.reset()
            t0, c0 = time.perf_counter(), time.process_time()
            result = step_once(*a, **k)
            if cuda:
                torch.cuda.synchronize()
                seconds[on].append(time.perf_counter() - t0)
                peak[on] = max(peak[on], torch.cuda.max_memory_allocated() / 2**20)
            else:
                seconds[on].append(time.process_time() - c0)
                peak[on] = max(peak[on], sampler.peak)
        print(f"step {len(seconds[False])}: kept {seconds[False][-1]:.2f} s, recomputed {seconds[True][-1]:.2f} s",
              flush=True)
        return result

    steps.contrastive_step = twice
    try:
        with bounded_heap():
            dist.init_from_env("gloo")
            trainer.append(Trainer(cfg, False))
            for _ in range(args.steps):
                trainer[0].train_step()
    finally:
        steps.contrastive_step = step_once
        if sampler is not None:
            sampler.stop()
    kept, recomputed = seconds[False][1:], seconds[True][1:]  # step 1 pays one-time costs (probes, packing)
    report = {
        "kind": args.kind, "steps": args.steps, "device": str(ctx.device),
        "clock": "wall (synchronised)" if cuda else "process CPU",
        "kept_s": round(sum(kept), 1), "recomputed_s": round(sum(recomputed), 1),
        "ratio": round(sum(recomputed) / sum(kept), 4),
        "median_step_ratio": round(statistics.median(r / k for k, r in zip(kept, recomputed)), 4),
        "peak_mib": {"kept": round(peak[False]), "recomputed": round(peak[True])},
        "memory": "torch peak allocation" if cuda else "resident set",
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
