"""The MoE study's gaps: each run paired with the dense control of its own seed, and the gaps files that keep a
study (benchmarks/results/moe_vs_dense/, each study's OUT/gaps.json) written, read and checked. The figure
(moe_figure.py), the trend (moe_trend.py) and the docs' tables are drawn from them.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from moe_options import MOE_OPTIONS


def paired(results: list[dict], option: str) -> list[tuple[dict, dict]]:
    """(run, dense control of the same seed) for every seed of `option` that has both."""
    by = {(r["option"], r["seed"]): r for r in results}
    return [(r, by[("dense", s)]) for (o, s), r in sorted(by.items()) if o == option and ("dense", s) in by]


def paired_gaps(results: list[dict], option: str, score) -> list[float]:
    """MoE − dense ×100 of `score(result)` per seed (the dense control's own, absolute, for option "dense")."""
    return [100 * (score(m) - (0 if option == "dense" else score(d))) for m, d in paired(results, option)]


def mean_of(key: str, names: list[str] | None = None):
    """score(result): the mean of result[key] over `names` (None: all of them)."""
    return lambda r: statistics.fmean(r[key][n] for n in (names or r[key]))


def study_gaps(results: list[dict], label: str, preset: str | None = None) -> dict:
    """What the figure plots of one study: per MoE option its gap to the dense control of the same seed (×100),
    seed by seed to 1e-4 of a point, on the mean over the test sets ("test") and over the dev suite ("dev"), at
    its pairs seen, and its recipe: the one its runs record (`preset` for runs that record none)."""
    seen = sorted({r["pairs_seen"] for r in results})
    if len(seen) != 1:
        raise SystemExit(f"{label}: " + (f"its runs saw {seen} pairs; a study's runs all see the same" if seen else
                                         "no runs (runs/*/result.json)"))
    recipes = sorted({r["preset"] for r in results if "preset" in r})
    if len(recipes) > 1:
        raise SystemExit(f"{label}: its runs come from the recipes {recipes}; a study's runs all follow one")
    preset = recipes[0] if recipes else preset
    gaps = {o: {k: [round(g, 4) for g in paired_gaps(results, o, mean_of(key))]
                for k, key in (("test", "scores"), ("dev", "suite"))}
            for o in MOE_OPTIONS if paired(results, o)}
    return {"label": label, **({"preset": preset} if preset else {}), "pairs_seen": seen[0], "gaps": gaps}


def dump_study(study: dict) -> str:
    """A gaps file's text: one line per option."""
    head = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in study.items() if k != "gaps"]
    rows = [f"  {json.dumps(o)}: {json.dumps(g)}" for o, g in study["gaps"].items()]
    return "{\n" + "\n".join(head) + '\n "gaps": {\n' + ",\n".join(rows) + "\n }\n}\n"


def read_runs(study: Path) -> list[dict]:
    """The result.json of every run of a study directory."""
    return [json.loads(f.read_text()) for f in sorted((study / "runs").glob("*/result.json"))]


def saved_gaps(study: Path) -> dict:
    """A study directory's gaps.json as its last summary wrote it ({} before the first): the label (`--label`) and
    the recipe it was summarised with."""
    saved = study / "gaps.json"
    return json.loads(saved.read_text()) if saved.exists() else {}


def load_study(path: Path) -> dict:
    """A study for the figure: a study directory (its runs) or a gaps file, checked: a bad one is refused naming
    the file and the key."""
    from moembed.recipes.config import RECIPE_PRESETS

    if path.is_dir():
        saved = saved_gaps(path)
        return study_gaps(read_runs(path), saved.get("label", path.name), saved.get("preset"))
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not a study directory or a gaps file ({e})") from None

    def bad(key: str, what: str):
        raise SystemExit(f"{path}: {key}: {what}")

    if not isinstance(doc, dict) or set(doc) - {"label", "preset", "pairs_seen", "gaps", "source"}:
        bad("(top level)", "an object with label, pairs_seen, gaps and optionally preset and source")
    if not isinstance(doc.get("label"), str) or not doc["label"]:
        bad("label", "the study's name in the figure, a string")
    if "preset" in doc and doc["preset"] not in RECIPE_PRESETS:
        bad("preset", f"the study's recipe, one of {', '.join(RECIPE_PRESETS)}")
    if not isinstance(doc.get("pairs_seen"), int) or doc["pairs_seen"] < 1:
        bad("pairs_seen", "training pairs seen, a positive integer")
    if not isinstance(doc.get("gaps"), dict) or not doc["gaps"]:
        bad("gaps", "an object of options, each {\"test\": [...], \"dev\": [...]}")
    for option, per in doc["gaps"].items():
        if option not in MOE_OPTIONS:
            bad(f"gaps.{option}", f"not an MoE option ({', '.join(MOE_OPTIONS)})")
        if not isinstance(per, dict) or set(per) != {"test", "dev"}:
            bad(f"gaps.{option}", "an object with test and dev")
        for key, xs in per.items():
            if not isinstance(xs, list) or not xs or not all(isinstance(x, (int, float)) for x in xs):
                bad(f"gaps.{option}.{key}", "a non-empty list of numbers, one gap per seed")
    return doc


def study_order(path: Path) -> list:
    """Sort key of a study's file or directory that reads the numbers in its name as numbers: the kept studies
    1-english…, 2-english…, …, 10-english… in the order they are numbered, not the shell's 1, 10, 11, 2."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", Path(path).name)]
