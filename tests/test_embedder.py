"""Embedder.encode: parity with sentence-transformers, batch independence, Matryoshka, precisions, bad input."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from moembed.errors import MoembedError
from moembed.model.pooling import dequantize_scalar, int8_ranges, pack_bits, quantize_scalar, unpack_bits


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
    want = emb.encode(["search_query: x"])
    np.testing.assert_allclose(emb.encode(["x"], prompt_name="search_query"), want, atol=1e-6)
    np.testing.assert_allclose(emb.encode(["x"], prompt="search_query: "), want, atol=1e-6)  # a literal prefix
    with pytest.raises(MoembedError, match="unknown name 'nope'; this model knows: classification, clustering, search_d"):
        emb.encode(["x"], prompt_name="nope")
    with pytest.raises(MoembedError, match="prompt and prompt_name: give one"):
        emb.encode(["x"], prompt_name="search_query", prompt="search_query: ")


def test_int8_round_trip():
    rng = np.random.default_rng(0)
    cal = rng.normal(size=(500, 16)).astype(np.float32)
    ranges = int8_ranges(cal)
    step = (ranges[1] - ranges[0]) / 255
    for precision, dtype in (("int8", np.int8), ("uint8", np.uint8)):
        q = quantize_scalar(cal, ranges, precision)
        assert q.dtype == dtype and q.min() == np.iinfo(dtype).min and q.max() == np.iinfo(dtype).max
        assert np.all(np.abs(dequantize_scalar(q, ranges) - cal) <= step / 2 + 1e-5)  # bucket centres
    outside = quantize_scalar(np.stack([ranges[0] - 1, ranges[1] + 1]), ranges, "int8")
    assert (outside[0] == -128).all() and (outside[1] == 127).all()  # clipped, not wrapped


def test_binary_round_trip():
    x = np.array([[0.5, -0.1, 0.2, -3.0, 1.0, 0.0, 2.0, -1.0, 0.3]], dtype=np.float32)
    u, s = pack_bits(x, "ubinary"), pack_bits(x, "binary")
    assert u.shape == s.shape == (1, 2) and u.dtype == np.uint8 and s.dtype == np.int8
    np.testing.assert_array_equal(u, [[0b10101010, 0b10000000]])  # big-endian bits of x > 0
    np.testing.assert_array_equal(s.astype(int), u.astype(int) - 128)
    for b in (u, s):
        np.testing.assert_array_equal(unpack_bits(b, 9), np.where(x > 0, 1.0, -1.0))


def test_encode_precisions(make_tiny):
    emb = make_tiny()
    texts = [f"text number {i}" for i in range(30)]
    with pytest.raises(MoembedError, match="calibration"):
        emb.encode(texts, precision="int8")
    emb.calibrate(texts)
    q = emb.encode(texts, precision="int8", dim=16)
    assert q.shape == (30, 16) and q.dtype == np.int8
    f = emb.encode(texts, dim=16)
    np.testing.assert_allclose(dequantize_scalar(q, emb.int8_ranges(16)), f, atol=np.ptp(f, 0).max() / 255)
    u = emb.encode(texts, precision="uint8", truncate_dim=16)
    np.testing.assert_array_equal(u.astype(int), q.astype(int) + 128)
    b, ub = emb.encode(texts, precision="binary"), emb.encode(texts, precision="ubinary")
    assert b.shape == ub.shape == (30, 4) and b.dtype == np.int8 and ub.dtype == np.uint8
    np.testing.assert_array_equal(ub, np.packbits(emb.encode(texts) > 0, axis=-1))


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


def test_sentence_transformers_arguments_on_a_tiny_model(make_tiny):
    emb = make_tiny()
    texts = ["a text", "another text here"]
    x = emb.encode(texts)
    np.testing.assert_array_equal(emb.encode_query(texts), emb.encode(texts, prompt_name="search_query"))
    np.testing.assert_array_equal(emb.encode_document(texts), emb.encode(texts, prompt_name="search_document"))
    np.testing.assert_array_equal(emb.encode_query(texts, prompt="q: "), emb.encode(["q: " + t for t in texts]))
    emb.prompts = {}
    np.testing.assert_array_equal(emb.encode_query(texts), x)  # no query prompt: no prefix
    # older names are aliases; both at once is an error
    np.testing.assert_array_equal(emb.encode(texts, dim=8), emb.encode(texts, truncate_dim=8))
    np.testing.assert_array_equal(emb.encode(texts, normalize=False), emb.encode(texts, normalize_embeddings=False))
    with pytest.raises(MoembedError, match="dim: an alias of truncate_dim; give one of them, not both"):
        emb.encode(texts, dim=8, truncate_dim=8)
    t = emb.encode(texts, convert_to_tensor=True)
    assert isinstance(t, torch.Tensor) and torch.equal(t, torch.from_numpy(x))
    with pytest.raises(MoembedError, match="output_value: unknown 'pooled'; choose one of sentence_embedding"):
        emb.encode(texts, output_value="pooled")
    with pytest.raises(MoembedError, match="precision: unknown 'fp8'; choose one of float32, int8, uint8, binary"):
        emb.encode(texts, precision="fp8")
    tokens = emb.encode(texts, output_value="token_embeddings")
    assert [tuple(r.shape) for r in tokens] == [(len(i), 32) for i in emb.token_ids(texts)[0]]


def test_similarity_functions(make_tiny):
    emb = make_tiny()
    a, b = emb.encode(["a", "b", "c"], normalize_embeddings=False), emb.encode(["d", "e"], normalize_embeddings=False)
    cos = emb.similarity(a, b)
    want = (a / np.linalg.norm(a, axis=1, keepdims=True)) @ (b / np.linalg.norm(b, axis=1, keepdims=True)).T
    assert isinstance(cos, torch.Tensor) and cos.shape == (3, 2)
    np.testing.assert_allclose(cos.numpy(), want, atol=1e-6)
    emb.similarity_fn_name = "dot"
    np.testing.assert_allclose(emb.similarity(a, b).numpy(), a @ b.T, atol=1e-5)
    np.testing.assert_allclose(emb.similarity_pairwise(a[:2], b).numpy(), (a[:2] * b).sum(1), atol=1e-5)
    with pytest.raises(MoembedError, match="similarity_fn_name: unknown 'l2'; choose one of cosine, dot"):
        emb.similarity_fn_name = "l2"
    with pytest.raises(MoembedError, match="similarity_pairwise: shapes"):
        emb.similarity_pairwise(a, b)
