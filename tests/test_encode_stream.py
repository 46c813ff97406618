"""Corpus-scale `moembed encode`: streamed chunks equal the in-memory encode, every input format, bad input,
SIGKILL at seeded instants then resume, and two processes under torchrun."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from kill_helpers import Killer, run_forked

ROOT = Path(__file__).resolve().parents[1]
WORDS = "sparse experts route tokens to a few feed forward networks while the rest stay idle".split()


def texts_of(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 30))) for _ in range(n)]


def run_cli(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "moembed.cli.main", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=ROOT)


def job_of(tiny_dir, path, out, **kw):
    from moembed.recipes.corpus_input import CorpusInput
    from moembed.recipes.encode_corpus import EncodeJob

    fmt = {k: kw.pop(k) for k in ("format", "field", "column") if k in kw}
    kw.setdefault("device", "cpu")
    return EncodeJob(model=str(tiny_dir), input=CorpusInput.open(path, **fmt), out=Path(out), **kw)


def write_jsonl(path: Path, values) -> Path:
    path.write_text("".join(json.dumps(v) + "\n" for v in values), encoding="utf-8")
    return path


# ---- equality with the in-memory encode -----------------------------------------------------------------------


@pytest.mark.parametrize("precision, dim, prompt", [("float32", None, None), ("float32", 16, "search_query"),
                                                    ("binary", None, None), ("int8", 24, None)])
def test_stream_equals_in_memory_encode(tiny_dir, tmp_path, precision, dim, prompt, one_torch_thread):
    from moembed.model.embedder import Embedder
    from moembed.recipes.encode_corpus import encode_corpus

    texts = texts_of(53)
    path = write_jsonl(tmp_path / "in.jsonl", texts)
    rows, width, dtype = encode_corpus(job_of(tiny_dir, path, tmp_path / "o.npy", chunk_rows=7, batch_size=4,
                                              precision=precision, dim=dim, prompt=prompt))
    emb = Embedder.load(tiny_dir)
    if precision == "int8":
        emb.calibrate(texts, prompt_name=prompt)
    ref = emb.encode(texts, prompt_name=prompt, truncate_dim=dim, precision=precision, batch_size=4)
    got = np.load(tmp_path / "o.npy")
    assert (rows, width, dtype) == (53, ref.shape[1], ref.dtype) and got.shape == ref.shape and got.dtype == ref.dtype
    if precision == "float32":  # chunks of 7 make other batches than one pass over 53 texts: rounding only
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
    else:  # codes: equal, but for a code on a rounding boundary
        assert (got != ref).mean() < 0.01
    assert not (tmp_path / "o.npy.partial").exists()


def test_each_input_format_and_parquet_shards(tiny_dir, tmp_path, one_torch_thread):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moembed.model.embedder import Embedder
    from moembed.recipes.encode_corpus import encode_corpus

    texts = texts_of(23) + ["", "ünïcödé line"]
    ref = Embedder.load(tiny_dir).encode(texts)
    inputs = {
        "jsonl": (write_jsonl(tmp_path / "s.jsonl", texts), {}),
        "field": (write_jsonl(tmp_path / "o.jsonl", [{"id": i, "body": t} for i, t in enumerate(texts)]), {"field": "body"}),
        "text": (tmp_path / "t.txt", {"format": "text"}),
        "parquet": (tmp_path / "p.parquet", {"column": "body"}),
    }
    (tmp_path / "t.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"n": list(range(len(texts))), "body": texts}), tmp_path / "p.parquet", row_group_size=4)
    (tmp_path / "o.jsonl").write_text((tmp_path / "o.jsonl").read_text() + "\n  \n")  # blank lines are not rows
    for name, (path, fmt) in inputs.items():
        out = tmp_path / f"{name}.npy"
        encode_corpus(job_of(tiny_dir, path, out, chunk_rows=5, **fmt))  # chunks of 5 across row groups of 4
        np.testing.assert_allclose(np.load(out), ref, rtol=0, atol=1e-6, err_msg=name)
    encode_corpus(job_of(tiny_dir, tmp_path / "p.parquet", tmp_path / "shards", chunk_rows=10, column="body"))
    files = sorted(p.name for p in (tmp_path / "shards").iterdir())
    assert files == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    table = pq.read_table(tmp_path / "shards")
    assert table.column("id").to_pylist() == list(range(len(texts)))
    np.testing.assert_allclose(np.array(table.column("embedding").to_pylist(), dtype=np.float32), ref, atol=1e-6)


# ---- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, content, fmt, message",
    [
        ("in.jsonl", '{"body": "a"}\n{"text": "b"}\n', {"field": "body"}, "in.jsonl:2: no field 'body' (keys: text)"),
        ("in.jsonl", '{"body": "a"}\n\n{"body": 3}\n', {"field": "body"}, "in.jsonl:3: field 'body' is int"),
        ("in.jsonl", '"a"\n["b"]\n', {}, "in.jsonl:2: expected a JSON string, got list"),
        ("in.jsonl", "\n \n", {}, "in.jsonl: no texts to embed"),
        ("in.txt", "", {"format": "text"}, "in.txt: no texts to embed"),
        ("in.parquet", None, {"column": "body"}, "in.parquet: row 1: column 'body' is null"),
        ("in.parquet", None, {"column": "text"}, "in.parquet: no column 'text' (columns: body)"),
        ("in.parquet", "not parquet", {"column": "body"}, "in.parquet: not a Parquet file"),
        ("in.txt", "a\n", {"field": "body", "format": "text"}, "--field: only for JSONL input"),
        ("in.parquet", None, {}, "--column: in.parquet is Parquet; name the column"),
    ],
)
def test_bad_input_names_file_and_line_and_writes_nothing(tiny_dir, tmp_path, name, content, fmt, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moembed.errors import MoembedError
    from moembed.recipes.encode_corpus import encode_corpus

    path = tmp_path / name
    if content is None:
        pq.write_table(pa.table({"body": ["a", None, "c"]}), path)
    else:
        path.write_text(content)
    with pytest.raises(MoembedError) as e:
        encode_corpus(job_of(tiny_dir, path, tmp_path / "o.npy", **fmt))
    assert message in str(e.value).replace(str(tmp_path) + "/", "")
    assert sorted(tmp_path.iterdir()) == [path]  # no output, no partial state


def test_unknown_device_and_cli_errors(tiny_dir, tmp_path):
    from moembed.errors import MoembedError
    from moembed.recipes.encode_corpus import encode_corpus

    path = write_jsonl(tmp_path / "in.jsonl", ["a"])
    with pytest.raises(MoembedError, match=r"device: unknown 'tpu'; choose one of auto, cpu, cuda, cuda:N, mps"):
        encode_corpus(job_of(tiny_dir, path, tmp_path / "o.npy", device="tpu"))
    with pytest.raises(MoembedError, match="--out: .*o.npz must end in .npy"):
        job_of(tiny_dir, path, tmp_path / "o.npz")
    r = run_cli("encode", tiny_dir, path, "-i", path, "--out", tmp_path / "o.npy")
    assert r.returncode == 1 and "--input: the old spelling of INPUT; give INPUT only" in r.stderr
    r = run_cli("encode", tiny_dir, path, "--out", tmp_path / "o.npy", "--device", "tpu")
    assert r.returncode == 1 and "choose one of auto, cpu, cuda" in r.stderr and "Traceback" not in r.stderr


# ---- kill and resume --------------------------------------------------------------------------------------------


@contextmanager
def killing(chunk: int, killer: Killer, in_finish: bool):
    """Run the killer's count (and SIGKILL at its event) inside the write of `chunk`, or inside `finish`."""
    from moembed.recipes.encode_state import ChunkWriter, PartialState

    cls, name = (PartialState, "finish") if in_finish else (ChunkWriter, "write")
    real = getattr(cls, name)

    def wrapped(self, *args):
        if not in_finish and args[0] != chunk:
            return real(self, *args)
        with killer.active():
            return real(self, *args)

    setattr(cls, name, wrapped)
    try:
        yield killer
    finally:
        setattr(cls, name, real)


