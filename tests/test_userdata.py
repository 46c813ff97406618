"""The quickstart on the user's own pairs: reading, the document split, bad input, options and the decisions.

Unit tests on small synthetic files; the end-to-end run on real data is in test_quickstart_userdata.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moembed.errors import MoembedError
from moembed.recipes.config import load_quickstart_config


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _pairs(n_docs: int, per_doc: int = 2, start: int = 0):
    return [{"query": f"question {d} variant {k}", "document": f"answer number {d}", "source": f"s{d % 2}"}
            for d in range(start, start + n_docs) for k in range(per_doc)]


def _cfg(tmp_path, files, **kw):
    return load_quickstart_config(None, data=[str(f) for f in files], batch_size=kw.pop("batch_size", 4), **kw)


def _beir_docs(d: Path) -> set[str]:
    return {json.loads(line)["text"] for line in (d / "corpus.jsonl").read_text().splitlines()}


def test_split_by_document_shares_no_document_and_drops_duplicates(tmp_path):
    from moembed.recipes.userdata import prepare_user_data

    rows = _pairs(300) + _pairs(5)  # the second block repeats 10 pairs exactly
    f = _write(tmp_path / "mine.jsonl", rows)
    meta = prepare_user_data(_cfg(tmp_path, [f]), tmp_path / "out")
    train = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    train_docs = {r["document"] for r in train}
    dev, test = _beir_docs(tmp_path / "out" / "dev"), _beir_docs(tmp_path / "out" / "test")
    assert test and dev and train_docs
    assert not (train_docs & dev) and not (train_docs & test) and not (dev & test)
    assert meta["duplicates"] == 10 and meta["files"][str(f)]["duplicate"] == 10
    # Every distinct pair is in exactly one split: 600 pairs, two per document.
    assert meta["pairs"]["train"] + meta["pairs"]["dev"] + meta["pairs"]["test"] == 600
    assert len(train) == meta["pairs"]["train"] and len({(r["query"], r["document"]) for r in train}) == len(train)
    assert meta["documents"]["train"] + len(dev) + len(test) == 300
    assert {r["source"] for r in train} == {"s0", "s1"}
    # The same input and seed give the same split; another seed another one.
    again = prepare_user_data(_cfg(tmp_path, [f]), tmp_path / "again")
    assert again["documents"] == meta["documents"]
    assert _beir_docs(tmp_path / "again" / "test") == test
    other = load_quickstart_config(None, data=[str(f)], batch_size=4).model_copy(update={"seed": 1})
    prepare_user_data(other, tmp_path / "other")
    assert _beir_docs(tmp_path / "other" / "test") != test


def test_max_pairs_keeps_exactly_that_many_training_pairs(tmp_path):
    from moembed.recipes.userdata import prepare_user_data

    f = _write(tmp_path / "mine.jsonl", _pairs(300))
    meta = prepare_user_data(_cfg(tmp_path, [f], max_pairs=100), tmp_path / "out")
    assert meta["train"] == 100 and meta["pairs"]["train_available"] > 400


def test_parquet_and_datasets_inputs_with_renamed_fields_source_and_language(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moembed.recipes.userdata import prepare_user_data

    rows = [{"q": f"frage {i}", "d": f"antwort {i}", "lang": "de", "negs": [f"antwort {i + 1}"]} for i in range(200)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "de.parquet", row_group_size=50)
    rows = [{"q": f"question {i}", "d": f"answer {i}", "lang": "en", "negs": None} for i in range(200)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "en"))
    cfg = load_quickstart_config(None, data=[str(tmp_path / "de.parquet"), str(tmp_path / "en")], batch_size=4,
                                 fields="query=q,document=d,language=lang,negatives=negs")
    meta = prepare_user_data(cfg, tmp_path / "out")
    assert set(meta["train_sources"]) == {"de.de", "en.en"}
    train = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    de = [r for r in train if r["source"] == "de.de"]
    assert de and all(r["given_negatives"] == [f"antwort {int(r['document'].split()[1]) + 1}"] for r in de)
    assert all("given_negatives" not in r for r in train if r["source"] == "en.en")


def test_missing_field_names_file_line_and_fields_found(tmp_path):
    from moembed.recipes.userdata import prepare_user_data

    rows = _pairs(50)
    rows[7] = {"question": "q", "answer": "a"}
    f = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(MoembedError, match=r"bad\.jsonl:8: missing field 'query'; fields found: question, answer"):
        prepare_user_data(_cfg(tmp_path, [f]), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["a"] * 10, "text": ["b"] * 10}), tmp_path / "t.parquet")
    with pytest.raises(MoembedError, match=r"t\.parquet: no field 'query', 'document'; fields found: question, text"):
        prepare_user_data(_cfg(tmp_path, [tmp_path / "t.parquet"]), tmp_path / "out")


def test_a_file_with_fewer_pairs_than_a_batch_is_refused(tmp_path):
    from moembed.recipes.userdata import prepare_user_data

    big = _write(tmp_path / "big.jsonl", _pairs(100))
    small = _write(tmp_path / "small.jsonl", _pairs(3, start=500) * 2 + [{"query": " ", "document": "x"}])
    with pytest.raises(MoembedError, match=r"small\.jsonl: 6 usable pairs \(13 records, 1 empty, 6 duplicates\); "
                                           r"at least one batch \(8\) is needed"):
        prepare_user_data(_cfg(tmp_path, [big, small], batch_size=8), tmp_path / "out")


def test_quickstart_refuses_bad_base_and_missing_data_before_any_work(tmp_path):
    from moembed.recipes.quickstart import Quickstart

    f = _write(tmp_path / "mine.jsonl", _pairs(100))
    with pytest.raises(MoembedError, match=r"--base: .*nowhere: no such file or directory"):
        Quickstart(_cfg(tmp_path, [f], base=str(tmp_path / "nowhere")), tmp_path / "run")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{not json")
    with pytest.raises(MoembedError, match=r"--base: .*junk: cannot load the model"):
        Quickstart(_cfg(tmp_path, [f], base=str(tmp_path / "junk")), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    from moembed.recipes.userdata import prepare_user_data

    with pytest.raises(MoembedError, match=r"--data: .*absent\.jsonl: no such file"):
        prepare_user_data(_cfg(tmp_path, [tmp_path / "absent.jsonl"]), tmp_path / "out")


def test_options_layer_over_the_defaults_and_bad_options_name_the_key(tmp_path):
    cfg = load_quickstart_config(None, data=["a.jsonl", "b.parquet"], fields="query=q, document=d", base="B",
                                 teacher="T", steps=7, batch_size=8, max_pairs=50, nproc=2)
    assert cfg.data.files == ["a.jsonl", "b.parquet"] and cfg.data.fields.query == "q"
    assert cfg.data.fields.document == "d" and cfg.data.fields.negatives == "negatives"
    assert (cfg.base, cfg.teacher, cfg.train.steps, cfg.train.batch_size, cfg.max_pairs, cfg.nproc) == \
           ("B", "T", 7, 8, 50, 2)
    assert cfg.user_data and cfg.split_sizes()["max_pairs"] == 50
    (tmp_path / "c.yaml").write_text("train: {steps: 3}\nnproc: 4\n")
    assert load_quickstart_config(tmp_path / "c.yaml", steps=9).train.steps == 9  # options over the file
    with pytest.raises(MoembedError, match="--fields: unknown role 'answer'"):
        load_quickstart_config(None, fields="answer=a")
    with pytest.raises(MoembedError, match="--fields: 'query': expected ROLE=FIELD"):
        load_quickstart_config(None, fields="query")
    with pytest.raises(MoembedError, match="must be divisible by nproc"):
        load_quickstart_config(None, batch_size=10, nproc=3)
    with pytest.raises(MoembedError, match="--preset: unknown preset 'nope'"):
        load_quickstart_config(None, "nope")


def test_given_and_mined_negatives_are_combined_up_to_num_negatives():
    from moembed.recipes.curation import _negatives

    row = {"given_negatives": ["g1", "g2"], "negatives": ["m1", "g2", "m2", "m3"], "negative_scores": [0.1] * 4}
    assert _negatives(dict(row), "combine", 4) == ["g1", "g2", "m1", "m2"]
    assert _negatives(dict(row), "combine", 1) == ["g1", "g2"]  # given ones are kept beyond k
    assert _negatives(dict(row), "given", 4) == ["g1", "g2"]
    assert _negatives(dict(row), "mined", 4) == ["m1", "g2", "m2", "m3"]
    assert _negatives({"negatives": ["m1"]}, "combine", 4) == ["m1"]


def test_torchrun_command_runs_this_moembed_with_n_processes(tmp_path):
    import sys

    from moembed.distributed import torchrun_command

    cmd = torchrun_command(["train", tmp_path / "moe.yaml", "--quiet"], 3)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc-per-node=3" in cmd
    assert cmd[cmd.index("moembed.cli.main") + 1:] == ["train", str(tmp_path / "moe.yaml"), "--quiet"]


def test_decisions_warn_when_the_data_is_too_small_for_moe(tmp_path):
    from types import SimpleNamespace

    from moembed.recipes.report import MOE_DATA_SCALE
    from moembed.recipes.report_text import _decision_lines, decisions

    qs = SimpleNamespace(cfg=load_quickstart_config(None, data=["x.jsonl"], steps=50, batch_size=16))
    stages = {
        "data": {"user": {"documents": {"train": 90, "dev": 5, "test": 5}, "duplicates": 2,
                          "pairs": {"train": 180, "train_available": 180, "dev": 10, "test": 10}}},
        "curate": {"filter": {"sources": {"a": {"pairs": 100, "kept": 60}, "b": {"pairs": 80, "kept": 20}}},
                   "train_sources": {"a": 60, "b": 20}, "too_small": {}, "negatives_mode": "combine",
                   "negatives_per_query": 3.5},
    }
    d = decisions(qs, stages)
    assert "too small for the MoE" in d["warning"] and "§7.2" in d["warning"] and "80 training pairs" in d["warning"]
    text = _decision_lines(d)
    for part in ("train 90 documents / 180 pairs", "test 5 / 10", "a 60/100 (60%)", "b 20/80 (25%)",
                 "negatives per query: 3.5", "50 steps × batch 16", "learning rate 5e-05"):
        assert part in text, part
    stages["curate"]["train_sources"] = {"a": MOE_DATA_SCALE}
    assert "warning" not in decisions(qs, stages)


def test_input_is_streamed_one_block_at_a_time(tmp_path, monkeypatch):
    from moembed.data.sources import JsonlReader
    from moembed.recipes.userdata import prepare_user_data

    f = _write(tmp_path / "mine.jsonl", _pairs(200))
    blocks = []
    real = JsonlReader._read_block

    def counted(self, start):
        items, end = real(self, start)
        blocks.append(len(items))
        return items, end

    monkeypatch.setattr(JsonlReader, "_FILE_ORDER_CHUNK", 32)
    monkeypatch.setattr(JsonlReader, "_read_block", counted)
    prepare_user_data(_cfg(tmp_path, [f]), tmp_path / "out")
    # Two passes over 400 records in blocks of at most 32: never the whole file at once.
    assert max(blocks) == 32 and sum(blocks) == 2 * 400


def test_every_malformed_record_is_listed_before_any_work(tmp_path):
    from moembed.recipes.userdata import prepare_user_data

    rows = [json.dumps(r) for r in _pairs(60)]
    rows[9], rows[29], rows[49] = '{"query": "q \\ud800", "document": "d"}', '{"query": ', '{"query": "q"}'
    f = tmp_path / "bad.jsonl"
    f.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(MoembedError) as e:
        prepare_user_data(_cfg(tmp_path, [f]), tmp_path / "out")
    lines = str(e.value).splitlines()
    assert lines[0] == "--data: 3 malformed record(s):"
    assert lines[1].strip() == f"--data: {f}:10: not valid Unicode (lone surrogate U+D800 at character 2)"
    assert lines[2].strip().startswith(f"--data: {f}:30: invalid JSON")
    assert lines[3].strip().startswith(f"--data: {f}:50: missing field 'document'")
    assert not (tmp_path / "out").exists()
