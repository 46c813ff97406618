"""Real-data builders: splits never share a document, BEIR layout, determinism, errors, atomic output, CLI."""

from __future__ import annotations

import itertools
import json

import pytest
from typer.testing import CliRunner

from moembed.cli.main import app
from moembed.data import readers
from moembed.data.corpora import DATASETS, build_dataset, read_dataset
from moembed.errors import MoembedError

pytestmark = pytest.mark.real
SMALL = dict(max_pairs=60, eval_queries=15, eval_docs=40)


def _load_split(task):
    corpus = {r["_id"]: r["text"] for r in map(json.loads, (task / "corpus.jsonl").read_text().splitlines())}
    queries = {r["_id"]: r["text"] for r in map(json.loads, (task / "queries.jsonl").read_text().splitlines())}
    lines = (task / "qrels" / "test.tsv").read_text().splitlines()
    return corpus, queries, lines


@pytest.mark.parametrize("name", DATASETS)
def test_build_splits_never_share_documents(tmp_path, name):
    meta = build_dataset(name, tmp_path / name, seed=3, **SMALL)
    out = tmp_path / name
    train = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    assert len(train) == meta["train"] == SMALL["max_pairs"]
    assert all(set(r) == {"query", "document", "source", "lang"} and r["query"] and r["document"] for r in train)
    docs = {"train": {r["document"] for r in train}}
    for split in ("dev", "test"):
        corpus, queries, lines = _load_split(out / split)
        assert lines[0] == "query-id\tcorpus-id\tscore"
        qrels = [line.split("\t") for line in lines[1:]]
        assert {q for q, _, _ in qrels} == set(queries) and len(queries) == meta[split]["queries"] == 15
        assert all(d in corpus and s == "1" for _, d, s in qrels)
        # distractors: the corpus holds more documents than the sampled queries point to
        assert len(corpus) == meta[split]["corpus"] > len({d for _, d, _ in qrels})
        docs[split] = set(corpus.values())
    assert not docs["train"] & docs["dev"] and not docs["train"] & docs["test"] and not docs["dev"] & docs["test"]
    assert json.loads((out / "meta.json").read_text())["train"] == meta["train"]


def test_build_is_deterministic_per_seed(tmp_path):
    files = ["train.jsonl", "test/corpus.jsonl", "test/queries.jsonl", "test/qrels/test.tsv", "dev/queries.jsonl"]
    build_dataset("news", tmp_path / "a", seed=1, **SMALL)
    build_dataset("news", tmp_path / "b", seed=1, **SMALL)
    build_dataset("news", tmp_path / "c", seed=2, **SMALL)
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert (tmp_path / "a" / "train.jsonl").read_bytes() != (tmp_path / "c" / "train.jsonl").read_bytes()


def test_readers_give_sensible_pairs():
    wn = {p.query: p.document for p in read_dataset("wordnet")}
    assert "car, auto, automobile, machine, motorcar" in wn
    assert wn["car, auto, automobile, machine, motorcar"].startswith("a motor vehicle with four wheels")
    gcide = [p for p in itertools.islice(read_dataset("gcide"), 3000) if p.query == "Ablactation"]
    assert gcide and "weaning" in gcide[0].document and "1913" not in gcide[0].document
    head = itertools.islice(read_dataset("freedict-deu-eng"), 60_000)  # the word is near entry 50,000
    de = [p for p in head if p.query == "Bakterienträger"]
    assert {p.document for p in de} == {"bacteria carrier", "bacteria carriers"} and de[0].lang == "de-en"
    chat = list(read_dataset("chatterbot"))
    assert {p.lang for p in chat} >= {"en", "de", "ja", "pt"} and len({p.source for p in chat}) > 20
    news = list(read_dataset("news"))
    assert len(news) == 2 * 3824 and all(p.source == "news" for p in news)


def test_dictd_numbers_are_base64():
    assert readers._b64_number("A") == 0 and readers._b64_number("/") == 63
    assert readers._b64_number("Bq") == 1 * 64 + 42


def test_missing_corpus_says_how_to_install(tmp_path, monkeypatch):
    with pytest.raises(MoembedError, match="apt-get install wordnet-base"):
        list(readers.read_wordnet(tmp_path))
    monkeypatch.setattr(readers, "DICTD_DIR", tmp_path)
    with pytest.raises(MoembedError, match="apt-get install dict-gcide"):
        list(readers.read_gcide())
    with pytest.raises(MoembedError, match="apt-get install dict-freedict-fra-eng"):
        list(readers.read_freedict("freedict-fra-eng"))
    with pytest.raises(MoembedError, match="unknown name 'nope'"):
        read_dataset("nope")


def test_malformed_dictd_index_names_file_and_line(tmp_path, monkeypatch):
    import gzip

    (tmp_path / "gcide.index").write_text("word\tA\tC\nbroken line\n")
    with gzip.open(tmp_path / "gcide.dict.dz", "wb") as fh:
        fh.write(b"Word \\W\\\n   text\n")
    monkeypatch.setattr(readers, "DICTD_DIR", tmp_path)
    with pytest.raises(MoembedError, match=r"gcide\.index:2:"):
        list(readers.read_dictd("gcide", "apt-get install dict-gcide"))


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    import moembed.data.corpora as corpora

    def boom(*a, **k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(corpora, "write_beir", boom)
    with pytest.raises(RuntimeError):
        build_dataset("chatterbot", tmp_path / "out", **SMALL)
    assert list(tmp_path.iterdir()) == []


def test_cli_data_build_and_list(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["data", "list"])
    assert res.exit_code == 0 and "freedict-deu-eng" in res.output and "chatterbot" in res.output
    res = runner.invoke(app, ["data", "build", "chatterbot-english", "--out", str(tmp_path / "d"), "--max-pairs", "30",
                              "--eval-queries", "10", "--eval-docs", "30", "--seed", "5"])
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["train"] == 30 and meta["train_sources"] == {"chatterbot-english": 30} and meta["test"]["queries"] == 10
