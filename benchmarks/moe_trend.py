"""Where an MoE option's gap to its dense control heads as training sees more pairs: a least-squares line through
every seed's gap against log10(pairs seen), over studies as `moe_gaps.load_study` reads them (a study directory
or a kept gaps file: {"pairs_seen": N, "gaps": {option: {"test": [...], "dev": [...]}}}).

    python benchmarks/moe_vs_dense.py --trend benchmarks/results/moe_vs_dense/*-english-*.json

`trend` fits one option on one key (the held-out test sets or the dev suite); `trend_table` prints every option
measured at two or more pairs seen. Fit one recipe at a time: each gap is against a control of its own study.
"""

from __future__ import annotations

import math
import statistics


def trend(studies: list[dict], option: str, key: str) -> dict | None:
    """The least-squares line of `option`'s gap (`key`: "test" or "dev"), every seed of every study a point,
    against x = log10(pairs seen): `slope` per tenfold pairs with its 95% interval `low`..`high` (Student's t,
    n − 2 degrees of freedom), `at_most` the line at the most pairs measured, `zero` the pairs seen where the line
    crosses zero (None where the slope is not above zero: the gap does not close), and `ruled_out_to` the pairs
    seen up to which the line's upper 95% band (t·s·√(1/n + (x − x̄)²/Sxx) above it) stays below zero: a
    crossover before that many pairs is ruled out, by this line (None where the band reaches zero within the
    pairs measured, inf where the slope's whole interval is below zero, else at most 1e12). None where the option
    was measured at fewer than two pairs seen or on fewer than three points: no line to fit."""
    from scipy import stats

    points = [(math.log10(s["pairs_seen"]), g) for s in studies for g in s["gaps"].get(option, {}).get(key, [])]
    n = len(points)
    if len({x for x, _ in points}) < 2 or n < 3:
        return None
    mx, my = (statistics.fmean(v) for v in zip(*points))
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    line = lambda x: my + slope * (x - mx)  # noqa: E731
    s = math.sqrt(sum((y - line(x)) ** 2 for x, y in points) / (n - 2))  # residual std
    t = stats.t.ppf(0.975, n - 2)
    band = lambda x: line(x) + t * s * math.sqrt(1 / n + (x - mx) ** 2 / sxx)  # noqa: E731
    most = max(x for x, _ in points)
    high = slope + t * s / math.sqrt(sxx)
    ruled_out_to = None
    if band(most) < 0 and high < 0:
        ruled_out_to = math.inf  # the band falls as fast as the slope's upper bound: it never comes back up
    elif band(most) < 0:
        x = most  # the band is convex in x: step up in hundredths of a decade until it meets zero
        while x < 12 and band(x + 0.01) < 0:
            x += 0.01
        ruled_out_to = 10 ** x
    return {"points": n, "pairs_seen": sorted({round(10 ** x) for x, _ in points}), "slope": slope,
            "low": slope - t * s / math.sqrt(sxx), "high": high, "at_most": line(most),
            "zero": 10 ** (mx - my / slope) if slope > 0 else None, "ruled_out_to": ruled_out_to}


def trend_table(studies: list[dict]) -> str:
    """Markdown: `trend` of every option measured at two or more pairs seen, on the test sets and the dev suite."""
    def cells(t: dict | None) -> str:
        if t is None:
            return "- | - | - | -"
        zero = f"{t['zero']:.2g}" if t["zero"] is not None else "never (not closing)"
        out = t["ruled_out_to"]
        out = "-" if out is None else "any" if out == float("inf") else "beyond 1e12" if out >= 1e12 else f"{out:.2g}"
        return f"{t['slope']:+.2f} [{t['low']:+.2f}, {t['high']:+.2f}] | {t['at_most']:+.2f} | {zero} | {out}"

    heads = ["slope per ×10 pairs [95%]", "line at the most pairs", "line crosses zero at", "crossing ruled out to"]
    lines = ["| option | pairs seen | points | " + " | ".join(f"{k}: {h}" for k in ("test", "dev") for h in heads)
             + " |", "|" + "---|" * 11]
    for option in dict.fromkeys(o for s in studies for o in s["gaps"]):  # in the order the studies name them
        test, dev = (trend(studies, option, k) for k in ("test", "dev"))
        if test is None and dev is None:
            continue
        t = test or dev
        lines.append(f"| {option} | {', '.join(map(str, t['pairs_seen']))} | {t['points']} | {cells(test)} | "
                     f"{cells(dev)} |")
    return "\n".join(lines)
