"""Results on disk: a JSON file in an MTEB-like schema, a markdown table, and PNG plots.

A result directory holds:
    results.json        {"model_name", "model_hash", "moembed_version", "results": [entry, ...]}, where each
                        entry is {"task_name", "task_type", "split", "scores", "main_score", "evaluation_time",
                        "dim", "precision", "max_length", "dynamic_ntk", "note", "extra", "model_name",
                        "model_hash", "moembed_version"} — MTEB's per-task fields, one entry per setting.
    results.md          the markdown table of `markdown_table`
    score_vs_dim.png, score_vs_precision.png, score_vs_length.png   when the sweep has more than one point
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from moembed.errors import MoembedError
from moembed.eval.runner import TaskResult
from moembed.figures import new_figure, save_png
from moembed.fileio import atomic_path
from moembed.version import __version__

SCHEMA_KEYS = ("task_name", "task_type", "split", "scores", "main_score", "evaluation_time", "dim", "precision",
               "max_length", "dynamic_ntk", "model_name", "model_hash", "moembed_version")


def to_json(results: list[TaskResult], model_name: str, model_hash: str | None) -> dict:
    entries = [{**r.to_dict(), "model_name": model_name, "model_hash": model_hash, "moembed_version": __version__}
               for r in results]
    return {"model_name": model_name, "model_hash": model_hash, "moembed_version": __version__, "results": entries}


def read_results(directory: str | Path) -> dict:
    """Load and check a result directory's results.json."""
    f = Path(directory) / "results.json"
    if not f.exists():
        raise MoembedError(f"{f}: missing file (not a moembed result directory)")
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise MoembedError(f"{f}:{e.lineno}: invalid JSON ({e.msg})") from None
    for i, entry in enumerate(doc.get("results", [])):
        missing = [k for k in SCHEMA_KEYS if k not in entry]
        if missing:
            raise MoembedError(f"{f}: results[{i}] lacks key {missing[0]!r}")
    return doc


def _setting(e: dict) -> str:
    parts = [f"d{e['dim']}" if e.get("dim") else "", e.get("precision", "float32")]
    if e.get("max_length"):
        parts.append(f"len{e['max_length']}")
    if e.get("dynamic_ntk") is not None:
        parts.append("ntk" if e["dynamic_ntk"] else "no-ntk")
    return " ".join(p for p in parts if p)


def markdown_table(doc: dict) -> str:
    """One row per (task, setting): main score ×100, % retained, other scores."""
    head = f"Model `{doc['model_name']}` (weights sha256 `{doc['model_hash']}`), moembed {doc['moembed_version']}"
    lines = [head, "",
             "| task | type | setting | main score | retained % | other scores | time (s) |",
             "|---|---|---|---:|---:|---|---:|"]
    for e in doc["results"]:
        other = ", ".join(f"{k} {v * 100:.2f}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in e["scores"].items())
        kept = e.get("extra", {}).get("retained_pct")
        note = f" ({e['note']})" if e.get("note") else ""
        lines.append(f"| {e['task_name']} | {e['task_type']} | {_setting(e)}{note} | {e['main_score'] * 100:.2f} | "
                     f"{'' if kept is None else f'{kept:.1f}'} | {other} | {e['evaluation_time']:.1f} |")
    return "\n".join(lines) + "\n"


def _plot(path: Path, title: str, xlabel: str, series: dict[str, list[tuple]], categorical: bool = False) -> None:
    from matplotlib import colormaps

    fig = new_figure((9, 4.5))
    ax = fig.subplots()
    tasks = sorted({label.split(" ")[0] for label in series})
    colors = {t: colormaps["tab10"](i % 10) for i, t in enumerate(tasks)}
    styles = {"int8": "--", "binary": ":", "no-ntk": "--"}
    for label, pts in sorted(series.items()):
        xs, ys = zip(*pts)
        style = styles.get(label.split(" ")[-1], "-")  # one colour per task, one line style per variant
        ax.plot([str(x) for x in xs] if categorical else xs, [y * 100 for y in ys], marker="o", label=label,
                color=colors[label.split(" ")[0]], linestyle=style)
    ax.set(title=title, xlabel=xlabel, ylabel="main score (×100)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    save_png(fig, path, bbox_inches="tight")


def write_plots(doc: dict, out: Path) -> list[Path]:
    """Score vs Matryoshka dim (per task × precision), vs precision (full dim), vs max length (per task × NTK)."""
    by_dim, by_prec, by_len = defaultdict(list), defaultdict(list), defaultdict(list)
    full = max((e["dim"] or 0 for e in doc["results"]), default=0)
    order = {"float32": 0, "int8": 1, "binary": 2}
    for e in doc["results"]:
        if "requested_max_length" in e.get("extra", {}):
            ntk = {True: " ntk", False: " no-ntk"}.get(e["dynamic_ntk"], "")
            by_len[e["task_name"] + ntk].append((e["extra"]["requested_max_length"], e["main_score"]))
            continue
        by_dim[f"{e['task_name']} {e['precision']}"].append((e["dim"], e["main_score"]))
        if e["dim"] == full:
            by_prec[e["task_name"]].append((order.get(e["precision"], 3), e["precision"], e["main_score"]))
    written = []
    if any(len(v) > 1 for v in by_dim.values()):
        series = {k: sorted(v) for k, v in by_dim.items()}
        _plot(out / "score_vs_dim.png", "Score vs Matryoshka dimension", "dimension", series)
        written.append(out / "score_vs_dim.png")
    if any(len(v) > 1 for v in by_prec.values()):
        series = {k: [(p, s) for _, p, s in sorted(v)] for k, v in by_prec.items()}
        _plot(out / "score_vs_precision.png", "Score vs precision (full dim)", "precision", series, categorical=True)
        written.append(out / "score_vs_precision.png")
    if any(len(v) > 1 for v in by_len.values()):
        series = {k: sorted(v) for k, v in by_len.items()}
        _plot(out / "score_vs_length.png", "Retrieval vs maximum length", "max tokens", series)
        written.append(out / "score_vs_length.png")
    return written


def write_results(results: list[TaskResult], out: str | Path, model_name: str, model_hash: str | None) -> dict:
    """Write results.json, results.md and the plots into `out`; returns the JSON document."""
    out = Path(out)
    doc = to_json(results, model_name, model_hash)
    with atomic_path(out / "results.json") as tmp:
        tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    with atomic_path(out / "results.md") as tmp:
        tmp.write_text(markdown_table(doc), encoding="utf-8")
    write_plots(doc, out)
    return doc
