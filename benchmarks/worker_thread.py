"""Multi-threaded operators called from the main thread against the same calls from a second thread.

    OMP_NUM_THREADS=2 python benchmarks/worker_thread.py [--repeats 300]
    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 python benchmarks/worker_thread.py   # workers asleep between regions

`moembed serve` runs its forward passes on the batcher's worker thread, not on the thread that started the
process. This times, on each of the two, a few operators of one short text's forward pass (8 rows of
all-MiniLM-L6-v2's shapes): a packed float32 linear layer (oneDNN), MKL's `F.linear`, GELU (torch's own thread
pool) and a single-threaded `add` as the control. Prints the median microseconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch
import torch.nn.functional as F

from moembed.model.linear import pack, packed_linear


def median_us(f, repeats: int) -> float:
    for _ in range(20):
        f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def in_inference_mode(fn, *a):
    with torch.inference_mode():  # a thread-local switch: the second thread sets its own
        return fn(*a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x, h = torch.randn(8, 384), torch.randn(8, 1536)  # (rows, d), (rows, intermediate)
    w = torch.randn(1536, 384)
    wp = pack(w, torch.float32)
    ops = {"packed linear 384->1536": lambda: packed_linear(x, wp, None), "F.linear 384->1536": lambda: F.linear(x, w),
           "GELU 8x1536": lambda: F.gelu(h), "add 8x384 (one thread)": lambda: x + x}
    print(f"{args.threads} torch threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    with torch.inference_mode():
        for name, f in ops.items():
            main_us = median_us(f, args.repeats)
            other: list[float] = []
            t = threading.Thread(target=lambda: other.append(in_inference_mode(median_us, f, args.repeats)))
            t.start()
            t.join()
            print(f"  {name:<24} main thread {main_us:7.1f} us  second thread {other[0]:7.1f} us  "
                  f"ratio {other[0] / main_us:4.2f}x")


if __name__ == "__main__":
    main()
