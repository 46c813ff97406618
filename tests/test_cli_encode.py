"""`moembed encode`, `info`, `export` as a user runs them: outputs, exit codes, no partial files."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "moembed.cli.main", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def test_encode_writes_rows_in_order(tiny_dir, tmp_path):
    from moembed.model.embedder import Embedder

    texts = ["first", "", "third text is longer than the others", "ünïcödé"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts), encoding="utf-8")
    r = run("encode", tiny_dir, tmp_path / "in.jsonl", "--out", tmp_path / "o.npy", "--dim", 16)
    assert r.returncode == 0, r.stderr
    x = np.load(tmp_path / "o.npy")
    np.testing.assert_allclose(x, Embedder.load(tiny_dir).encode(texts, dim=16), atol=1e-6)


def test_encode_plain_and_binary(tiny_dir, tmp_path):
    (tmp_path / "in.txt").write_text("one\ntwo\nthree\n")
    r = run("encode", tiny_dir, tmp_path / "in.txt", "-o", tmp_path / "o.npy", "--plain", "--precision", "binary")
    assert r.returncode == 0, r.stderr
    assert np.load(tmp_path / "o.npy").shape == (3, 4)


def test_encode_int8_calibrates_on_input(tiny_dir, tmp_path):
    (tmp_path / "in.txt").write_text("one\ntwo\nthree\nfour\n")
    r = run("encode", tiny_dir, tmp_path / "in.txt", "-o", tmp_path / "o.npy", "--plain", "--precision", "int8")
    assert r.returncode == 0, r.stderr
    assert np.load(tmp_path / "o.npy").dtype == np.int8
    assert "int8 ranges from 4 calibration texts" in r.stderr


def test_encode_dtype_int8_is_close_to_float32_and_names_its_kernel(tiny_dir, tmp_path):
    from moembed.model.cpu import int8_available
    from moembed.model.fast.int8 import int8_path

    if not int8_available():
        pytest.skip("this torch build has no x86 quantised kernels")
    texts = [f"sentence number {i} about a topic of its own" for i in range(12)]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    out = {}
    for dtype in ("float32", "int8"):
        r = run("encode", tiny_dir, tmp_path / "in.txt", "-o", tmp_path / f"{dtype}.npy", "--plain",
                "--dtype", dtype)
        assert r.returncode == 0, r.stderr
        out[dtype] = np.load(tmp_path / f"{dtype}.npy")
    assert f"int8 matmuls on {int8_path()}" in r.stderr  # the kernel this CPU runs, and its per-row work
    assert (out["float32"] * out["int8"]).sum(1).min() > 0.99
    assert not np.array_equal(out["float32"], out["int8"])  # int8 did run


@pytest.mark.parametrize(
    "content, args, message",
    [
        (b'"a"\n42\n', [], "in.jsonl:2: expected a JSON string, got int"),
        (b'{"id": 1, "text": "a"}\n', [], "in.jsonl:1: expected a JSON string, got an object (keys: id, text); "
                                          "name the key of the text with --field KEY"),
        (b'"a"\n{oops\n', [], "in.jsonl:2: invalid JSON"),
        (b'"a"\n"\xff\xfe"\n', [], "in.jsonl:2: not valid UTF-8"),
        (b'"a"\n', ["--dim", "999"], "--dim: 999 is out of range"),
        (b'"a"\n', ["--prompt", "nope"], "unknown name 'nope'"),
    ],
)
def test_bad_input_one_line_error_no_output(tiny_dir, tmp_path, content, args, message):
    (tmp_path / "in.jsonl").write_bytes(content)
    r = run("encode", tiny_dir, tmp_path / "in.jsonl", "-o", tmp_path / "o.npy", *args)
    assert r.returncode == 1
    assert message in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("moembed: error:")
    assert "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "in.jsonl"]  # nothing written, not even a temporary file


def test_unreadable_input_and_broken_model(tiny_dir, tmp_path):
    r = run("encode", tiny_dir, tmp_path / "missing.jsonl", "-o", tmp_path / "o.npy")
    assert r.returncode == 1 and "missing.jsonl: cannot read" in r.stderr
    (tmp_path / "in.jsonl").write_text('"a"\n')
    r = run("encode", tmp_path, tmp_path / "in.jsonl", "-o", tmp_path / "o.npy")
    assert r.returncode == 1 and "config.json: missing" in r.stderr
    assert not (tmp_path / "o.npy").exists()


def test_info(tiny_dir):
    r = run("info", tiny_dir)
    assert r.returncode == 0, r.stderr
    assert "parameters" in r.stdout and "search_query" in r.stdout and "bert" in r.stdout


def test_export_cli(tiny_dir, tmp_path):
    r = run("export", tiny_dir, "--format", "sentence-transformers", "--out", tmp_path / "st")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "st" / "modules.json").exists()
