"""Task loading, validation errors, every task type on a tiny model, sweeps, reports, compare and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moembed.errors import MoembedError
from moembed.eval import evaluate, load_task
from moembed.eval.compare import compare_markdown, compare_plot
from moembed.eval.report import SCHEMA_KEYS, read_results, write_results
from moembed.eval.sweep import long_context_sweep, matryoshka_sweep


pytestmark = pytest.mark.usefixtures("one_torch_thread")


TOPICS = {
    "animals": [
        "the cat sleeps on the sofa",
        "dogs bark at strangers",
        "a horse runs in the field",
        "birds sing at dawn",
    ],
    "finance": [
        "stock prices fell today",
        "the bank raised interest rates",
        "investors bought bonds",
        "inflation is rising",
    ],
    "food": [
        "bake the bread for an hour",
        "a recipe for apple pie",
        "fresh pasta with tomato sauce",
        "grill the fish gently",
    ],
}


def _jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def make_tasks(root: Path) -> dict[str, Path]:
    """One small task directory of every type."""
    texts = [(t, lab) for lab, ts in TOPICS.items() for t in ts]
    r = root / "retrieval"
    _jsonl(r / "corpus.jsonl", [{"_id": f"d{i}", "title": "", "text": t} for i, (t, _) in enumerate(texts)])
    _jsonl(r / "queries.jsonl", [{"_id": f"q{i}", "text": t.split()[1]} for i, (t, _) in enumerate(texts)])
    (r / "qrels").mkdir()
    (r / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(len(texts)))
    )
    _jsonl(
        root / "sts" / "test.jsonl",
        [
            {"sentence1": a, "sentence2": b, "score": float(i % 5)}
            for i, ((a, _), (b, _)) in enumerate(zip(texts, texts[1:]))
        ],
    )
    _jsonl(
        root / "pairs" / "test.jsonl",
        [
            {"sentence1": a, "sentence2": b, "label": int(la == lb)}
            for (a, la), (b, lb) in zip(texts, texts[1:] + texts[:1])
        ],
    )
    _jsonl(root / "cls" / "test.jsonl", [{"text": t, "label": lab} for t, lab in texts])
    _jsonl(root / "clu" / "test.jsonl", [{"text": t, "label": lab} for t, lab in texts])
    (root / "clu" / "task.json").write_text(json.dumps({"type": "clustering", "name": "topics-clustering"}))
    _jsonl(
        root / "rerank" / "test.jsonl",
        [
            {
                "query": lab,
                "positive": ts[:2],
                "negative": TOPICS["food"][:2] if lab != "food" else TOPICS["animals"][:2],
            }
            for lab, ts in TOPICS.items()
        ],
    )
    return {p.name: p for p in root.iterdir()}


@pytest.fixture
def tasks(tmp_path):
    return make_tasks(tmp_path / "tasks")


def test_types_detected(tasks):
    got = {name: load_task(p).type for name, p in tasks.items()}
    assert got == {
        "retrieval": "retrieval",
        "sts": "sts",
        "pairs": "pair_classification",
        "cls": "classification",
        "clu": "clustering",
        "rerank": "reranking",
    }
    assert load_task(tasks["clu"]).name == "topics-clustering"


def test_tiny_model_scores_reproducible_across_runs_and_batch_sizes(make_tiny, tasks):
    dirs = sorted(tasks.values())
    a = evaluate(make_tiny("bert", seed=0), dirs, batch_size=16)
    b = evaluate(make_tiny("bert", seed=0), dirs, batch_size=16)
    c = evaluate(make_tiny("bert", seed=0), dirs, batch_size=3)
    for x, y, z in zip(a, b, c):
        assert x.scores == y.scores, x.task_name  # same run twice: bit-identical
        # other batch sizes pad to other lengths, so attention sums in another order: equal to float rounding
        assert z.scores == pytest.approx(x.scores, abs=1e-6), x.task_name
        assert np.isfinite(x.main_score)
    other = evaluate(make_tiny("bert", seed=1), [tasks["sts"]], batch_size=16)
    assert other[0].scores != next(r for r in a if r.task_type == "sts").scores  # the scores do depend on the weights


def test_prompts_by_task_type(make_tiny, tasks):
    seen = []

    class Recorder:
        name, dim, prompts = (
            "rec",
            4,
            {"search_query": "q: ", "search_document": "d: ", "classification": "c: ", "clustering": "k: "},
        )

        def encode(self, texts, prompt_name=None, prompt=None, *, truncate_dim=None, precision="float32",
                   batch_size=32):
            seen.append(prompt_name)
            return np.random.default_rng(len(texts)).normal(size=(len(texts), 4)).astype(np.float32)

    for name, expected in [
        ("retrieval", ["search_query", "search_document"]),
        ("sts", ["classification"] * 2),
        ("pairs", ["classification"] * 2),
        ("cls", ["classification"]),
        ("clu", ["clustering"]),
        ("rerank", ["search_query", "search_document"]),
    ]:
        seen.clear()
        evaluate(Recorder(), [tasks[name]])
        assert seen == expected, name
    Recorder.prompts = {}  # a model without prompts gets no prefix
    seen.clear()
    evaluate(Recorder(), [tasks["retrieval"]])
    assert seen == [None, None]


def test_model_similarity_is_used(make_tiny, tasks):
    base = make_tiny("bert")

    class Flipped:
        name, dim, prompts = base.name, base.dim, base.prompts

        def encode(self, *a, **k):
            return base.encode(*a, **k)

        def similarity(self, a, b):
            a = a / np.linalg.norm(a, axis=1, keepdims=True)
            b = b / np.linalg.norm(b, axis=1, keepdims=True)
            return -(a @ b.T)

    for name, key in [("sts", "spearman"), ("pairs", "ap"), ("rerank", "map"), ("retrieval", "ndcg_at_10")]:
        cos = evaluate(base, [tasks[name]])[0].scores[key]
        flip = evaluate(Flipped(), [tasks[name]])[0].scores[key]
        if key == "spearman":
            assert flip == pytest.approx(-cos)
        else:
            assert flip != cos


def test_cache_reuses_embeddings(make_tiny, tasks, tmp_path):
    model = make_tiny("bert")
    first = evaluate(model, [tasks["retrieval"], tasks["sts"]], cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").rglob("*.npy"))
    model.encode = lambda *a, **k: (_ for _ in ()).throw(AssertionError("should come from the cache"))
    second = evaluate(model, [tasks["retrieval"], tasks["sts"]], cache_dir=tmp_path / "cache")
    assert [r.scores for r in first] == [r.scores for r in second]


def test_chunked_corpus_and_faiss_agree(make_tiny, tasks):
    model = make_tiny("bert")
    ref = evaluate(model, [tasks["retrieval"]])[0].scores
    assert evaluate(model, [tasks["retrieval"]], chunk_size=5, query_block=2)[0].scores == ref
    assert evaluate(model, [tasks["retrieval"]], use_faiss=True)[0].scores == pytest.approx(ref)


# ---- bad input ----------------------------------------------------------------------------------------------


def test_missing_file_named(tasks):
    (tasks["retrieval"] / "queries.jsonl").unlink()
    with pytest.raises(MoembedError, match=r"queries\.jsonl: missing file"):
        load_task(tasks["retrieval"])


def test_qrels_unknown_ids_name_file_and_line(tasks):
    q = tasks["retrieval"] / "qrels" / "test.tsv"
    q.write_text(q.read_text() + "q0\td999\t1\n")
    with pytest.raises(MoembedError, match=r"test\.tsv:14: unknown corpus-id 'd999'"):
        load_task(tasks["retrieval"])
    q.write_text("query-id\tcorpus-id\tscore\nqX\td0\t1\n")
    with pytest.raises(MoembedError, match=r"test\.tsv:2: unknown query-id 'qX'"):
        load_task(tasks["retrieval"])


def test_non_numeric_gold_score_names_file_and_line(tasks):
    f = tasks["sts"] / "test.jsonl"
    lines = f.read_text().splitlines()
    lines[2] = json.dumps({"sentence1": "a", "sentence2": "b", "score": "high"})
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(MoembedError, match=r"test\.jsonl:3: 'score' must be a number"):
        load_task(tasks["sts"])
    q = tasks["retrieval"] / "qrels" / "test.tsv"
    q.write_text("query-id\tcorpus-id\tscore\nq0\td0\tyes\n")
    with pytest.raises(MoembedError, match=r"test\.tsv:2: score 'yes' is not a number"):
        load_task(tasks["retrieval"])


def test_empty_task_refused(tasks, tmp_path):
    (tasks["cls"] / "test.jsonl").write_text("\n")
    with pytest.raises(MoembedError, match="empty task"):
        load_task(tasks["cls"])
    (tasks["retrieval"] / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n")
    with pytest.raises(MoembedError, match="empty task"):
        load_task(tasks["retrieval"])
    (tmp_path / "nothing").mkdir()
    with pytest.raises(MoembedError, match="missing file test.jsonl"):
        load_task(tmp_path / "nothing")


def test_bad_task_json_names_key(tasks):
    (tasks["sts"] / "task.json").write_text(json.dumps({"type": "sts", "nmae": "x"}))
    with pytest.raises(MoembedError, match=r"task\.json: key 'nmae'"):
        load_task(tasks["sts"])


# ---- sweeps, reports, compare -------------------------------------------------------------------------------


def test_matryoshka_precision_sweep_and_report(make_tiny, tasks, tmp_path):
    model = make_tiny("bert")
    loaded = [load_task(tasks["retrieval"]), load_task(tasks["sts"])]
    res = matryoshka_sweep(model, loaded, [16, 8], ["float32", "int8", "binary"])
    assert model.calibration is not None  # int8 ranges were calibrated on the task texts
    assert len(res) == 2 * 3 * 3
    assert {(r.dim, r.precision) for r in res} == {(d, p) for d in (32, 16, 8) for p in ("float32", "int8", "binary")}
    full = [r for r in res if r.dim == 32 and r.precision == "float32"]
    assert all(r.extra["retained_pct"] == 100.0 for r in full)
    half = next(r for r in res if r.dim == 16 and r.precision == "float32" and r.task_type == "retrieval")
    # signed and unsigned packed bits, int8 and uint8 codes: the same scores
    more = {(r.task_name, r.dim, r.precision): r.main_score
            for r in matryoshka_sweep(model, loaded, [16], ["int8", "uint8", "binary", "ubinary"])}
    for (task, dim, p), score in more.items():
        twin = {"uint8": "int8", "ubinary": "binary"}.get(p, p)
        assert score == pytest.approx(more[(task, dim, twin)], abs=1e-9)
    assert half.extra["retained_pct"] == pytest.approx(100 * half.main_score / full[0].main_score, abs=0.01)
    doc = write_results(res, tmp_path / "out", "tiny", "abc123")
    back = read_results(tmp_path / "out")
    assert back == json.loads(json.dumps(doc))
    for e in back["results"]:
        assert set(SCHEMA_KEYS) <= set(e)
        assert e["main_score"] == e["scores"][{"retrieval": "ndcg_at_10", "sts": "spearman"}[e["task_type"]]]
    assert "| retrieval | retrieval | d16 int8" in (tmp_path / "out" / "results.md").read_text()
    for png in ("score_vs_dim.png", "score_vs_precision.png"):
        data = (tmp_path / "out" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_int8_calibration_with_a_cache_embeds_the_corpus_once(make_tiny, tasks, tmp_path):
    """With a cache, a sweep's int8 calibration embeds each task's texts through it under the key of the task's own
    float32 run: the retrieval corpus is embedded once for both, and the ranges are those `calibrate` takes."""
    from moembed.eval import EmbeddingCache
    from moembed.eval.sweep import calibration_sample

    loaded = [load_task(tasks["retrieval"]), load_task(tasks["sts"])]
    plain = make_tiny("bert")
    sample = [t for texts in calibration_sample(loaded) for t in texts]
    plain.calibrate(sample, prompt_name="search_document")  # its own encode of the sample, unnormalised
    expected = {(r.task_name, r.dim, r.precision): r.main_score
                for r in matryoshka_sweep(plain, loaded, [16], ["int8"])}
    model = make_tiny("bert")
    calls, encode = [], model.encode
    model.encode = lambda texts, **k: calls.append(list(texts)) or encode(texts, **k)
    model.calibrate = lambda *a, **k: pytest.fail("calibrate() embeds the sample a second time")
    res = matryoshka_sweep(model, loaded, [16], ["int8"], cache=EmbeddingCache(tmp_path / "cache"))
    corpus = list(loaded[0].data["corpus"].values())
    assert calls.count(corpus) == 1  # calibration and the float32 retrieval run share one encode
    for dim in (None, 16):
        np.testing.assert_allclose(model.int8_ranges(dim), plain.int8_ranges(dim), atol=1e-6)
    for r in res:
        assert r.main_score == pytest.approx(expected[(r.task_name, r.dim, r.precision)], abs=1e-3)


def test_sweep_without_a_cache_embeds_each_text_once(make_tiny, tasks):
    model = make_tiny("bert")
    calls, encode = [], model.encode
    model.encode = lambda texts, **k: calls.append(list(texts)) or encode(texts, **k)
    loaded = [load_task(tasks["retrieval"])]
    res = matryoshka_sweep(model, loaded, [16, 8], ["float32", "int8", "binary"])
    assert len(res) == 9
    assert calls.count(list(loaded[0].data["corpus"].values())) == 1  # calibration and all nine points
    assert len(calls) == 2  # and the queries


def test_evaluate_int8_without_a_cache_dir_embeds_the_corpus_once(make_tiny, tasks):
    model = make_tiny("bert")
    calls, encode = [], model.encode
    model.encode = lambda texts, **k: calls.append(list(texts)) or encode(texts, **k)
    (res,) = evaluate(model, [tasks["retrieval"]], dim=16, precision="int8")
    assert model.calibration is not None and res.precision == "int8"
    assert calls.count(list(load_task(tasks["retrieval"]).data["corpus"].values())) == 1


def test_memory_cache_holds_at_most_its_budget_then_embeds_again(make_tiny, tasks, caplog):
    from moembed.eval.encoding import MemoryCache, View, encode_raw

    model = make_tiny("bert")
    calls, encode = [], model.encode
    model.encode = lambda texts, **k: calls.append(list(texts)) or encode(texts, **k)
    texts = ["a cat", "a dog", "a bird"]
    small = MemoryCache(budget=3 * model.dim * 4)  # room for the three embeddings, float32
    for _ in range(2):
        encode_raw(model, texts, None, View(), small)
    assert len(calls) == 1 and small.held_bytes == 3 * model.dim * 4
    tiny = MemoryCache(budget=16)
    with caplog.at_level("WARNING", logger="moembed.eval.encoding"):
        for _ in range(2):
            encode_raw(model, texts, None, View(), tiny)
    assert len(calls) == 3 and tiny.held_bytes == 0  # not held: embedded each time, as without a cache
    assert "--cache-dir" in caplog.text

    class Plain:  # a model with only what evaluation needs: no settings_key (a disk cache would need one)
        name, prompts, dim = "plain", {}, model.dim

        def encode(self, texts, **k):
            return model.encode(texts, **k)

    held = MemoryCache()
    for _ in range(2):
        encode_raw(Plain(), texts, None, View(), held)  # two objects: each has its own entries
    plain = Plain()
    for _ in range(2):
        encode_raw(plain, texts, None, View(), held)  # the same object: embedded once
    assert len(calls) == 6


def test_long_context_sweep(make_tiny, tasks, tmp_path):
    rot = make_tiny("nomic", max_length=64)
    loaded = [load_task(tasks["retrieval"]), load_task(tasks["sts"])]
    res = long_context_sweep(rot, loaded, [4, 128])
    assert [(r.max_length, r.dynamic_ntk) for r in res] == [(4, True), (4, False), (128, True), (128, False)]
    assert rot.tokenizer.max_length == 64 and rot.config.dynamic_ntk is True  # restored
    assert res[0].scores != res[2].scores  # 4 tokens see less text than 128
    bert = make_tiny("bert", max_length=64)
    res = long_context_sweep(bert, loaded, [128])
    assert res[0].max_length == bert.config.max_position and "capped" in res[0].note and res[0].dynamic_ntk is None
    write_results(res, tmp_path / "lc", "tiny", None)


def test_compare_two_result_dirs(make_tiny, tasks, tmp_path):
    dirs = [tasks["sts"], tasks["cls"]]
    for seed in (0, 1):
        write_results(evaluate(make_tiny("bert", seed=seed), dirs), tmp_path / f"r{seed}", f"tiny{seed}", str(seed))
    table = compare_markdown([tmp_path / "r0", tmp_path / "r1"])
    r0 = read_results(tmp_path / "r0")["results"]
    r1 = read_results(tmp_path / "r1")["results"]
    delta = (r1[0]["main_score"] - r0[0]["main_score"]) * 100
    assert f"({delta:+.2f})" in table and "tiny0 (r0)" in table and "tiny1 (r1)" in table
    png = compare_plot([tmp_path / "r0", tmp_path / "r1"], tmp_path / "cmp.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(MoembedError, match="results.json: missing file"):
        compare_markdown([tmp_path / "r0", tmp_path])


def test_cli_eval_and_compare(make_tiny, tasks, tmp_path):
    from typer.testing import CliRunner

    from moembed.cli.main import app

    make_tiny("bert").save(tmp_path / "model")
    out = tmp_path / "res"
    args = [
        "eval",
        str(tmp_path / "model"),
        str(tasks["retrieval"]),
        str(tasks["pairs"]),
        "--out",
        str(out),
        "--dims",
        "32,16",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    doc = read_results(out)
    assert len(doc["results"]) == 4 and len(doc["model_hash"]) == 16
    assert "| pairs | pair_classification | d16 float32" in r.output
    r = CliRunner().invoke(app, ["compare", str(out), str(out)])
    assert r.exit_code == 0 and "(+0.00)" in r.output
    r = CliRunner().invoke(app, ["eval", str(tmp_path / "model"), "--out", str(out)])
    assert r.exit_code != 0 and "at least one task" in str(r.exception)


def test_cli_eval_dtype_int8_is_named_and_cached_apart(make_tiny, tasks, tmp_path):
    """`moembed eval --dtype int8`: int8 embeddings (not float32's from the shared cache), the compute in the
    results' model name; --dtype with --moee-sum is refused."""
    from typer.testing import CliRunner

    from moembed.cli.main import app
    from moembed.model.cpu import int8_available

    if not int8_available():
        pytest.skip("this torch build has no x86 quantised kernels")
    make_tiny("bert").save(tmp_path / "model")
    cache = tmp_path / "cache"
    base = ["eval", str(tmp_path / "model"), str(tasks["retrieval"]), "--cache-dir", str(cache),
            "--device", "cpu"]
    files = {}
    for dtype in ("float32", "int8"):
        r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / dtype), "--dtype", dtype])
        assert r.exit_code == 0, r.output
        files[dtype] = {p for p in cache.rglob("*") if p.is_file()}
    assert files["int8"] > files["float32"]  # its own cache entries
    assert read_results(tmp_path / "float32")["model_name"] == "tiny-bert"
    assert read_results(tmp_path / "int8")["model_name"] == "tiny-bert (int8)"
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "x"), "--dtype", "int8", "--moee-sum", "1"])
    assert r.exit_code != 0 and "--dtype: 'int8' with --moee-sum" in str(r.exception)


