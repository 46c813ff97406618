"""Where a quickstart finetuning step's time goes, by kind of work, and how fast its matmuls run against this
CPU's own float32 matmul rate.

    OMP_NUM_THREADS=2 python benchmarks/step_profile.py --work /tmp/qs-wp --steps 12 [--kind both] [--device cuda]

Builds the quickstart's data, curated pools and starting models in `--work` once (shared with recompute.py and
training_settings.py), then trains the dense and/or MoE model as `moembed quickstart` does, with the command's process
settings (moembed.heap). Steps 1-2 run unprofiled (probes, first allocations); steps 3..N run under torch.profiler.
Every operator's own time (on a CPU its time on the training thread, inside which a matmul's worker threads work;
on a GPU its kernels' time on the device) goes to the first kind of work that names it or one of its callers: the
optimizer and gradient clipping, dropout, attention, matmuls, normalisation, activations, indexing and copies
(padding removal, MoE routing and dispatch, embeddings, zeroed buffers), the loss, autograd's own bookkeeping, and
the remaining element-wise arithmetic. What no operator covers (Python, data) is reported as the rest of the step.
One checkpoint save is timed after the profiled steps and spread over the recipe's checkpoint interval.

The matmuls' rate (FLOPs counted by the profiler / their own time) is set against a plain matmul (x Wᵀ into a kept
buffer) on the model's two MLP shapes at 4,096 tokens, the best of 30 runs before and 30 after the profiled steps,
in the same process: what this CPU reaches on these widths (its speed drifts; the best is the steadiest figure).
A step whose matmuls are most of its time and run near that rate is bound by its arithmetic: only fewer FLOPs
(fewer steps, shorter inputs) or faster arithmetic (native bf16) make it cheaper.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moembed.heap import configure_process, start_on_mimalloc  # noqa: E402

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::baddbmm")
FLOP_OPS = ("aten::mm", "aten::addmm", "aten::bmm")  # the profiler counts these; _grouped_mm's run as aten::mm
# (kind, name fragments), checked in order on an operator and then on each of its callers.
KINDS = (
    ("optimizer and clipping", ("Optimizer.", "_foreach_", "clip_grad", "get_total_norm")),
    ("dropout", ("dropout", "bernoulli")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("matmul", MATMUL),
    ("normalisation", ("layer_norm", "rms_norm")),
    ("activation", ("gelu", "silu", "GeluBackward", "SiluBackward")),
    ("indexing and copies", ("index", "gather", "scatter", "cat", "copy", "sort", "bincount", "topk", "embedding",
                             "masked", "nonzero", "split", "clone", "contiguous", "_to_copy", "where", "fill", "zero")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "LogSoftmax", "NllLoss")),
)
OTHER = "element-wise and reductions"
AUTOGRAD = "autograd bookkeeping"  # the engine's and its nodes' own time around the operators they call


def kind_of(event) -> str:
    """The kind of work an operator's own time belongs to: the first KINDS entry naming it or a caller."""
    if event.name.startswith("autograd::") or ("::" not in event.name and "Backward" in event.name):
        return AUTOGRAD
    chain, e = [], event
    while e is not None:
        chain.append(e.name)
        e = e.cpu_parent
    for kind, fragments in KINDS:
        if kind == "matmul":  # only the operator itself: a matmul's caller (a linear layer) says nothing more
            if chain[0] in MATMUL:
                return kind
            continue
        if any(f in name for name in chain for f in fragments):
            return kind
    return OTHER


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def linear_rate(widths: tuple[int, int], device, tokens: int = 4096, reps: int = 30) -> float:
    """GFLOP/s of a plain matmul over the two MLP shapes (d → i, i → d) at `tokens` rows, the best of `reps`: what
    this CPU reaches on these widths when nothing else runs."""
    import torch

    d, i = widths
    xs = (torch.randn(tokens, d, device=device), torch.randn(tokens, i, device=device))
    ws = (torch.randn(i, d, device=device), torch.randn(d, i, device=device))
    outs = (torch.empty(tokens, i, device=device), torch.empty(tokens, d, device=device))  # no fresh memory per call
    flops = 2 * 2 * tokens * d * i
    times = []
    for r in range(reps + 1):
        synchronize(device)
        t0 = time.perf_counter()
        for x, w, o in zip(xs, ws, outs):
            torch.mm(x, w.t(), out=o)
        synchronize(device)
        if r:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return flops / min(times) / 1e9


