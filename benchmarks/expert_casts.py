"""bf16 training of an MoE block: one cast node per expert weight shared by a step's passes, against one per pass.

    OMP_NUM_THREADS=2 python benchmarks/expert_casts.py [--reps 12] [--device cuda]

Under bf16 autocast the grouped experts' float32 weights are cast to bf16 once per weight version
(`GroupedExperts._weights_as`), and the cast enters each pass's graph through a node whose backward casts the
gradient back to float32. A contrastive step runs three passes (queries, positive documents, hard negatives) and one
backward. "shared" is moembed's way: the passes share one node per weight, so backward sums their gradients in bf16
and casts once; "per pass" makes a node for each pass (three casts back and two float32 accumulations into the
weights' gradients, over 4x the dense MLP's parameters). One MoE block of all-MiniLM-L6-v2's shape (d 384, i 1,536,
8 experts, top-2, grouped dispatch) on 900, 2,200 and 2,200 tokens (the quickstart's 32 queries and 2 x 32
documents), forward, backward and a fused AdamW step; the two variants alternate, medians of process CPU time (wall
time on a GPU, synchronised) after two warm-up rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moembed.model import backends
from moembed.model.config import MoEConfig
from moembed.model.fast import experts
from moembed.model.moe import MoEBlock
from moembed.model.presets import tiny_config

TOKENS = (900, 2200, 2200)  # queries, positives, negatives


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = tiny_config(hidden_size=384, num_heads=12, intermediate_size=1536, moe=MoEConfig(num_experts=8, top_k=2))
    block = backends.use_experts(MoEBlock(config).to(device).train(), "grouped")
    support = experts.grouped_support(device, torch.bfloat16)
    if not support.usable:  # the casts measured are the grouped matmuls'
        raise SystemExit(f"grouped matmuls unusable here: {support.detail}")
    opt = torch.optim.AdamW(block.parameters(), lr=1e-5, fused=True)
    xs = [torch.randn(n, 384, device=device) for n in TOKENS]
    shared = experts.cached

    def per_pass(store, name, key, make):
        return make() if name == "cast-node" else shared(store, name, key, make)

    def step(cache) -> float:
        experts.cached = cache
        clock = time.perf_counter if device.type == "cuda" else time.process_time
        t0 = clock()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = sum(block(x)[0].float().square().mean() for x in xs)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return clock() - t0

    times = {"shared": [], "per pass": []}
    try:
        for rep in range(args.reps + 2):
            for name, cache in (("shared", shared), ("per pass", per_pass)):
                t = step(cache)
                if rep >= 2:
                    times[name].append(t)
    finally:
        experts.cached = shared
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"device {device}, {torch.get_num_threads()} threads, dispatch grouped ({support.detail}), {args.reps} reps")
    for name, t in med.items():
        print(f"  {name:<9} {1e3 * t:8.1f} ms per step")
    print(f"shared / per pass: {med['shared'] / med['per pass']:.3f}x")


if __name__ == "__main__":
    main()
