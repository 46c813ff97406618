"""The quickstart report: headline table, plots, exported models and the MoE model card.

Written into <out>/report/:
    README.md            the report: headline table (honest about MoE vs dense), the recipe's decisions (split
                         sizes, pairs kept per source, negatives per query, steps, learning rate) with a warning
                         when the data is too small for the MoE to be expected to help, dev suite, data, plots
    results.json         every model × task × dim × precision result (MTEB-like entries)
    results.md           the full tables
    training_loss.png, expert_load.png, score_vs_dim.png
    models/moe, models/dense                     moembed format
    models/moe-st, models/dense-st               sentence-transformers format
                                                 (each with its model card, README.md: `quickstart_card`)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from moembed.figures import new_figure, save_png
from moembed.fileio import atomic_path
from moembed.recipes import report_text as _text
from moembed.recipes.report_text import MOE_DATA_SCALE, base_label  # noqa: F401 (MOE_DATA_SCALE: public)
from moembed.version import __version__

if TYPE_CHECKING:
    from moembed.recipes.context import RecipeContext

LABELS = {"base": "base", "dense": "dense, finetuned (control)", "moe": "MoE, upcycled + finetuned"}
def _results(out: Path, sub: str = "eval") -> dict[str, list[dict]]:
    return {m: json.loads((out / sub / m / "results.json").read_text())["results"] for m in LABELS}


def _avg(entries: list[dict], dim: int | None, precision: str) -> float:
    xs = [e["main_score"] for e in entries if e["precision"] == precision and (e["dim"] == dim or dim is None)]
    return sum(xs) / len(xs) if xs else float("nan")


def headline(results: dict[str, list[dict]], full: int, labels: dict | None = None) -> tuple[str, dict]:
    """Markdown table: per model, mean nDCG@10 over the test sets at each dim (float32) and precision (full dim)."""
    labels = labels or {}
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
        rows.append([labels.get(m, LABELS[m]), *[f"{100 * x:.1f}" for x in per_task + by_dim + by_prec]])
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


def _plots(ctx: RecipeContext, report: Path, results: dict[str, list[dict]], full: int) -> list[str]:
    from moembed.train.plots import read_metrics

    labels = {"base": base_label(ctx)}

    written = []
    fig = new_figure((6.5, 3.5))
    ax = fig.subplots()
    for kind in ("dense", "moe"):
        recs = read_metrics(ctx.out / "runs" / kind / "metrics.jsonl")
        key = "contrastive" if recs and recs[0].get("contrastive") is not None else "loss"
        ax.plot([r["step"] for r in recs], [r[key] for r in recs], lw=1, label=f"{kind} ({key})")
    ax.set_xlabel("step")
    ax.set_ylabel("InfoNCE loss (Matryoshka sum)")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(save_png(fig, report / "training_loss.png", bbox_inches="tight").name)

    moe_plots = ctx.out / "runs" / "moe" / "plots" / "expert_load.png"
    if moe_plots.exists():
        shutil.copy2(moe_plots, report / "expert_load.png")
        written.append("expert_load.png")

    fig = new_figure((6.5, 3.5))
    ax = fig.subplots()
    for m, entries in results.items():
        dims = sorted({e["dim"] for e in entries})
        ax.plot(dims, [100 * _avg(entries, d, "float32") for d in dims], marker="o", label=labels.get(m, LABELS[m]))
    ax.set_xlabel("Matryoshka dimension")
    ax.set_ylabel("mean nDCG@10 (float32)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    written.append(save_png(fig, report / "score_vs_dim.png", bbox_inches="tight").name)
    return written


def _probe(ctx: RecipeContext) -> list[str]:
    """Per MoE layer of the finetuned model on the test documents: expert load and router entropy, the experts'
    divergence, and the mutual information between expert and test set (moembed.model.diagnostics)."""
    from moembed.eval.registry import load_task
    from moembed.model.diagnostics import diagnose, format_diagnostics
    from moembed.model.embedder import Embedder
    from moembed.model.utilisation import format_report
    from moembed.recipes.curation import held_out_dirs

    texts, labels = [], []
    for name, path in held_out_dirs(ctx).items():
        docs = list(load_task(path).data["corpus"].values())[:200]
        texts += docs
        labels += [name] * len(docs)
    model = Embedder.load(ctx.out / "runs" / "moe" / "model", device=ctx.cfg.device)
    rows = diagnose(model, texts, labels, prefix="search_document: ")
    return format_report([r.utilisation for r in rows]) + format_diagnostics(rows)


def write_report(ctx: RecipeContext) -> dict:
    from moembed.model.embedder import Embedder
    from moembed.model.io import export_sentence_transformers, save_parts

    out, report = ctx.out, ctx.out / "report"
    report.mkdir(parents=True, exist_ok=True)
    results = _results(out)
    suite = _results(out, "eval-suite") if (out / "eval-suite" / "moe" / "results.json").exists() else None
    full = max(e["dim"] for e in results["base"])
    labels = {"base": base_label(ctx)}
    table, summary = headline(results, full, labels)
    suite_table = headline(suite, max(e["dim"] for e in suite["base"]), labels)[0] if suite else None
    with atomic_path(report / "results.json") as tmp:
        doc = {"moembed_version": __version__, "results": results, **({"dev_suite": suite} if suite else {})}
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
    with atomic_path(report / "results.md") as tmp:
        parts = [(out / "eval" / m / "results.md").read_text() for m in LABELS]
        if suite:
            parts += ["## Built-in dev suite"] + [(out / "eval-suite" / m / "results.md").read_text() for m in LABELS]
        tmp.write_text("\n\n".join(parts))
    plots = _plots(ctx, report, results, full)
    stages = {p.stem: json.loads(p.read_text()) for p in (out / "stages").glob("*.json")}
    load_lines = _probe(ctx)
    decisions = _text.decisions(ctx, stages)
    for kind in ("moe", "dense"):
        emb = Embedder.load(out / "runs" / kind / "model")
        card = quickstart_card(ctx, kind, results[kind], table, verdict(summary), stages, load_lines, decisions)
        save_parts(emb.parts(), report / "models" / kind, card)
        export_sentence_transformers(emb, report / "models" / f"{kind}-st", card)
    test_sets = stages.get("data", {}).get("test_sets")
    language_text = _text.languages(summary, test_sets) if test_sets else None
    with atomic_path(report / "README.md") as tmp:
        tmp.write_text(_text.report(ctx, table, verdict(summary), plots, stages, load_lines, decisions,
                                          suite_table, language_text))
    groups = _text.group_summary(summary, test_sets) if test_sets else None
    return {"summary": summary, "verdict": verdict(summary), "table": table, "decisions": decisions,
            "suite_table": suite_table, "languages": language_text, "groups": groups}


def quickstart_card(ctx: RecipeContext, kind: str, results: list[dict], table: str, verdict_text: str, stages: dict,
                    load_lines: list[str], decisions: dict):
    """What the model cards of the quickstart's finetuned models say beyond the model (`moembed.model.card`): the
    base model, languages and data, the recipe and its decisions, the evaluation (model-index: this model's own
    nDCG@10 per test set) and, for the MoE model, its expert load."""
    from moembed.model.card import CardInfo

    base = base_label(ctx)[: -len(" (base)")]
    what = "upcycled to a sparse Mixture-of-Experts encoder and finetuned" if kind == "moe" else "finetuned"
    warning = f"\n\n**Warning:** {decisions['warning']}" if decisions.get("warning") else ""
    test_sets = (stages.get("data", {}).get("test_sets") or {}).values()  # the multilingual preset's, with languages
    languages = sorted({t[k] for t in test_sets for k in ("query_lang", "doc_lang") if t.get(k)})
    languages = languages or ([] if ctx.cfg.user_data else ["en"])  # the built-in English data, or unknown
    sections = {"Expert load (test documents)": "\n".join(f"    {x}" for x in load_lines)} if kind == "moe" else {}
    return CardInfo(
        base_model=base, languages=languages, datasets=sorted(stages.get("data", {}).get("datasets", {})),
        summary=(f"A text-embedding model made by `moembed quickstart`: {base} {what} contrastively with mined hard "
                 f"negatives (the Nomic Embed v2 recipe at laptop scale). Matryoshka dimensions {ctx.matryoshka_dims} "
                 "were trained; prefixes `search_query: `, `search_document: `, `classification: `, `clustering: `."),
        training=_text.settings(ctx) + "\n" + _text._decision_lines(decisions), data=_text.data_lines(stages),
        results=results, evaluation=f"nDCG@10 ×100 on the held-out test sets.\n\n{table}\n\n{verdict_text}{warning}",
        sections=sections)


def print_headline(result: dict) -> None:
    """The end of `moembed quickstart`: the headline table (over many languages, the per-group summary; the full
    table is in the report), the verdict and the data-scale warning."""
    print("\n" + (result.get("groups") or result["table"]) + "\n\n" + result["verdict"])
    warning = (result.get("decisions") or {}).get("warning")
    if warning:
        print("\nWarning: " + warning)
