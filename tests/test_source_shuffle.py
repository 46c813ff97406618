"""Seeded block shuffling inside a source: once per epoch, seeded order, exact resume, true line numbers."""

from __future__ import annotations

import json

import pytest

from moembed.data.sources import PairSource, SourceStats
from moembed.errors import MoembedError
from moembed.train.build import build_pair_stream
from moembed.data.config import SourceConfig
from moembed.train.config import load_config

N, BLOCK = 53, 10  # 5 full blocks and a short one of 3


def _records(n: int = N) -> list[dict]:
    return [{"query": f"q{i}", "document": f"d{i}"} for i in range(n)]


def _write(tmp_path, fmt: str, n: int = N):
    """The same n records as JSONL (with blank lines between some), Parquet (row groups of 7) or a saved dataset."""
    recs = _records(n)
    if fmt == "jsonl":
        path = tmp_path / "s.jsonl"
        path.write_text("".join(json.dumps(r) + ("\n\n" if i % 9 == 4 else "\n") for i, r in enumerate(recs)))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "s.parquet"
        pq.write_table(pa.Table.from_pylist(recs), path, row_group_size=7)
    else:
        import datasets

        path = tmp_path / "ds"
        datasets.Dataset.from_list(recs).save_to_disk(str(path))
    return path


def _source(path, fmt: str, block: int = BLOCK, seed: int = 0, name: str = "s", skip_bad: bool = False):
    cfg = SourceConfig(path=str(path), format=fmt, name=name, shuffle_block=block, negatives_field=None)
    return PairSource(cfg, SourceStats(), skip_bad, seed)


def _take(src, n: int) -> list[int]:
    return [int(src.next().query[1:]) for _ in range(n)]


FORMATS = ["jsonl", "parquet", "hf-disk"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_record_once_per_epoch_in_a_new_order(tmp_path, fmt):
    src = _source(_write(tmp_path, fmt), fmt)
    epochs = [_take(src, N) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(N))
        assert order != list(range(N))
        # Blocks are shuffled inside, and follow each other in file order.
        for b in range(0, N, BLOCK):
            assert sorted(order[b : b + BLOCK]) == list(range(b, min(b + BLOCK, N)))
    assert epochs[0] != epochs[1] != epochs[2]
    assert src.reader.epoch == 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_seed_same_order_other_seed_or_source_other_order(tmp_path, fmt):
    path = _write(tmp_path, fmt)
    first = _take(_source(path, fmt, seed=1), 2 * N)
    assert _take(_source(path, fmt, seed=1), 2 * N) == first
    assert _take(_source(path, fmt, seed=2), 2 * N) != first
    assert _take(_source(path, fmt, seed=1, name="other"), 2 * N) != first


@pytest.mark.parametrize("fmt", FORMATS)
def test_shuffle_block_0_keeps_file_order(tmp_path, fmt):
    src = _source(_write(tmp_path, fmt), fmt, block=0)
    assert _take(src, 2 * N + 5) == list(range(N)) * 2 + list(range(5))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [0, 4, BLOCK, BLOCK + 1, 49, 50, 52, N, N + 17])
def test_resume_continues_exactly(tmp_path, fmt, k):
    """Stop after k records (mid-block, at a block boundary, in the short last block, at and past the epoch wrap),
    save the state through JSON and continue in a fresh reader: the same records as without the interruption."""
    path = _write(tmp_path, fmt)
    for block in (BLOCK, 0):
        whole = _take(_source(path, fmt, block), k + N + 5)
        a = _source(path, fmt, block)
        assert _take(a, k) == whole[:k]
        state = json.loads(json.dumps(a.state()))
        b = _source(path, fmt, block)
        b.load_state(state)
        assert _take(b, N + 5) == whole[k:]


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_is_small_plain_json_without_records(tmp_path, fmt):
    src = _source(_write(tmp_path, fmt), fmt)
    _take(src, 13)
    state = src.state()
    assert {"epoch", "block", "pos", "shuffle_block"} <= set(state)
    assert all(isinstance(v, int) for v in state.values())
    assert state["block"] == 1 and state["pos"] == 3 and state["epoch"] == 0
    assert len(json.dumps(state)) < 150


