"""The quickstart report: headline table, plots, exported models and the MoE model card.

Written into <out>/report/:
    README.md            the report: headline table (honest about MoE vs dense), data, settings, plots
    results.json         every model × task × dim × precision result (MTEB-like entries)
    results.md           the full tables
    training_loss.png, expert_load.png, score_vs_dim.png
    models/moe, models/dense                     moembed format (models/moe/README.md is the model card)
    models/moe-st, models/dense-st               sentence-transformers format
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moembed.figures import new_figure, save_png
from moembed.fileio import atomic_path
from moembed.version import __version__

LABELS = {"base": "all-MiniLM-L6-v2 (base)", "dense": "dense, finetuned (control)", "moe": "MoE, upcycled + finetuned"}


def _results(out: Path) -> dict[str, list[dict]]:
    return {m: json.loads((out / "eval" / m / "results.json").read_text())["results"] for m in LABELS}


def _avg(entries: list[dict], dim: int | None, precision: str) -> float:
    xs = [e["main_score"] for e in entries if e["precision"] == precision and (e["dim"] == dim or dim is None)]
    return sum(xs) / len(xs) if xs else float("nan")


def headline(results: dict[str, list[dict]], full: int) -> tuple[str, dict]:
    """Markdown table: per model, mean nDCG@10 over the test sets at each dim (float32) and precision (full dim)."""
    tasks = sorted({e["task_name"] for e in results["base"]})
    dims = sorted({e["dim"] for e in results["base"]}, reverse=True)
    precs = [p for p in ("float32", "int8", "binary") if any(e["precision"] == p for e in results["base"])]
    head = ["model", *[t.split("/")[0] for t in tasks], *[f"avg d{d}" for d in dims], *[f"avg {p}" for p in precs[1:]]]
    rows, summary = [], {}
    for m, entries in results.items():
        per_task = [next((e["main_score"] for e in entries if e["task_name"] == t and e["dim"] == full
                          and e["precision"] == "float32"), float("nan")) for t in tasks]
        by_dim = [_avg(entries, d, "float32") for d in dims]
        by_prec = [_avg(entries, full, p) for p in precs[1:]]
        summary[m] = {"full": by_dim[0], "per_task": dict(zip(tasks, per_task)),
                      "dims": dict(zip(dims, by_dim)), "precisions": dict(zip(precs[1:], by_prec))}
        rows.append([LABELS[m], *[f"{100 * x:.1f}" for x in per_task + by_dim + by_prec]])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines), summary


def verdict(summary: dict) -> str:
    moe, dense, base = summary["moe"]["full"], summary["dense"]["full"], summary["base"]["full"]
    diff = 100 * (moe - dense)
    if diff > 0.5:
        s = f"The MoE model beats the dense control by {diff:.1f} nDCG@10 points on average at full dimension."
    elif diff < -0.5:
        s = (f"The MoE model does NOT beat the dense control at this scale: it is {-diff:.1f} nDCG@10 points "
             "lower on average at full dimension.")
    else:
        s = f"The MoE model and the dense control are within {abs(diff):.1f} nDCG@10 points of each other: no clear winner at this scale."
    s += f" Finetuning moved the dense model by {100 * (dense - base):+.1f} and the MoE model by {100 * (moe - base):+.1f} points against the base model."
    return s


def _plots(qs, report: Path, results: dict[str, list[dict]], full: int) -> list[str]:
    from moembed.train.plots import read_metrics

    written = []
    fig = new_figure((6.5, 3.5))
    ax = fig.subplots()
    for kind in ("dense", "moe"):
        recs = read_metrics(qs.out / "runs" / kind / "metrics.jsonl")
        key = "contrastive" if recs and recs[0].get("contrastive") is not None else "loss"
        ax.plot([r["step"] for r in recs], [r[key] for r in recs], lw=1, label=f"{kind} ({key})")
    ax.set_xlabel("step")
    ax.set_ylabel("InfoNCE loss (Matryoshka sum)")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(save_png(fig, report / "training_loss.png", bbox_inches="tight").name)

    moe_plots = qs.out / "runs" / "moe" / "plots" / "expert_load.png"
    if moe_plots.exists():
        shutil.copy2(moe_plots, report / "expert_load.png")
        written.append("expert_load.png")

    fig = new_figure((6.5, 3.5))
    ax = fig.subplots()
    for m, entries in results.items():
        dims = sorted({e["dim"] for e in entries})
        ax.plot(dims, [100 * _avg(entries, d, "float32") for d in dims], marker="o", label=LABELS[m])
    ax.set_xlabel("Matryoshka dimension")
    ax.set_ylabel("mean nDCG@10 (float32)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    written.append(save_png(fig, report / "score_vs_dim.png", bbox_inches="tight").name)
    return written


def _probe(qs) -> list[str]:
    """Expert load per MoE layer of the finetuned model on the test queries and documents."""
    from moembed.eval.registry import load_task
    from moembed.model.embedder import Embedder
    from moembed.model.utilisation import format_report, probe

    texts = []
    for name in qs.cfg.datasets:
        corpus = load_task(qs.out / "data" / name / "test").data["corpus"]
        texts += list(corpus.values())[:200]
    return format_report(probe(Embedder.load(qs.out / "runs" / "moe" / "model"), texts, prefix="search_document: "))


def write_report(qs) -> dict:
    from moembed.model.embedder import Embedder
    from moembed.model.io import export_sentence_transformers

    out, report = qs.out, qs.out / "report"
    report.mkdir(parents=True, exist_ok=True)
    results = _results(out)
    full = max(e["dim"] for e in results["base"])
    table, summary = headline(results, full)
    with atomic_path(report / "results.json") as tmp:
        tmp.write_text(json.dumps({"moembed_version": __version__, "results": results}, indent=2) + "\n")
    with atomic_path(report / "results.md") as tmp:
        tmp.write_text("\n\n".join((out / "eval" / m / "results.md").read_text() for m in LABELS))
    plots = _plots(qs, report, results, full)
    for kind in ("moe", "dense"):
        emb = Embedder.load(out / "runs" / kind / "model")
        emb.save(report / "models" / kind)
        export_sentence_transformers(emb, report / "models" / f"{kind}-st")
    stages = {p.stem: json.loads(p.read_text()) for p in (out / "stages").glob("*.json")}
    load_lines = _probe(qs)
    text = _report_text(qs, table, verdict(summary), plots, stages, load_lines)
    with atomic_path(report / "README.md") as tmp:
        tmp.write_text(text)
    with atomic_path(report / "models" / "moe" / "README.md") as tmp:
        tmp.write_text(_model_card(qs, table, summary, stages, load_lines))
    return {"summary": summary, "verdict": verdict(summary), "table": table}


def _settings(qs) -> str:
    t = qs.cfg.train
    return (
        f"- base: all-MiniLM-L6-v2 (6 layers, 384 wide); MoE: every {qs.cfg.every}nd MLP upcycled to "
        f"{qs.cfg.experts} experts, top-{qs.cfg.top_k}, renormalised gates (nomic-embed-v2 §4.3)\n"
        f"- finetuning: {t.steps} steps, batch {t.batch_size} (one source per batch), {t.hard_negatives} mined hard "
        f"negative(s) per query, InfoNCE τ = {t.temperature}, Matryoshka dims {t.matryoshka_dims}, load-balancing "
        f"α = {t.aux_loss_coef} (MoE only), AdamW lr {t.lr} with {t.warmup_steps} warmup steps and linear decay, "
        f"max lengths {t.max_query_length}/{t.max_doc_length} tokens, bf16 autocast {'on' if t.bf16 else 'off'}\n"
        f"- data curation: consistency filtering top-{qs.cfg.filter_top_k} and positive-aware mining "
        f"({qs.cfg.num_negatives} negatives, margin {qs.cfg.margin}) with all-MiniLM-L6-v2 as teacher\n"
    )


def _data_lines(stages: dict) -> str:
    d = stages.get("data", {}).get("datasets", {})
    f = stages.get("curate", {}).get("filter", {}).get("sources", {})
    lines = ["| dataset | training pairs built | test queries / documents |", "|---|---|---|"]
    for name, c in d.items():
        test = c.get("test", {})
        lines.append(f"| {name} | {c.get('train')} | {test.get('queries', '?')} / {test.get('documents', test.get('corpus', '?'))} |")
    lines += ["", "| source | pairs | kept by consistency filtering |", "|---|---|---|"]
    for s, c in sorted(f.items()):
        lines.append(f"| {s} | {c['pairs']} | {c['kept']} ({100 * c['kept'] / max(c['pairs'], 1):.0f}%) |")
    return "\n".join(lines)


def _report_text(qs, table, verdict_text, plots, stages, load_lines) -> str:
    secs = sum(v.get("seconds", 0) for v in stages.values())
    return (
        "# moembed quickstart report\n\n"
        "Mean nDCG@10 ×100 on the held-out test sets (documents never seen in training). Columns per test set are "
        "at full dimension in float32; `avg dN` averages over test sets at Matryoshka dimension N; `avg int8` and "
        "`avg binary` at full dimension.\n\n"
        f"{table}\n\n**{verdict_text}**\n\n"
        "## Settings\n\n" + _settings(qs) + f"\nTotal time of the stages: {secs / 60:.1f} minutes.\n\n"
        "## Data\n\n" + _data_lines(stages) + "\n\n"
        "## Expert load of the finetuned MoE model (test documents)\n\n" + "\n".join(f"    {x}" for x in load_lines) + "\n\n"
        "## Plots\n\n" + "\n".join(f"![{p}]({p})" for p in plots) + "\n\n"
        "## Files\n\n- `results.json`, `results.md`: every model × test set × dimension × precision\n"
        "- `models/moe`, `models/dense`: moembed format; `models/moe-st`, `models/dense-st`: sentence-transformers format\n"
    )


def _model_card(qs, table, summary, stages, load_lines) -> str:
    m = summary["moe"]
    return (
        "# minilm-moe\n\nA sparse Mixture-of-Experts text-embedding model made by `moembed quickstart`: "
        "all-MiniLM-L6-v2 upcycled to an MoE encoder and finetuned contrastively with mined hard negatives "
        "(the Nomic Embed v2 recipe at laptop scale).\n\n"
        "## Use\n\n```python\nfrom moembed import Embedder\nm = Embedder.load(\"models/moe\")\n"
        "q = m.encode_query([\"how do plants make food\"])   # prompt_name=\"search_query\"\n"
        "d = m.encode([\"Photosynthesis turns light into chemical energy.\"], prompt_name=\"search_document\", truncate_dim=256)\n```\n\n"
        "Prefixes: `search_query: `, `search_document: `, `classification: `, `clustering: `. Matryoshka dimensions "
        f"{qs.cfg.train.matryoshka_dims} were trained. A sentence-transformers copy is in `../moe-st`: `SentenceTransformer(\"models/moe-st\", trust_remote_code=True)` (its encoder module is moembed's own, so moembed must be installed).\n\n"
        "## Training\n\n" + _settings(qs) + "\n## Data\n\n" + _data_lines(stages) + "\n\n"
        f"## Scores (nDCG@10 ×100, held-out test sets)\n\n{table}\n\n"
        f"Mean at full dimension: {100 * m['full']:.1f}. {verdict(summary)}\n\n"
        "## Expert load (test documents)\n\n" + "\n".join(f"    {x}" for x in load_lines) + "\n"
    )


def print_headline(result: dict) -> None:
    print("\n" + result["table"] + "\n\n" + result["verdict"])
