"""Streaming sources (JSONL, Parquet, datasets-on-disk), bad-input handling, and the one-source-per-batch sampler."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from train_helpers import chatterbot_pairs, write_pairs

from moembed.data.batching import PairBatchStream, SourceSampler, source_probabilities
from moembed.data.sources import PairSource, SourceStats, TextSource
from moembed.errors import MoembedError
from moembed.data.config import SourceConfig


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def _take(src, n):
    return [src.next() for _ in range(n)]


# ---- readers and bad input --------------------------------------------------------------------------------------


def test_jsonl_prefixes_fields_and_epochs(tmp_path):
    p = _jsonl(tmp_path / "x.jsonl", [{"q": "a?", "d": "A", "n": ["B", "C"]}, {"q": "b?", "d": "B"}])
    cfg = SourceConfig(path=str(p), query_field="q", document_field="d", negatives_field="n",
                       query_prefix="search_query: ", document_prefix="search_document: ", shuffle_block=0)
    src = PairSource(cfg, SourceStats())
    assert src.size == 2
    a, b, c = _take(src, 3)
    assert (a.query, a.document, a.negatives) == ("search_query: a?", "search_document: A",
                                                  ["search_document: B", "search_document: C"])
    assert b.negatives == [] and c.query == a.query and src.reader.epoch == 1


@pytest.mark.parametrize("line, msg", [
    ("{not json", "invalid JSON"),
    ('{"query": "q"}', "missing field 'document'"),
    ('{"query": 3, "document": "d"}', "field 'query' must be a string"),
    ('["q", "d"]', "expected an object"),
    ('{"query": "q", "document": "d", "negatives": "x"}', "field 'negatives' must be a list of strings"),
])
def test_malformed_record_names_file_and_line(tmp_path, line, msg):
    p = _jsonl(tmp_path / "bad.jsonl", [{"query": "q1", "document": "d1"}, "", line])
    src = PairSource(SourceConfig(path=str(p), shuffle_block=0), SourceStats())
    src.next()
    with pytest.raises(MoembedError, match=rf"{p}:3: {msg}"):
        src.next()


def test_skip_bad_counts_and_empty_dropped(tmp_path):
    p = _jsonl(tmp_path / "mixed.jsonl", [
        {"query": "q1", "document": "d1"}, "{oops", {"query": "   ", "document": "d2"},
        {"query": "q3", "document": ""}, {"query": "q4", "document": "d4"},
    ])
    stats = SourceStats()
    src = PairSource(SourceConfig(path=str(p), name="m", shuffle_block=0), stats, skip_bad=True)
    assert [e.query for e in _take(src, 2)] == ["q1", "q4"]
    assert stats.bad["m"] == 1 and stats.empty["m"] == 2 and stats.read["m"] == 4
    stats2 = SourceStats()  # without skip_bad the empty records are still only counted, the bad one stops
    src2 = PairSource(SourceConfig(path=str(p), name="m", shuffle_block=0), stats2)
    src2.next()
    with pytest.raises(MoembedError, match=rf"{p}:2: invalid JSON"):
        src2.next()


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(MoembedError, match="no such file"):
        PairSource(SourceConfig(path=str(tmp_path / "nope.jsonl")), SourceStats())
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(MoembedError, match="no records"):
        PairSource(SourceConfig(path=str(tmp_path / "empty.jsonl")), SourceStats())


def test_jsonl_position_resumes_by_seek(tmp_path):
    p = write_pairs(tmp_path / "p.jsonl", chatterbot_pairs()[:50])
    a = PairSource(SourceConfig(path=str(p)), SourceStats())
    _take(a, 17)
    state = a.state()
    expected = [e.query for e in _take(a, 40)]  # crosses the epoch boundary
    b = PairSource(SourceConfig(path=str(p)), SourceStats())
    b.load_state(json.loads(json.dumps(state)))
    assert [e.query for e in _take(b, 40)] == expected


def test_parquet_streams_row_groups_and_resumes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = chatterbot_pairs()[:45]
    table = pa.table({"question": [q for q, _ in pairs], "answer": [a for _, a in pairs], "extra": list(range(45))})
    path = tmp_path / "p.parquet"
    pq.write_table(table, path, row_group_size=10)
    cfg = SourceConfig(path=str(path), format="parquet", query_field="question", document_field="answer",
                       negatives_field=None, shuffle_block=0)
    src = PairSource(cfg, SourceStats())
    assert src.size == 45 and src.reader.columns == ["question", "answer"]
    got = [e.query for e in _take(src, 23)]
    assert got == [q for q, _ in pairs[:23]]
    state = src.state()
    tail = [e.document for e in _take(src, 30)]
    src2 = PairSource(cfg, SourceStats())
    src2.load_state(state)
    assert [e.document for e in _take(src2, 30)] == tail == [a for _, a in (pairs * 2)[23:53]]


def test_hf_saved_dataset(tmp_path):
    import datasets

    pairs = chatterbot_pairs()[:12]
    ds = datasets.Dataset.from_dict({"query": [q for q, _ in pairs], "document": [a for _, a in pairs]})
    ds.save_to_disk(str(tmp_path / "ds"))
    cfg = SourceConfig(path=str(tmp_path / "ds"), format="hf-disk", negatives_field=None, shuffle_block=0)
    src = PairSource(cfg, SourceStats())
    assert src.size == 12 and [e.document for e in _take(src, 12)] == [a for _, a in pairs]


def test_text_source_accepts_strings_and_objects(tmp_path):
    p = _jsonl(tmp_path / "t.jsonl", ['"plain text"', {"text": "object text"}, {"text": " "}])
    stats = SourceStats()
    src = TextSource(SourceConfig(path=str(p), name="t", shuffle_block=0), stats)
    assert _take(src, 3) == ["plain text", "object text", "plain text"]
    assert stats.empty["t"] == 1


# ---- sampler ------------------------------------------------------------------------------------------------------


def test_source_probabilities_formula():
    assert source_probabilities([100, 400]) == pytest.approx([0.2, 0.8])
    assert source_probabilities([100, 400], temperature=2.0) == pytest.approx([1 / 3, 2 / 3])
    assert source_probabilities([100, 400], weights=[4, 1]) == pytest.approx([0.5, 0.5])
    p = source_probabilities([10**9, 10**3], temperature=1 / 0.3)  # α = 0.3 language sampling
    assert p[0] / p[1] == pytest.approx(1e6**0.3)
    sampler = SourceSampler([100, 400], seed=3)
    counts = Counter(sampler.next() for _ in range(4000))
    assert abs(counts[1] / 4000 - 0.8) < 0.03


def _tagged_sources(tmp_path, stats, sizes=(30, 60, 120)):
    srcs = []
    for i, n in enumerate(sizes):
        recs = [{"query": f"s{i} q{j}", "document": f"s{i} d{j}", "negatives": [f"s{i} n{j}.{k}" for k in range(5)]}
                for j in range(n)]
        srcs.append(PairSource(SourceConfig(path=str(_jsonl(tmp_path / f"s{i}.jsonl", recs)), name=f"s{i}"), stats))
    return srcs


def test_batches_never_mix_sources_and_are_deterministic(tmp_path):
    def stream(seed=7):
        stats = SourceStats()
        return PairBatchStream(_tagged_sources(tmp_path, stats), 8, 3, 1.0, seed, stats)

    s1, s2 = stream(), stream()
    seen = Counter()
    for _ in range(60):
        b1, b2 = s1.next(), s2.next()
        assert (b1.queries, b1.documents, b1.negatives) == (b2.queries, b2.documents, b2.negatives)
        tag = b1.source[1:]
        assert all(t.startswith(f"s{tag} ") for t in b1.queries + b1.documents + b1.negatives)
        for i, q in enumerate(b1.queries):  # H = 3 distinct negatives of this very query
            negs = b1.negatives[3 * i : 3 * i + 3]
            assert len(set(negs)) == 3 and all(n.startswith(q.replace(" q", " n") + ".") for n in negs)
        seen[b1.source] += 1
    assert len(seen) == 3 and seen["s2"] > seen["s0"]
    other = stream(seed=8)
    assert [other.next().queries for _ in range(5)] != [stream().next().queries for _ in range(5)]


def test_stream_state_restores_exactly(tmp_path):
    stats = SourceStats()
    a = PairBatchStream(_tagged_sources(tmp_path, stats), 8, 2, 1.0, 0, stats)
    for _ in range(9):
        a.next()
    state = json.loads(json.dumps(a.state()))  # plain JSON, as in the checkpoint
    expected = [(b.source, b.queries, b.negatives) for b in (a.next() for _ in range(12))]
    stats2 = SourceStats()
    b = PairBatchStream(_tagged_sources(tmp_path, stats2), 8, 2, 1.0, 123, stats2)
    b.load_state(state)
    assert [(x.source, x.queries, x.negatives) for x in (b.next() for _ in range(12))] == expected


def test_ranks_take_disjoint_slices_of_the_global_batch(tmp_path):
    whole, parts = None, []
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        stats = SourceStats()
        b = PairBatchStream(_tagged_sources(tmp_path, stats), 8, 1, 1.0, 5, stats, rank, world).next()
        if world == 1:
            whole = b
        else:
            parts.append(b)
    assert parts[0].queries + parts[1].queries == whole.queries
    assert parts[0].negatives + parts[1].negatives == whole.negatives
    with pytest.raises(ValueError, match="divisible"):
        PairBatchStream(_tagged_sources(tmp_path, SourceStats()), 7, 0, 1.0, 0, SourceStats(), 0, 2)


def test_records_without_negatives_are_dropped_when_needed(tmp_path):
    p = _jsonl(tmp_path / "n.jsonl", [{"query": "a", "document": "b", "negatives": ["x"]}, {"query": "c", "document": "d"}])
    stats = SourceStats()
    s = PairBatchStream([PairSource(SourceConfig(path=str(p), name="n"), stats)], 3, 2, 1.0, 0, stats)
    b = s.next()
    assert b.queries == ["a", "a", "a"] and b.negatives == ["x"] * 6  # short list: drawn with replacement
    assert stats.no_negatives["n"] == 2
    assert np.isfinite(source_probabilities([1])).all()


def test_scan_reads_every_record_once_without_moving_the_training_position(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moembed.data.sources import JsonlReader, ParquetReader

    rows = [{"query": f"q{i}", "document": f"d{i}"} for i in range(2500)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=700)
    for reader in (JsonlReader(tmp_path / "a.jsonl", shuffle_block=100, seed=1),
                   ParquetReader(tmp_path / "a.parquet", ["query", "document"], shuffle_block=100, seed=1)):
        first = reader.next()
        state = reader.state()
        scanned = list(reader.scan())
        assert [v for _, v in scanned] == rows  # file order, every record once
        assert reader.state() == state and reader.next() != first
    assert scanned[1][0].endswith("a.parquet:row 2")
    assert JsonlReader(tmp_path / "a.jsonl").field_names() is None
    assert ParquetReader(tmp_path / "a.parquet", ["query"]).field_names() == ["query", "document"]
    (tmp_path / "b.jsonl").write_text('{"query": "q"}\nnot json\n')
    with pytest.raises(MoembedError, match=r"b\.jsonl:2: invalid JSON"):
        list(JsonlReader(tmp_path / "b.jsonl").scan())


def test_a_lone_surrogate_is_a_bad_record_and_skip_bad_skips_it(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text('{"query": "q1", "document": "d1"}\n{"query": "q\\ud800", "document": "d2"}\n'
                 '{"query": "q3", "document": "d3"}\n', encoding="utf-8")
    cfg = SourceConfig(path=str(p), name="s", negatives_field=None, shuffle_block=0)
    src = PairSource(cfg, SourceStats())
    src.next()
    with pytest.raises(MoembedError, match=r"s\.jsonl:2: not valid Unicode \(lone surrogate U\+D800 at character 1\)"):
        src.next()
    stats = SourceStats()
    src = PairSource(cfg, stats, skip_bad=True)
    assert [src.next().query for _ in range(3)] == ["q1", "q3", "q1"]
    assert stats.bad["s"] == 1


@pytest.mark.parametrize("bad, message", [("missing", "missing field 'query'"), ("not-utf8", "not valid UTF-8")])
def test_a_bad_parquet_row_is_named_or_skipped(tmp_path, bad, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "b.parquet"
    queries = {"missing": pa.array(["a", None, "c"]),
               "not-utf8": pa.array([b"a", b"b\xed\xa0\x80", b"c"], pa.binary()).view(pa.string())}[bad]  # a surrogate
    pq.write_table(pa.table({"query": queries, "document": ["x", "y", "z"]}), path)
    cfg = SourceConfig(path=str(path), format="parquet", name="b", negatives_field=None, shuffle_block=0)
    src = PairSource(cfg, SourceStats())
    src.next()
    with pytest.raises(MoembedError, match=rf"{path}:row 2: {message}"):
        src.next()
    stats = SourceStats()
    src = PairSource(cfg, stats, skip_bad=True)
    assert [src.next().query for _ in range(2)] == ["a", "c"] and stats.bad["b"] == 1


def test_a_directory_given_as_a_jsonl_source_says_so(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(MoembedError, match=r"d: is a directory; a `datasets` save_to_disk directory is read with "
                                           r"format: hf-disk"):
        PairSource(SourceConfig(path=str(tmp_path / "d")), SourceStats())