def test_malformed_line_reports_its_true_line(tmp_path):
    lines = [json.dumps(r) for r in _records(30)]
    lines.insert(17, "")  # a blank line before the bad one shifts line numbers
    lines.insert(22, "{not json")  # file line 23
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    src = _source(path, "jsonl")
    with pytest.raises(MoembedError, match=rf"{path}:23: invalid JSON"):
        _take(src, 31)

    stats = SourceStats()
    cfg = SourceConfig(path=str(path), name="s", shuffle_block=BLOCK)
    src = PairSource(cfg, stats, skip_bad=True)
    # Two epochs of the 30 good records; the last block holds only q29, so both epochs are read to their end and
    # the bad record was skipped and counted once in each.
    got = _take(src, 60)
    assert sorted(got[:30]) == sorted(got[30:]) == list(range(30)) and stats.bad["s"] == 2


def test_parquet_bad_row_reports_its_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "b.parquet"
    queries = [f"q{i}" for i in range(25)]
    queries[13] = None
    pq.write_table(pa.table({"query": queries, "document": [f"d{i}" for i in range(25)]}), path, row_group_size=4)
    with pytest.raises(MoembedError, match=rf"{path}:row 14: missing field 'query'"):
        _take(_source(path, "parquet"), 25)


def test_empty_file_still_raises(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(MoembedError, match="no records"):
        _source(tmp_path / "empty.jsonl", "jsonl")


def _legacy_state(path, fmt: str, k: int) -> dict:
    """The state a reader wrote before block shuffling, k records into epoch 0 (position of record k)."""
    if fmt == "jsonl":
        raw = path.read_bytes().split(b"\n")
        seen, line = 0, 0
        while seen < k:
            seen += bool(raw[line].strip())
            line += 1
        return {"offset": sum(len(x) + 1 for x in raw[:line]), "line": line, "epoch": 0}
    if fmt == "parquet":
        return {"group": k // 7, "row": k % 7, "epoch": 0}
    return {"index": k, "epoch": 0}


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_from_before_shuffling_continues_at_its_record(tmp_path, fmt):
    """Old states (file position only) load: reading continues from exactly that record, so the rest of the
    epoch is every remaining record once; with shuffle_block 0 it is the old file-order continuation."""
    path = _write(tmp_path, fmt)
    k = 23
    old = json.loads(json.dumps(_legacy_state(path, fmt, k)))
    plain = _source(path, fmt, block=0)
    plain.load_state(old)
    assert _take(plain, N - k + 3) == list(range(k, N)) + [0, 1, 2]

    src = _source(path, fmt)
    src.load_state(old)
    rest = _take(src, N - k)
    assert sorted(rest) == list(range(k, N)) and rest != list(range(k, N))
    assert sorted(_take(src, N)) == list(range(N)) and src.reader.epoch == 1


def test_unreadable_state_names_the_source(tmp_path):
    src = _source(_write(tmp_path, "jsonl"), "jsonl", name="news")
    with pytest.raises(MoembedError, match=r"data source 'news' .*cannot restore the reader position"):
        src.load_state({"epoch": 0})


def test_changed_shuffle_block_on_resume_skips_nothing(tmp_path):
    path = _write(tmp_path, "jsonl")
    a = _source(path, "jsonl", block=BLOCK)
    seen = _take(a, 15)
    b = _source(path, "jsonl", block=20)
    b.load_state(json.loads(json.dumps(a.state())))
    rest = _take(b, N - 10)  # the interrupted block (records 10-19) is read again from its start
    assert sorted(rest) == list(range(10, N)) and set(seen) | set(rest) == set(range(N))


def test_config_default_and_validation():
    assert SourceConfig(path="x").shuffle_block == 10_000
    base = {"model": "tiny", "steps": 1, "output_dir": "out", "data": [{"path": "x", "shuffle_block": -1}]}
    with pytest.raises(MoembedError, match=r"data\.0\.shuffle_block"):
        load_config(None, base=base)


def test_training_seed_reaches_the_sources_and_ranks_agree(tmp_path):
    """build_pair_stream passes `seed` to every source; every rank reads the same order (same global batch)."""
    path = _write(tmp_path, "jsonl")

    def batches(seed: int, rank: int = 0, world: int = 1) -> list[list[str]]:
        cfg = load_config(None, base={"model": "tiny", "steps": 1, "output_dir": str(tmp_path / "out"), "seed": seed,
                                      "batch_size": 8, "data": [{"path": str(path), "negatives_field": None,
                                                                 "shuffle_block": BLOCK}]})
        stream = build_pair_stream(cfg, SourceStats(), rank, world)
        return [stream.next().queries for _ in range(6)]

    whole = batches(3)
    assert whole == batches(3) and whole != batches(4)
    assert [q for b in whole for q in b] != [f"q{i}" for i in range(48)]
    halves = zip(batches(3, 0, 2), batches(3, 1, 2))
    assert [a + b for a, b in halves] == whole