def profile_kind(ctx, kind: str, steps: int, work: Path, top: int) -> dict:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from moembed.recipes import training
    from moembed.train.loop import Trainer

    out = work / f"step-profile-{kind}"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resumed one
    cfg = training.train_config(ctx, kind).model_copy(update={"output_dir": str(out)})
    t = Trainer(cfg, False)
    for _ in range(2):
        t.train_step()
    widths = (t.embedder.config.hidden_size, t.embedder.config.intermediate_size)
    rate = linear_rate(widths, t.device)
    cuda = t.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)  # noqa: E731
    wall, cpu = [], []
    with profile(activities=activities, with_flops=True) as prof:
        for _ in range(steps - 2):
            synchronize(t.device)
            w0, c0 = time.perf_counter(), time.process_time()
            t.train_step()
            synchronize(t.device)
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
    s0 = time.perf_counter()
    t.save_checkpoint()
    save = time.perf_counter() - s0
    n = steps - 2
    main_thread = statistics.mode(e.thread for e in prof.events() if e.device_type == DeviceType.CPU)
    by_kind: dict[str, float] = {}
    by_op: dict[tuple[str, str], float] = {}
    flops = 0.0
    for e in prof.events():
        if e.thread != main_thread or e.device_type != DeviceType.CPU:  # a GPU kernel's time is its caller's
            continue
        k, seconds = kind_of(e), own(e) / 1e6
        by_kind[k] = by_kind.get(k, 0.0) + seconds
        by_op[k, e.name] = by_op.get((k, e.name), 0.0) + seconds
        if e.name in FLOP_OPS:
            flops += e.flops or 0
    mm_time = by_kind.get("matmul", 0.0)
    step_wall = sum(wall) / n
    ops = sum(by_kind.values()) / n
    shares = {k: round(v / n / step_wall, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    shares["outside operators (Python, data)"] = round(max(step_wall - ops, 0.0) / step_wall, 4)
    every = cfg.checkpoint.every
    rate = max(rate, linear_rate(widths, t.device))
    return {
        "kind": kind, "profiled_steps": n, "threads": torch.get_num_threads(),
        "step_wall_s": round(step_wall, 3), "step_cpu_s": round(sum(cpu) / n, 3),
        "share_of_step_wall": shares,
        "matmul_gflops": round(flops / mm_time / 1e9, 1) if mm_time else None,
        "linear_gflops_same_process": round(rate, 1),
        "matmul_rate_vs_linear": round(flops / mm_time / 1e9 / rate, 3) if mm_time else None,
        "checkpoint_save_s": round(save, 2), "checkpoint_every": every,
        "checkpoint_share_of_step": round(save / every / step_wall, 4),
        "top_operators": [f"{name} ({k}): {v / n / step_wall:.1%}"
                          for (k, name), v in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="quickstart work directory (its first stages are reused)")
    ap.add_argument("--kind", choices=("moe", "dense", "both"), default="both")
    ap.add_argument("--steps", type=int, default=12, help="steps per model; the first two are not profiled")
    ap.add_argument("--device", default=None, help="auto | cpu | cuda | mps (default: the recipe's, auto)")
    ap.add_argument("--top", type=int, default=15, help="operators listed by their share of the step")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps: at least 3 (two unprofiled, then one or more profiled)")
    start_on_mimalloc([__file__, *sys.argv[1:]])  # the command's allocator (MOEMBED_ALLOCATOR=system: glibc's)
    configure_process(training=True)  # the settings `moembed quickstart` trains with, before torch loads

    import moembed.distributed as dist
    from moembed.heap import bounded_heap
    from recompute import prepare

    ctx = prepare(args.work, args.device)
    report = []
    with bounded_heap():
        dist.init_from_env("gloo")
        for kind in (("moe", "dense") if args.kind == "both" else (args.kind,)):
            report.append(profile_kind(ctx, kind, args.steps, args.work, args.top))
            print(json.dumps(report[-1], indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
