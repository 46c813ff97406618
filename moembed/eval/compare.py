"""Side-by-side comparison of result directories: main scores per (task, setting), differences vs the first."""

from __future__ import annotations

from pathlib import Path

from moembed.errors import MoembedError
from moembed.eval.report import _setting, read_results
from moembed.figures import new_figure, save_png


def _key(e: dict) -> tuple[str, str, str]:
    return e["task_name"], e["split"], _setting(e)


def compare_table(dirs: list[str | Path]) -> tuple[list[str], list[tuple], list[list[float | None]]]:
    """Model names, row keys (task, split, setting) and main scores [row][model] (None where missing)."""
    if not dirs:
        raise MoembedError("compare: give at least one result directory")
    docs = [read_results(d) for d in dirs]
    names = [f"{doc['model_name']} ({Path(d).name})" for doc, d in zip(docs, dirs)]
    keys: list[tuple] = []
    for doc in docs:
        for e in doc["results"]:
            if _key(e) not in keys:
                keys.append(_key(e))
    lookup = [{_key(e): e["main_score"] for e in doc["results"]} for doc in docs]
    return names, keys, [[m.get(k) for m in lookup] for k in keys]


def compare_markdown(dirs: list[str | Path]) -> str:
    """Markdown table: one column per result dir (main score ×100), with Δ vs the first dir in parentheses."""
    names, keys, rows = compare_table(dirs)
    head = "| task | split | setting | " + " | ".join(names) + " |"
    lines = [head, "|---|---|---|" + "---:|" * len(names)]
    for (task, split, setting), scores in zip(keys, rows):
        base = scores[0]
        cells = []
        for i, s in enumerate(scores):
            if s is None:
                cells.append("–")
            elif i == 0 or base is None:
                cells.append(f"{s * 100:.2f}")
            else:
                cells.append(f"{s * 100:.2f} ({(s - base) * 100:+.2f})")
        lines.append(f"| {task} | {split} | {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare_plot(dirs: list[str | Path], path: str | Path) -> Path:
    """Grouped bars: one group per (task, setting), one bar per model."""
    import numpy as np

    names, keys, rows = compare_table(dirs)
    x = np.arange(len(keys))
    width = 0.8 / len(names)
    fig = new_figure((max(6, 0.9 * len(keys) + 2), 4))
    ax = fig.subplots()
    for j, name in enumerate(names):
        ax.bar(x + j * width, [(r[j] or 0.0) * 100 for r in rows], width, label=name)
    ax.set_xticks(x + width * (len(names) - 1) / 2, [f"{k[0]}\n{k[2]}" for k in keys], fontsize=7)
    ax.set(ylabel="main score (×100)", title="Model comparison")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_png(fig, path)
