"""MoEE on moembed MoE encoders: HS vs RW vs MoEE(concat) vs MoEE(sum) on the evaluation dev suite.

    python benchmarks/moee_encoder.py MODEL_DIR [MODEL_DIR ...] --alphas 0.5,1,2 [--suite-dir DIR | --tasks DIR ...] [--out res.json]

Each model's texts are encoded once (HS and RW come from the same forward pass); the combinations are then
scored by moembed.eval on every task of the dev suite. Prints one markdown table per model (main score per task,
and the mean over tasks).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moembed.eval import evaluate, load_task
from moembed.eval.suite import build_suite
from moembed.moee import Features, MoEEModel, SumModel, load_source


class CachedSource:
    """Wraps an HS/RW source so each (prompt, text) is encoded once across all combinations."""

    def __init__(self, source):
        self.source, self.name, self.prompts = source, source.name, source.prompts
        self.hs_dim, self.rw_dim = source.hs_dim, source.rw_dim
        self.memo: dict[tuple[str | None, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def settings(self) -> dict:
        return self.source.settings()

    def features(self, texts, prompt=None, batch_size=32, show_progress=False) -> Features:
        todo = sorted({t for t in texts if (prompt, t) not in self.memo})
        if todo:
            f = self.source.features(todo, prompt=prompt, batch_size=batch_size, show_progress=show_progress)
            for i, t in enumerate(todo):
                self.memo[(prompt, t)] = (f.hs[i], f.rw[i])
        rows = [self.memo[(prompt, t)] for t in texts]
        return Features(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))


def run(model_dir: str, tasks, alphas: list[float], batch_size: int, device: str = "cpu") -> dict:
    loaded = load_source(model_dir, bf16=False)
    if hasattr(loaded, "embedder"):  # an encoder: its Embedder runs on the device asked for
        loaded.embedder.to(device)
    source = CachedSource(loaded)
    variants = {"HS": MoEEModel(source, "hs"), "RW": MoEEModel(source, "rw"), "concat": MoEEModel(source, "concat")}
    variants.update({f"sum α={a:g}": SumModel(source, a) for a in alphas})
    table = {}
    for label, model in variants.items():
        t0 = time.perf_counter()
        results = evaluate(model, tasks, batch_size=batch_size)
        table[label] = {r.task_name: round(100 * r.main_score, 2) for r in results}
        print(f"  {label}: {time.perf_counter() - t0:.0f}s", flush=True)
    return table


def markdown(table: dict) -> str:
    tasks = list(next(iter(table.values())))
    head = "| variant | " + " | ".join(tasks) + " | mean |\n|---|" + "---|" * (len(tasks) + 1) + "\n"
    rows = []
    for label, scores in table.items():
        mean = sum(scores.values()) / len(scores)
        rows.append(f"| {label} | " + " | ".join(f"{scores[t]:.2f}" for t in tasks) + f" | {mean:.2f} |")
    return head + "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--suite-dir", default="dev-suite")
    ap.add_argument("--alphas", default="0.5,1,2")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tasks", nargs="+", default=None,
                    help="task directories to use instead of the dev suite (e.g. a quickstart run's data/*/test)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    args = ap.parse_args()
    if args.tasks:
        tasks = [load_task(d) for d in args.tasks]
        for t, d in zip(tasks, args.tasks):
            if t.name == "test":  # a builder's held-out split: name it after its dataset
                t.name = Path(d).resolve().parent.name
    else:
        tasks = [load_task(d) for d in build_suite(args.suite_dir)]
    alphas = [float(a) for a in args.alphas.split(",")]
    report = {}
    for m in args.models:
        print(f"{m}:", flush=True)
        report[m] = run(m, tasks, alphas, args.batch_size, args.device)
        print(markdown(report[m]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