def _encode_killed(job, chunk: int, killer: Killer, in_finish: bool) -> None:
    from moembed.recipes.encode_corpus import encode_corpus

    with killing(chunk, killer, in_finish):
        encode_corpus(job)


def _events(tiny_dir, tmp_path, path, kind, in_finish: bool) -> int:
    """Interpreter events inside one chunk's write (or inside finish): the range the seeded kills are drawn from."""
    from moembed.recipes.encode_corpus import encode_corpus

    with killing(1, Killer(-1), in_finish) as counter:
        encode_corpus(job_of(tiny_dir, path, tmp_path / "dry" / kind, chunk_rows=6))
    return counter.n


@pytest.mark.parametrize("kind", ["o.npy", "shards"])
def test_sigkill_at_seeded_instants_then_resume_equals_uninterrupted(tiny_dir, tmp_path, kind, one_torch_thread):
    import pyarrow.parquet as pq

    from moembed.recipes.encode_corpus import encode_chunks, encode_corpus, load_model, prepare
    from moembed.recipes.encode_state import PartialState, partial_dir

    def read(out):
        if kind == "o.npy":
            return np.load(out)
        return np.array(pq.read_table(out).column("embedding").to_pylist(), dtype=np.float32)

    path = write_jsonl(tmp_path / "in.jsonl", texts_of(40))  # 7 chunks of 6 (the last of 4)
    sizes = [6] * 6 + [4]
    encode_corpus(job_of(tiny_dir, path, tmp_path / "ref" / kind, chunk_rows=6))
    ref = read(tmp_path / "ref" / kind)
    n_write, n_finish = _events(tiny_dir, tmp_path, path, kind, False), _events(tiny_dir, tmp_path, path, kind, True)
    assert n_write > 5 and n_finish > 5
    rng = random.Random(17)
    for trial in range(8):
        out = tmp_path / f"t{trial}" / kind
        job = job_of(tiny_dir, path, out, chunk_rows=6)
        in_finish, chunk = trial >= 6, rng.randrange(7)
        code = run_forked(_encode_killed, job, chunk, Killer(rng.randint(1, n_finish if in_finish else n_write)), in_finish)
        assert code == -9  # every drawn instant lies inside the write (or finish)
        if out.exists():  # killed inside finish after the rename: the output is complete
            assert in_finish
            np.testing.assert_array_equal(read(out), ref)
            assert PartialState.open(partial_dir(out)) is None  # what is left of the state is removed, not resumed
        else:  # no output, and a state with every chunk before the killed one done
            state = PartialState.open(partial_dir(out))
            done = state.done()
            assert set(range(6 if in_finish else chunk)) <= done
            emb = load_model(job)
            assert encode_chunks(job, emb, prepare(job, emb)) == sum(sizes) - sum(sizes[i] for i in done)
            encode_corpus(job)  # nothing left to embed: moves the data into place
            np.testing.assert_array_equal(read(out), ref)  # same chunks, same batches: bit-identical
        assert not partial_dir(out).exists()


