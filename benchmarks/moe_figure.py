"""The MoE-vs-dense figure: each study's gap to its dense control against the training pairs it saw, over studies
as `moe_gaps.load_study` reads them ({"label", "pairs_seen", "gaps": {option: {"test": [...], "dev": [...]}}}).

    python benchmarks/moe_vs_dense.py --figure docs/img/moe_vs_dense.png \
        --figure-with benchmarks/results/moe_vs_dense/*.json

A colour per option and a marker per study; the points of one pairs seen stand side by side, centred on it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

# The figure's marker per study, all distinct: matplotlib's letters, then its (points, style, angle) tuples, style 1 a
# star and 2 an asterisk (tests/test_moe_study.py checks there is one per kept study); and colour per option
MARKERS = [*"osD^vPX*hp<>dH", (6, 1, 0), (4, 1, 45), (5, 2, 0), (3, 2, 0), (8, 2, 0), "x", "+", "8", (7, 2, 0),
           (7, 1, 0), (5, 1, 180), (6, 2, 0), (8, 1, 0), (3, 1, 0), (9, 1, 0), (10, 1, 0), (12, 1, 0),
           (9, 2, 0), (11, 1, 0), (10, 2, 0)]
COLOURS = [f"C{i}" for i in range(10)] + ["black", "gold", "navy", "lime", "magenta"]


def side_by_side(studies: list[dict], options: list[str], step: float = 0.01) -> dict[tuple[int, str], float]:
    """Where the figure draws each (study index, option): the points at one pairs seen side by side, `step` decades
    apart, centred on it (their mean log10 x is its log10), so that no point strays far from the pairs it saw."""
    at = {}
    for pairs in {s["pairs_seen"] for s in studies}:
        here = [(k, o) for k, s in enumerate(studies) if s["pairs_seen"] == pairs for o in options if o in s["gaps"]]
        for j, point in enumerate(here):
            at[point] = pairs * 10 ** (step * (j - (len(here) - 1) / 2))
    return at


def figure(path: Path, studies: list[dict], registry: list[str], floor: float = -3.0) -> None:
    """MoE − dense (mean test, dev suite) against training pairs seen, per option (colour, in the order of
    `registry`: the runner's options) and study (marker, named in the legend below): the mean over seeds, bars from
    min to max. A mean below `floor` is drawn on the floor with its value written beside it, so that one broken
    option does not flatten the others against zero."""
    from matplotlib.lines import Line2D

    from moembed.figures import new_figure, save_png

    options = [o for o in registry if any(o in s["gaps"] for s in studies)]
    at = side_by_side(studies, options)
    fig = new_figure((10.0, 4.8))
    axes = fig.subplots(1, 2, sharex=True)
    for ax, key, title in zip(axes, ("test", "dev"), ("held-out test sets", "dev suite")):
        for k, study in enumerate(studies):
            for i, option in enumerate(options):
                colour = COLOURS[i % len(COLOURS)]
                gaps = study["gaps"].get(option, {}).get(key)
                if not gaps:
                    continue
                x = at[(k, option)]
                mean, style = statistics.fmean(gaps), {"marker": MARKERS[k % len(MARKERS)], "ls": "none",
                                                     "color": colour}
                if mean < floor:
                    ax.errorbar([x], [floor], **style)
                    ax.annotate(f"{mean:+.1f} (off scale)", (x, floor), xytext=(5, -3), textcoords="offset points",
                                fontsize=7, color=colour)
                else:
                    ax.errorbar([x], [mean], yerr=[[mean - max(min(gaps), floor)], [max(gaps) - mean]], capsize=3,
                                **style)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training pairs seen (steps × batch)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MoE − dense, mean nDCG@10 ×100")
    axes[0].legend([Line2D([], [], color=COLOURS[i % len(COLOURS)], marker="o", ls="") for i in range(len(options))],
                   options, fontsize=8, title="option", title_fontsize=8)
    fig.legend([Line2D([], [], color="grey", marker=MARKERS[k % len(MARKERS)], ls="") for k in range(len(studies))],
               [s["label"] for s in studies], loc="upper center", ncol=2, fontsize=8, bbox_to_anchor=(0.5, 0.0),
               title="study (benchmarks/results/moe_vs_dense/)", title_fontsize=8)
    save_png(fig, path, bbox_inches="tight")
