"""PNG plots of a run from its metrics.jsonl: loss, learning rate, and per-layer expert load over time.

    >>> write_plots("runs/x/metrics.jsonl", "runs/x/plots")   # → loss.png, lr.png, expert_load.png (MoE only)

Uses matplotlib's Agg backend (no display needed); each file is written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

from moembed.fileio import atomic_path


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


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")


def write_plots(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write the plots that the metrics support; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    out_dir = Path(out_dir)
    written: list[Path] = []
    if not recs:
        return written
    steps = [r["step"] for r in recs]
    for key, label in (("loss", "loss"), ("lr", "learning rate")):
        fig, ax = plt.subplots(figsize=(6, 3.5))
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
        written.append(out_dir / f"{key}.png")
        _save(fig, written[-1])
        plt.close(fig)
    load = [r.get("expert_load") or [] for r in recs]
    layers = max((len(x) for x in load), default=0)
    if layers:
        fig, axes = plt.subplots(layers, 1, figsize=(6, 2.2 * layers), squeeze=False, sharex=True)
        for li in range(layers):
            pts = [(s, x[li]) for s, x in zip(steps, load) if len(x) > li]
            ax = axes[li][0]
            for e in range(len(pts[0][1])):
                ax.plot([s for s, _ in pts], [f[e] for _, f in pts], lw=0.8, label=f"expert {e}")
            ax.set_ylabel(f"MoE layer {li}\nfraction")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=6, ncol=4)
        axes[-1][0].set_xlabel("step")
        written.append(out_dir / "expert_load.png")
        _save(fig, written[-1])
        plt.close(fig)
    return written