def test_resume_with_other_settings_is_refused(tiny_dir, tmp_path):
    from moembed.errors import MoembedError
    from moembed.recipes.encode_corpus import encode_corpus, load_model, prepare

    path = write_jsonl(tmp_path / "in.jsonl", texts_of(10))
    job = job_of(tiny_dir, path, tmp_path / "o.npy", chunk_rows=4)
    prepare(job, load_model(job))  # a state, as a killed run leaves it
    with pytest.raises(MoembedError, match=r"o.npy.partial: an interrupted run with other settings \(dim: was None, now 8\)"):
        encode_corpus(job_of(tiny_dir, path, tmp_path / "o.npy", chunk_rows=4, dim=8))
    assert not (tmp_path / "o.npy").exists()
    encode_corpus(job)
    assert np.load(tmp_path / "o.npy").shape == (10, 32)


# ---- two processes ----------------------------------------------------------------------------------------------


def test_nproc_two_processes_one_output_in_input_order(tiny_dir, tmp_path):
    from moembed.model.embedder import Embedder

    texts = texts_of(45, seed=3)
    path = write_jsonl(tmp_path / "in.jsonl", texts)
    r = run_cli("encode", tiny_dir, path, "--out", tmp_path / "o.npy", "--nproc", 2, "--device", "cpu",
                "--chunk-size", 4, "--dim", 16)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 0 of 2: 24 texts in 6 chunks" in r.stderr and "rank 1 of 2: 21 texts in 6 chunks" in r.stderr
    assert "wrote 45 x 16 float32" in r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "o.npy"), Embedder.load(tiny_dir).encode(texts, dim=16), atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "o.npy"]


def test_move_into_place_replaces_a_file_or_a_directory(tmp_path):
    from moembed.fileio import move_into_place

    (tmp_path / "new.npy").write_bytes(b"new")
    (tmp_path / "out.npy").write_bytes(b"old")
    move_into_place(tmp_path / "new.npy", tmp_path / "out.npy")
    assert (tmp_path / "out.npy").read_bytes() == b"new" and not (tmp_path / "new.npy").exists()
    for name, content in (("old", b"1"), ("new", b"2")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "part-000000.parquet").write_bytes(content)
    move_into_place(tmp_path / "new", tmp_path / "old")  # a directory onto an existing one
    assert (tmp_path / "old" / "part-000000.parquet").read_bytes() == b"2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "out.npy"]


