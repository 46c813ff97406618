"""Embedder.encode: parity with sentence-transformers, batch independence, Matryoshka, precisions, bad input."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from moembed.errors import MoembedError
from moembed.model.pooling import dequantize_int8, int8_ranges, quantize_int8, unpack_binary


@pytest.fixture(scope="module")
def sentences():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from sentences import news_sentences

    return news_sentences(64) + ["", "x", "word " * 400]


@pytest.mark.real
def test_encode_matches_sentence_transformers(minilm_path, minilm, sentences):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_path), device="cpu")
    want = st.encode(sentences, batch_size=16)
    got = minilm.encode(sentences, batch_size=16)
    assert got.shape == want.shape and got.dtype == np.float32
    assert (got * want).sum(1).min() >= 0.99999


@pytest.mark.real
def test_bf16_path_close_to_float32(minilm, sentences):
    a = minilm.encode(sentences[:32])
    b = minilm.encode(sentences[:32], bf16=True)
    assert b.dtype == np.float32
    assert (a * b).sum(1).min() >= 0.999


def test_embeddings_do_not_depend_on_the_batch(make_tiny, sentences):
    emb = make_tiny()
    together = emb.encode(sentences[:20], batch_size=7)
    alone = np.stack([emb.encode([t])[0] for t in sentences[:20]])
    np.testing.assert_allclose(together, alone, atol=1e-5)
    np.testing.assert_allclose(emb.encode(sentences[:20][::-1], batch_size=3)[::-1], together, atol=1e-5)


def test_results_in_input_order_and_normalized(make_tiny):
    emb = make_tiny()
    texts = ["short", "a much longer text with many more tokens in it", "mid length text"]
    x = emb.encode(texts, batch_size=1)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    for i, t in enumerate(texts):
        np.testing.assert_allclose(emb.encode(t), x[i], atol=1e-5)  # a single string → one vector


def test_matryoshka_truncation(make_tiny):
    emb = make_tiny()
    full = emb.encode(["a text"], normalize=False)
    cut = emb.encode(["a text"], dim=8)
    np.testing.assert_allclose(cut[0], full[0, :8] / np.linalg.norm(full[0, :8]), atol=1e-5)


def test_prompts_are_prefixed(make_tiny):
    emb = make_tiny()
    np.testing.assert_allclose(emb.encode(["x"], prompt="search_query"), emb.encode(["search_query: x"]), atol=1e-6)
    with pytest.raises(MoembedError, match="unknown name 'nope'"):
        emb.encode(["x"], prompt="nope")


def test_int8_round_trip():
    rng = np.random.default_rng(0)
    cal = rng.normal(size=(500, 16)).astype(np.float32)
    ranges = int8_ranges(cal)
    q = quantize_int8(cal, ranges)
    assert q.dtype == np.int8 and q.min() >= -128 and q.max() <= 127
    step = (ranges[1] - ranges[0]) / 255
    assert np.all(np.abs(dequantize_int8(q, ranges) - cal) <= step / 2 + 1e-6)


def test_binary_round_trip():
    x = np.array([[0.5, -0.1, 0.2, -3.0, 1.0, 0.0, 2.0, -1.0, 0.3]], dtype=np.float32)
    b = __import__("moembed.model.pooling", fromlist=["binarize"]).binarize(x)
    assert b.shape == (1, 2) and b.dtype == np.uint8
    np.testing.assert_array_equal(unpack_binary(b, 9), np.where(x > 0, 1.0, -1.0))


def test_encode_precisions(make_tiny):
    emb = make_tiny()
    texts = [f"text number {i}" for i in range(30)]
    with pytest.raises(MoembedError, match="calibration"):
        emb.encode(texts, precision="int8")
    emb.calibrate(texts)
    q = emb.encode(texts, precision="int8", dim=16)
    assert q.shape == (30, 16) and q.dtype == np.int8
    f = emb.encode(texts, dim=16)
    np.testing.assert_allclose(dequantize_int8(q, emb.int8_ranges(16)), f, atol=2 * np.ptp(f, 0).max() / 255)
    b = emb.encode(texts, precision="binary")
    assert b.shape == (30, 4) and b.dtype == np.uint8


def test_bad_arguments(make_tiny):
    emb = make_tiny()
    with pytest.raises(MoembedError, match="precision"):
        emb.encode(["a"], precision="fp8")
    with pytest.raises(MoembedError, match="dim"):
        emb.encode(["a"], dim=0)
    with pytest.raises(MoembedError, match="dim"):
        emb.encode(["a"], dim=33)
    with pytest.raises(MoembedError, match=r"texts\[1\]"):
        emb.encode(["a", 3])


def test_empty_and_overlong_texts(make_tiny, caplog):
    emb = make_tiny(max_length=16)
    with caplog.at_level(logging.WARNING, logger="moembed"):
        x = emb.encode(["", "word " * 100, "word " * 50, "ok"])
    assert np.isfinite(x).all() and x.shape == (4, 32)
    warnings = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert warnings == ["2 of 4 texts were longer than 16 tokens and were truncated"]  # reported once, with a count


def test_encode_does_not_track_gradients_and_restores_mode(make_tiny):
    emb = make_tiny()
    emb.train()
    emb.encode(["a"])
    assert emb.training
    assert all(p.grad is None for p in emb.parameters())
    assert torch.is_grad_enabled()
