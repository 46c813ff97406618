"""Training data checked before training (moembed.data.check): every record of every source read once, with the
decoding and parsing training uses; all malformed records reported (the first 20 by file and line), empty ones
counted, a source with nothing usable refused."""

from __future__ import annotations

import json

import pytest

from moembed.data.check import MAX_LISTED, check_data, scan_sources
from moembed.data.config import SourceConfig
from moembed.errors import MoembedError


def _lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _pair(i):
    return json.dumps({"query": f"q{i}", "document": f"d{i}"})


BROKEN = ['{"query": "q", "document": ', '{"query": "q\\ud800", "document": "d"}', '{"query": "q"}',
          '{"query": 1, "document": "d"}', '["q", "d"]', '{"query": "q", "document": "d", "negatives": "n"}']


def test_every_malformed_record_is_found_and_the_first_ones_listed(tmp_path):
    lines = [_pair(i) for i in range(60)]
    bad_at = list(range(1, 60, 2))  # 30 malformed records, every kind
    for k, i in enumerate(bad_at):
        lines[i] = BROKEN[k % len(BROKEN)]
    path = _lines(tmp_path / "a.jsonl", lines)
    src = [SourceConfig(path=str(path), name="a")]
    with pytest.raises(MoembedError) as e:
        check_data(src)
    msg = str(e.value)
    assert msg.startswith("training data: 30 malformed record(s) of 60, found before training; fix them, or set "
                          "skip_bad: true")
    listed = [line.strip() for line in msg.splitlines()[1:]]
    assert len(listed) == MAX_LISTED + 1 and listed[-1] == f"... and {30 - MAX_LISTED} more"
    assert [int(line.split(":")[1]) for line in listed[:-1]] == [i + 1 for i in bad_at[:MAX_LISTED]]
    assert listed[0] == f"{path}:2: invalid JSON (Expecting value)"
    assert listed[1] == f"{path}:4: not valid Unicode (lone surrogate U+D800 at character 1)"
    assert listed[2] == f"{path}:6: missing field 'document'"
    assert listed[3] == f"{path}:8: field 'query' must be a string, got int"
    assert listed[4] == f"{path}:10: expected an object, got list"
    assert listed[5] == f"{path}:12: field 'negatives' must be a list of strings"
    report = check_data(src, skip_bad=True)  # counted, not raised
    assert (report.records, report.bad, report.empty) == (60, 30, 0)


def test_empty_records_are_counted_and_a_source_with_nothing_usable_is_refused(tmp_path):
    good = _lines(tmp_path / "g.jsonl", [_pair(1), '{"query": " ", "document": "d"}', _pair(2)])
    report = check_data([SourceConfig(path=str(good))])
    assert (report.records, report.bad, report.empty) == (3, 0, 1)
    hollow = _lines(tmp_path / "h.jsonl", ['{"query": "", "document": "d"}', '{"query": "q"}'])
    with pytest.raises(MoembedError, match=r"h\.jsonl: no usable records \(2 records: 1 malformed, 1 empty"):
        check_data([SourceConfig(path=str(good)), SourceConfig(path=str(hollow))], skip_bad=True)
    nothing = _lines(tmp_path / "n.jsonl", ["", " "])
    with pytest.raises(MoembedError, match=r"n\.jsonl: no records \(data source 'n'\)"):
        check_data([SourceConfig(path=str(nothing))])


def test_mlm_text_and_parquet_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = _lines(tmp_path / "t.jsonl", ['"plain"', '{"text": "obj"}', "3", '{"text": "\\udfff"}'])
    report = scan_sources([SourceConfig(path=str(text))], text=True)
    assert report.bad == 2 and report.errors == [f"{text}:3: expected a string or an object, got int",
                                                 f"{text}:4: not valid Unicode (lone surrogate U+DFFF at character 0)"]
    path = tmp_path / "p.parquet"
    docs = pa.array([b"x", b"\xff", b"z"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"query": ["a", None, "c"], "document": docs}), path)
    report = scan_sources([SourceConfig(path=str(path), format="parquet", negatives_field=None)])
    assert report.errors == [f"{path}:row 2: not valid UTF-8"] and report.records == 3