def test_cli_resumes_a_partial_state(tiny_dir, tmp_path):
    from moembed.recipes.encode_corpus import encode_chunks, load_model, prepare

    texts = texts_of(12, seed=5)
    path = write_jsonl(tmp_path / "in.jsonl", texts)
    job = job_of(tiny_dir, path, tmp_path / "o.npy", chunk_rows=4)
    emb = load_model(job)
    encode_chunks(job, emb, prepare(job, emb), rank=0, world=3)  # chunk 0 of 3 done, as a killed run leaves it
    r = run_cli("encode", tiny_dir, path, "--out", tmp_path / "o.npy", "--chunk-size", 4, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "o.npy.partial: 1 of 3 chunks done" in r.stderr
    from moembed.model.embedder import Embedder

    np.testing.assert_allclose(np.load(tmp_path / "o.npy"), Embedder.load(tiny_dir).encode(texts), atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "o.npy"]


# ---- invalid Unicode --------------------------------------------------------------------------------------------


def _with_surrogate(path: Path, n: int, line: int, field: str | None = None) -> Path:
    """n texts as JSONL, line `line` holding a lone surrogate: valid JSON ("\\ud800"), not encodable Unicode."""
    rows = [json.dumps(t if field is None else {field: t}) for t in texts_of(n, seed=7)]
    rows[line - 1] = '"a \\ud800 b"' if field is None else '{"%s": "a \\ud800 b"}' % field
    path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("field", [None, "body"])
def test_a_lone_surrogate_fails_the_first_pass_naming_the_line(tiny_dir, tmp_path, field):
    path = _with_surrogate(tmp_path / "in.jsonl", 30, 17, field)
    args = ["--field", field] if field else []
    r = run_cli("encode", tiny_dir, path, "--out", tmp_path / "o.npy", "--chunk-size", 4, "--device", "cpu", *args)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "in.jsonl:17: not valid Unicode (lone surrogate U+D800 at character 2)" in r.stderr
    assert sorted(tmp_path.iterdir()) == [path]  # failed before writing anything


def test_parquet_text_that_is_not_utf8_names_the_row(tiny_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moembed.errors import MoembedError
    from moembed.recipes.encode_corpus import encode_corpus

    raw = [t.encode() for t in texts_of(9)]
    raw[5] = b"a\xed\xa0\x80b"  # an encoded surrogate: Parquet stores it, Python cannot decode it
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"body": pa.array(raw, pa.binary()).view(pa.string())}), path)
    with pytest.raises(MoembedError, match=r"in.parquet: row 5: column 'body' is not valid UTF-8"):
        encode_corpus(job_of(tiny_dir, path, tmp_path / "o.npy", column="body", chunk_rows=4))
    assert sorted(tmp_path.iterdir()) == [path]


def test_a_state_left_by_a_run_that_met_a_bad_line_gives_a_clear_error_on_resume(tiny_dir, tmp_path, monkeypatch):
    from moembed.errors import MoembedError
    from moembed.recipes import corpus_input
    from moembed.recipes.encode_corpus import encode_corpus
    from moembed.recipes.encode_state import PartialState, partial_dir

    path = _with_surrogate(tmp_path / "in.jsonl", 30, 17)
    out = tmp_path / "o.npy"
    # the state a run leaves when its first pass let the line through (as before lone surrogates were checked):
    # chunks before the bad line done, then the failure
    with monkeypatch.context() as m:
        m.setattr(corpus_input.CorpusInput, "scan", lambda self: sum(1 for _ in self._raw_rows()))
        with pytest.raises(MoembedError, match=r"in.jsonl:17: not valid Unicode"):
            encode_corpus(job_of(tiny_dir, path, out, chunk_rows=4))
    assert PartialState.open(partial_dir(out)).done() == {0, 1, 2, 3}
    r = run_cli("encode", tiny_dir, path, "--out", out, "--chunk-size", 4, "--device", "cpu")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "in.jsonl:17: not valid Unicode" in r.stderr and "while resuming" in r.stderr
    assert PartialState.open(partial_dir(out)).done() == {0, 1, 2, 3} and not out.exists()
    path.write_text("".join(json.dumps(t) + "\n" for t in texts_of(30, seed=7)), encoding="utf-8")  # fixed
    r = run_cli("encode", tiny_dir, path, "--out", out, "--chunk-size", 4, "--device", "cpu")
    assert r.returncode == 1 and "an interrupted run with other settings (input:" in r.stderr
    import shutil

    shutil.rmtree(partial_dir(out))
    r = run_cli("encode", tiny_dir, path, "--out", out, "--chunk-size", 4, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert np.load(out).shape == (30, 32)


def test_a_directory_as_input_says_so(tiny_dir, tmp_path):
    (tmp_path / "texts").mkdir()
    r = run_cli("encode", tiny_dir, tmp_path / "texts", "--out", tmp_path / "o.npy", "--device", "cpu")
    assert r.returncode == 1 and "texts: cannot read (is a directory, not a file)" in r.stderr
    r = run_cli("encode", tiny_dir, tmp_path / "nope.jsonl", "--out", tmp_path / "o.npy", "--device", "cpu")
    assert r.returncode == 1 and "nope.jsonl: cannot read (no such file)" in r.stderr
