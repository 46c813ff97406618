"""Attention in bf16 against float32 with casts: what `moembed.model.attention` chooses when training in bf16.

    OMP_NUM_THREADS=2 python benchmarks/attention.py [--repeats 15] [--device cuda] [--json F]

torch's fused attention (`scaled_dot_product_attention`) on the encoder's padded layout, 12 heads of 32
(all-MiniLM-L6-v2), at the batch shapes of the quickstart's finetuning (32 queries of up to 32 tokens, 32 or 64
documents of up to 96) and of encoding (batches of 32), with each sequence padded to a random length between a
third of T and T. For each shape, three variants in turn per repeat (medians):

- bf16: q, k, v in bfloat16 into the kernel (what autocast runs);
- float32 with casts: q, k, v cast to float32, the kernel outside autocast, the output cast back to bf16 (what
  `attend` runs for a bf16 call in training, on a CPU without AMX);
- float32: the kernel on float32 inputs (the float32 model's attention).

"train" times forward and backward (gradients for q, k and v), "infer" the forward without autograd; at inference
on CPU also moembed's compiled kernel (`fast.attention.compiled_attention`, what CPU inference runs) on the same float32
and bf16 inputs, with torch's time over its. Prints each variant's milliseconds and bf16's time over
float32-with-casts: above 1, the casts pay. Also the largest difference
of either bf16 variant's output and gradients from float32 attention of the same bf16-rounded inputs, relative to
the largest value, which says how much precision each keeps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_ceiling import timed  # noqa: E402
from precision import cpu_flags  # noqa: E402

from moembed.model import kernels  # noqa: E402
from moembed.model.fast import attention as fast_attention  # noqa: E402
from moembed.model.attention import attention_in  # noqa: E402

HEADS, HEAD_DIM = 12, 32
SHAPES = {"train": [(32, 32), (32, 96), (64, 64), (64, 96)], "infer": [(32, 16), (32, 32), (32, 64), (32, 128)]}


def inputs(B: int, T: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (2 * torch.randn(B, HEADS, T, HEAD_DIM, generator=g) for _ in range(3))
    lengths = torch.randint(max(1, T // 3), T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T)
    grad = torch.randn(B, HEADS, T, HEAD_DIM, generator=g)
    return [t.to(device) for t in (q, k, v, mask, grad)]


def bf16(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def upcast(q, k, v, mask):
    return attention_in(torch.float32, q, k, v, mask)  # what `attend` runs for a bf16 call in training


def errors(fn, base, mask, grad) -> tuple[float, float]:
    """(output, gradient) largest difference from float32 attention of the same bf16 inputs, relative."""
    mine = [t.detach().bfloat16().requires_grad_() for t in base]
    ref = [t.detach().bfloat16().float().requires_grad_() for t in base]
    out = fn(*mine, mask)
    want = F.scaled_dot_product_attention(*ref, attn_mask=mask)
    out.backward(grad.bfloat16())
    want.backward(grad.bfloat16().float())
    rows = mask[:, 0, 0, :, None].expand_as(want[:, 0])[:, None].expand_as(want)  # real query rows
    out_err = (out.float() - want)[rows].abs().max() / want[rows].abs().max()
    grad_err = max(((a.grad.float() - b.grad)[rows].abs().max() / b.grad[rows].abs().max()).item()
                   for a, b in zip(mine, ref))
    return out_err.item(), grad_err


def measure(mode: str, B: int, T: int, device: torch.device, repeats: int) -> dict:
    q, k, v, mask, grad = inputs(B, T, device)
    variants = {"bf16": (bf16, torch.bfloat16), "float32 with casts": (upcast, torch.bfloat16),
                "float32": (bf16, torch.float32)}
    compiled = mode == "infer" and device.type == "cpu" and kernels.available("attention")
    if compiled:  # what moembed's CPU inference runs (`fast.attention.compiled_attention`)
        lengths = mask[:, 0, 0, :].sum(1)

        def mine(q, k, v, mask):
            return fast_attention.compiled_attention(q, k, v, lengths)

        variants |= {"compiled bf16": (mine, torch.bfloat16), "compiled float32": (mine, torch.float32)}
    calls = {}
    for name, (fn, dtype) in variants.items():
        xs = [t.to(dtype, copy=True).requires_grad_(mode == "train") for t in (q, k, v)]
        g = grad.to(dtype)

        def call(fn=fn, xs=xs, g=g):
            if mode == "train":
                for x in xs:
                    x.grad = None
                fn(*xs, mask).backward(g)
            else:
                with torch.no_grad():
                    fn(*xs, mask)

        calls[name] = call
    times = {name: [] for name in calls}
    for name, call in calls.items():  # warm-up: oneDNN and the kernels' first-call costs
        for _ in range(3):
            call()
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(timed(call, device, 1))
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    row = {"mode": mode, "B": B, "T": T, "ms": ms, "bf16_over_cast": ms["bf16"] / ms["float32 with casts"]}
    if compiled:
        row["torch_over_compiled"] = {p: ms[p] / ms[f"compiled {p}"] for p in ("float32", "bf16")}
    if mode == "train":
        pairs = (("bf16", bf16), ("float32 with casts", upcast))
        row["error"] = {name: errors(fn, (q, k, v), mask, grad) for name, fn in pairs}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}; {cpu_flags()}")
    rows = [measure(mode, B, T, device, args.repeats) for mode, shapes in SHAPES.items() for B, T in shapes]
    head = f"{'mode':<6} {'B':>3} {'T':>4} {'bf16 ms':>9} {'f32+casts':>10} {'float32':>9} {'bf16 / casts':>13}"
    print(f"\n{head}  error")
    for r in rows:
        err = ""
        if "error" in r:
            err = "  ".join(f"{n}: out {o:.4f}, grad {g:.4f}" for n, (o, g) in r["error"].items())
        if "torch_over_compiled" in r:
            err = (f"compiled: float32 {r['ms']['compiled float32']:.2f} ms "
                   f"({r['torch_over_compiled']['float32']:.2f}x torch's speed), bf16 {r['ms']['compiled bf16']:.2f}"
                   f" ms ({r['torch_over_compiled']['bf16']:.2f}x)")
        print(f"{r['mode']:<6} {r['B']:>3} {r['T']:>4} {r['ms']['bf16']:9.2f} {r['ms']['float32 with casts']:10.2f} "
              f"{r['ms']['float32']:9.2f} {r['bf16_over_cast']:12.2f}x  {err}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "cpu": cpu_flags(), "repeats": args.repeats}, indent=1))


if __name__ == "__main__":
    main()
