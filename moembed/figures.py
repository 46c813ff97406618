"""Figures for reports: matplotlib `Figure`s drawn on the non-interactive Agg canvas, written atomically as PNG.

No pyplot and no global backend switch: a library function that plots never changes the caller's matplotlib
state, and nothing needs a display.
"""

from __future__ import annotations

from pathlib import Path

from moembed.fileio import atomic_path


def new_figure(figsize: tuple[float, float]):
    """A `matplotlib.figure.Figure` attached to an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path: str | Path, **kwargs) -> Path:
    """Write `fig` to `path` as PNG (dpi 100 unless given), atomically; returns the path."""
    path = Path(path)
    kwargs.setdefault("dpi", 100)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", **kwargs)
    return path