def test_cli_moee_sum_scores_with_its_similarity(make_tiny, tasks, tmp_path):
    from typer.testing import CliRunner

    from moembed.cli.main import app

    make_tiny("bert", moe={"num_experts": 4, "top_k": 1, "layers": [0, 1]}).save(tmp_path / "moe")
    scores = {}
    for alpha in ("0", "5"):
        out = tmp_path / f"a{alpha}"
        r = CliRunner().invoke(
            app,
            [
                "eval",
                str(tmp_path / "moe"),
                str(tasks["sts"]),
                str(tasks["retrieval"]),
                "--out",
                str(out),
                "--moee-sum",
                alpha,
            ],
        )
        assert r.exit_code == 0, r.output
        doc = read_results(out)
        assert doc["model_name"].endswith(f"moee-sum{alpha}")
        scores[alpha] = [e["scores"] for e in doc["results"]]
    assert scores["0"] != scores["5"]  # α weighs the routing-weight cosine in


@pytest.mark.real
def test_dev_suite_builds_from_real_corpora_and_is_reused(tmp_path):
    from moembed.eval.suite import build_suite

    dirs = build_suite(tmp_path / "suite", datasets=["news"])
    loaded = {load_task(d).name: load_task(d) for d in dirs}
    assert {t.type for t in loaded.values()} == {"retrieval", "classification", "clustering", "pair_classification"}
    news = loaded["retrieval-news"].data
    assert len(news["qrels"]) == 300 and len(news["corpus"]) >= 300
    pairs = loaded["pairs-freedict-deu-eng"].data["rows"]
    assert sum(r[2] for r in pairs) == len(pairs) // 2
    assert len({lab for _, lab in loaded["classify-chatterbot-lang"].data["test"]}) == 10
    stamp = (tmp_path / "suite" / "suite.json").stat().st_mtime_ns
    assert build_suite(tmp_path / "suite", datasets=["news"]) == dirs
    assert (tmp_path / "suite" / "suite.json").stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_sweep_points_derived_from_one_full_encode_match_encode(make_tiny):
    from moembed.eval.encoding import View, encode_raw

    model = make_tiny("bert")
    texts = [t for ts in TOPICS.values() for t in ts]
    model.calibrate(texts)
    calls = []
    real = model.encode
    model.encode = lambda *a, **k: calls.append(k) or real(*a, **k)
    for dim in (32, 16, 5):
        for precision in ("float32", "int8", "uint8", "binary", "ubinary"):
            got = encode_raw(model, texts, None, View(dim, precision))
            ref = real(texts, dim=dim, precision=precision)
            assert got.dtype == ref.dtype and got.shape == ref.shape
            if precision == "float32":
                np.testing.assert_allclose(got, ref, atol=1e-6)
            elif precision in ("int8", "uint8"):  # a code may land on the other side of a bucket boundary: each
                # dimension's calibration minimum and maximum (these texts) sit exactly on the range's edges, so
                # float32 rounding may move those two codes of a dimension by one, and no other
                assert np.abs(got.astype(int) - ref.astype(int)).max() <= 1
                assert (got != ref).sum(0).max() <= 2
            else:
                np.testing.assert_array_equal(got, ref)
    assert all(k["truncate_dim"] in (None, 32) and k["precision"] == "float32" for k in calls)  # only full encodes ran
