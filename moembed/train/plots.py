"""PNG plots of a run from its metrics.jsonl: loss, learning rate, and per-layer expert load over time.

    >>> write_plots("runs/x/metrics.jsonl", "runs/x/plots")   # → loss.png, lr.png, expert_load.png (MoE only)

Figures are drawn on the Agg canvas (`moembed.figures`: no display, no pyplot); each file is written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

from moembed.figures import new_figure, save_png


def read_metrics(path: str | Path) -> list[dict]:
    """Step records of a metrics.jsonl (lines cut by an interrupted write are ignored)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in rec:
            out.append(rec)
    return out


def write_plots(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write the plots that the metrics support; returns the files written."""
    recs = read_metrics(metrics_path)
    out_dir = Path(out_dir)
    written: list[Path] = []
    if not recs:
        return written
    steps = [r["step"] for r in recs]
    for key, label in (("loss", "loss"), ("lr", "learning rate")):
        fig = new_figure((6, 3.5))
        ax = fig.subplots()
        ax.plot(steps, [r.get(key) for r in recs], lw=1)
        if key == "loss":
            for part in ("contrastive", "mlm", "aux"):
                vals = [r.get(part) for r in recs]
                if any(v is not None for v in vals) and part in recs[0]:
                    ax.plot(steps, vals, lw=0.8, label=part)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        written.append(save_png(fig, out_dir / f"{key}.png", bbox_inches="tight"))
    load = [r.get("expert_load") or [] for r in recs]
    layers = max((len(x) for x in load), default=0)
    if layers:
        fig = new_figure((6, 2.2 * layers))
        axes = fig.subplots(layers, 1, squeeze=False, sharex=True)
        for li in range(layers):
            pts = [(s, x[li]) for s, x in zip(steps, load) if len(x) > li]
            ax = axes[li][0]
            for e in range(len(pts[0][1])):
                ax.plot([s for s, _ in pts], [f[e] for _, f in pts], lw=0.8, label=f"expert {e}")
            ax.set_ylabel(f"MoE layer {li}\nfraction")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=6, ncol=4)
        axes[-1][0].set_xlabel("step")
        written.append(save_png(fig, out_dir / "expert_load.png", bbox_inches="tight"))
    return written
