"""What this machine's matmul kernels allow: float32, bf16 and int8 on the linear layers of one encoder layer.

    OMP_NUM_THREADS=2 python benchmarks/gemm_ceiling.py [--tokens 2048] [--repeats 5] [--device cuda] [--json F]

The encode-speed goals for reduced precision (bf16 >= 1.6x float32, int8 >= 2x; BENCHMARKS.md, "Reduced-precision
encode") assume kernels with twice and four times float32's peak (AVX-512 BF16 / AMX, VNNI). This measures the
kernels themselves on all-MiniLM-L6-v2's layer shapes (q, k, v, o: 384 -> 384; fc1: 384 -> 1536; fc2: 1536 -> 384)
for `--tokens` packed tokens, so an encode ratio can be read against the ceiling the CPU sets:

- float32 `PackedLinear` on oneDNN-packed weights (moembed's inference path where `packing_pays`, AVX-512 CPUs;
  swapped in by `backends.use(..., "fast")`);
- float32 `F.linear` (the BLAS with the weight in its stored layout; moembed's inference path elsewhere);
  whichever of the two is moembed's default on this CPU is the baseline of every ratio;
- bf16 `F.linear` on bf16 weights and inputs (the matmul bf16 autocast runs);
- bf16 `PackedLinear` under autocast on oneDNN-packed bf16 weights (moembed's bf16 inference path where bf16 is
  native);
- int8 GEMM alone (CPU: fbgemm's kernel on inputs quantised beforehand, and oneDNN's where the CPU has VNNI;
  GPU: `torch._int_mm`);
- int8 `Int8Linear` (moembed's `--dtype int8` path: per-row dynamic quantisation, the GEMM, rescaling, outliers),
  each layer set up as `quantize_int8` sets up an encoder's (outlier channels from the input's ranges), on the kernel
  `fast.int8.int8_kernel` picks for this CPU, and on fbgemm's beside it where that is oneDNN's.

Variants run in turn within each repeat (medians over repeats), after a warm-up. On a GPU the moembed `Linear`
rows are skipped (their fast paths are CPU-only) and times are synchronised.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from precision import cpu_flags  # noqa: E402

from moembed.model import backends  # noqa: E402
from moembed.model.cpu import int8_available  # noqa: E402
from moembed.model.fast.int8 import Int8Linear, Int8Setup, int8_kernel, pack_int8  # noqa: E402
from moembed.model.fast.packed import PackedLinear  # noqa: E402
from moembed.model.linear import Linear  # noqa: E402
from moembed.model.settings import Settings  # noqa: E402

SHAPES = [(384, 384)] * 4 + [(384, 1536), (1536, 384)]  # (in, out): q, k, v, o, fc1, fc2


def flops(tokens: int) -> float:
    return sum(2.0 * tokens * k * n for k, n in SHAPES)


def timed(fn, device: torch.device, iters: int) -> float:
    """Seconds per call of `fn` (the layer's six matmuls), over `iters` calls."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def variants(tokens: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    xs = {k: torch.randn(tokens, k, device=device) for k in (384, 1536)}
    weights = [(torch.randn(n, k, device=device) / k**0.5, torch.randn(n, device=device)) for k, n in SHAPES]
    out = {}

    def plain():
        for (w, b), (k, _) in zip(weights, SHAPES):
            F.linear(xs[k], w, b)

    out["float32 F.linear"] = plain

    xs16 = {k: x.bfloat16() for k, x in xs.items()}
    w16 = [(w.bfloat16(), b.bfloat16()) for w, b in weights]

    def bf16():
        for (w, b), (k, _) in zip(w16, SHAPES):
            F.linear(xs16[k], w, b)

    out["bf16 F.linear"] = bf16

    if device.type == "cpu" and int8_available():
        # fbgemm's u8 x s8 GEMM on an input quantised beforehand (static quantisation: the kernel and its requantised
        # output, without the per-call input quantisation of the dynamic path)
        with warnings.catch_warnings():  # the eager quantised-tensor API is deprecated; its kernels are not
            warnings.simplefilter("ignore")
            qxs = {k: torch.quantize_per_tensor(x, x.abs().max().item() / 127, 128, torch.quint8) for k, x in xs.items()}
            packed = [torch.ops.quantized.linear_prepack(
                torch.quantize_per_tensor(w, w.abs().max().item() / 127, 0, torch.qint8), b) for w, b in weights]

        def int8_gemm():
            for w, (k, _) in zip(packed, SHAPES):
                torch.ops.quantized.linear(qxs[k], w, 0.05, 128)

        out["int8 GEMM alone (fbgemm, static)"] = int8_gemm
        if int8_kernel() == "onednn":  # oneDNN's u8 x s8 GEMM on codes made beforehand, float32 out
            q8 = {k: torch.randint(0, 256, (tokens, k), dtype=torch.uint8) for k in (384, 1536)}
            one = [pack_int8(w, b, None, "onednn") for w, b in weights]

            def onednn_gemm():
                for w, (k, _) in zip(one, SHAPES):
                    torch.ops.onednn.qlinear_pointwise(q8[k], 1 / 127, 128, w.packed, w.scale, w.zero, w.bias, 1.0,
                                                       0, torch.float32, "none", [], "")

            out["int8 GEMM alone (oneDNN, static)"] = onednn_gemm
    elif device.type == "cuda":
        xs8 = {k: torch.randint(-127, 128, (tokens, k), dtype=torch.int8, device=device) for k in (384, 1536)}
        w8 = [torch.randint(-127, 128, (k, n), dtype=torch.int8, device=device) for k, n in SHAPES]

        def int8_gemm():
            for w, (k, _) in zip(w8, SHAPES):
                torch._int_mm(xs8[k], w)  # int8 x int8 -> int32

        out["int8 GEMM alone (torch._int_mm)"] = int8_gemm

    if device.type == "cpu":

        def linears() -> torch.nn.ModuleList:
            model = torch.nn.ModuleList([Linear(k, n) for k, n in SHAPES]).eval()
            for layer, (w, b) in zip(model, weights):
                layer.load_state_dict({"weight": w, "bias": b})
            return model

        def swapped(model: torch.nn.ModuleList, path: str, autocast: torch.dtype | None = None) -> torch.nn.ModuleList:
            """`model` on the "fast" backend (packing on, whatever this CPU's default): the path measured is the one
            named."""
            backend = backends.use(model, "fast", autocast)
            assert backend.path("linear") == path, backend
            assert all(isinstance(layer, PackedLinear) for layer in model), [type(m) for m in model]
            return model

        layers = swapped(linears(), "packed")

        def packed_layers():
            for layer, (k, _) in zip(layers, SHAPES):
                layer(xs[k])

        out["float32 moembed Linear (packed)"] = packed_layers
        if Settings().bf16_packing():  # native bf16 only: where it is emulated, autocast's plain call is kept
            layers16 = swapped(linears(), "packed-bf16", torch.bfloat16)

            def packed_bf16_layers():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    for layer, (k, _) in zip(layers16, SHAPES):
                        layer(xs[k])

            out["bf16 moembed Linear (packed, autocast)"] = packed_bf16_layers
        if int8_available():
            for kernel in dict.fromkeys([int8_kernel(settings=Settings()), "fbgemm"]):  # this CPU's, and fbgemm's beside oneDNN's
                # as `quantize_int8` swaps an encoder's layers; amax (k,): the float32 outlier channels
                int8_model = [Int8Linear.from_plain(layer, Int8Setup(kernel, xs[k].abs().amax(0)))
                              for layer, (k, _) in zip(linears(), SHAPES)]

                def int8_layers(int8_model=int8_model):
                    for layer, (k, _) in zip(int8_model, SHAPES):
                        layer(xs[k])

                out[f"int8 moembed Linear (dynamic, {kernel})"] = int8_layers
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="packed tokens per call (32 texts of 64 tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0, help="target time per variant per repeat")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    cpu = cpu_flags()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}; {cpu}")

    with torch.no_grad():
        runs = variants(args.tokens, device)
        iters = {}
        for name, fn in runs.items():  # warm-up, and calls per repeat sized to about --seconds
            fn()
            iters[name] = max(1, round(args.seconds / timed(fn, device, 2)))
        times = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, fn in runs.items():
                times[name].append(timed(fn, device, iters[name]))

    base = "float32 moembed Linear (packed)" if device.type == "cpu" and Settings().packing() else "float32 F.linear"
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = [{"variant": name, "ms": 1e3 * s, "gflops": flops(args.tokens) / s / 1e9, "vs_float32": med[base] / s}
            for name, s in med.items()]
    print(f"\none encoder layer's linear layers, {args.tokens} tokens, median of {args.repeats}:")
    print(f"{'variant':<40} {'ms':>8} {'GFLOP/s':>9} {'x ' + base:>10}")
    for r in rows:
        print(f"{r['variant']:<40} {r['ms']:8.2f} {r['gflops']:9.1f} {r['vs_float32']:9.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"tokens": args.tokens, "baseline": base, "rows": rows,
                                         "cpu": cpu}, indent=1))


if __name__ == "__main__":
    main()
