"""Embedder.encode against sentence-transformers' SentenceTransformer.encode on the packaged all-MiniLM-L6-v2,
argument by argument: prompts, truncate_dim, normalize_embeddings, output types, every precision, the query /
document helpers and similarity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.real, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = {"query": "query: ", "document": "passage: "}
ATOL = 2e-6  # moembed and sentence-transformers run the same float32 math in a different order


@pytest.fixture(scope="module")
def texts():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from sentences import news_sentences

    return news_sentences(24) + ["x", "a much longer sentence " * 20]


@pytest.fixture(scope="module")
def pair(minilm_path):
    """(sentence-transformers model, moembed Embedder) with the same prompts."""
    from sentence_transformers import SentenceTransformer

    from moembed.model.embedder import Embedder

    st = SentenceTransformer(str(minilm_path), device="cpu", local_files_only=True, prompts=dict(PROMPTS))
    emb = Embedder.load(minilm_path)
    emb.prompts = dict(PROMPTS)
    return st, emb


def test_default_encode_and_output_types(pair, texts):
    st, emb = pair
    want = st.encode(texts, batch_size=8)
    got = emb.encode(texts, batch_size=8)
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=ATOL)
    t = emb.encode(texts[:3], convert_to_tensor=True)
    assert isinstance(t, torch.Tensor) and t.shape == st.encode(texts[:3], convert_to_tensor=True).shape
    rows, st_rows = emb.encode(texts[:3], convert_to_numpy=False), st.encode(texts[:3], convert_to_numpy=False)
    assert isinstance(rows, list) and all(isinstance(r, torch.Tensor) and r.shape == (384,) for r in rows)
    np.testing.assert_allclose(torch.stack(rows).numpy(), torch.stack(st_rows).numpy(), atol=ATOL)
    one = emb.encode(texts[0], device="cpu", show_progress_bar=False)
    assert one.shape == st.encode(texts[0]).shape == (384,)


def test_prompt_and_prompt_name(pair, texts):
    st, emb = pair
    for kwargs in ({"prompt_name": "query"}, {"prompt_name": "document"}, {"prompt": "Represent this: "}):
        np.testing.assert_allclose(emb.encode(texts, **kwargs), st.encode(texts, **kwargs), atol=ATOL)
    assert not np.allclose(emb.encode(texts[:4], prompt_name="query"), emb.encode(texts[:4]), atol=1e-3)


def test_encode_query_and_document(pair, texts):
    st, emb = pair
    np.testing.assert_allclose(emb.encode_query(texts), st.encode_query(texts), atol=ATOL)
    np.testing.assert_allclose(emb.encode_document(texts), st.encode_document(texts), atol=ATOL)
    np.testing.assert_allclose(emb.encode_query(texts), emb.encode(texts, prompt_name="query"), atol=0)
    np.testing.assert_allclose(emb.encode_document(texts, prompt="x: "), st.encode_document(texts, prompt="x: "),
                               atol=ATOL)


def test_truncate_dim_and_normalize_embeddings(pair, texts):
    st, emb = pair
    for k in (256, 64):
        want = st.encode(texts, truncate_dim=k, normalize_embeddings=True)
        np.testing.assert_allclose(emb.encode(texts, truncate_dim=k, normalize_embeddings=True), want, atol=ATOL)
        # moembed's default renormalises a normalising model's truncated vectors (the Matryoshka convention);
        # sentence-transformers' truncates the unit vector: the same direction, so the same cosines
        got, plain = emb.encode(texts, truncate_dim=k), st.encode(texts, truncate_dim=k)
        np.testing.assert_allclose(got, want, atol=ATOL)
        np.testing.assert_allclose(got, plain / np.linalg.norm(plain, axis=1, keepdims=True), atol=ATOL)
        assert emb.encode(texts[:2], dim=k).shape == (2, k)  # moembed's older name
    np.testing.assert_allclose(emb.encode(texts, normalize_embeddings=True),
                               st.encode(texts, normalize_embeddings=True), atol=ATOL)


def test_token_embeddings(pair, texts):
    st, emb = pair
    want = st.encode(texts[:5], output_value="token_embeddings")
    got = emb.encode(texts[:5], output_value="token_embeddings")
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.cpu().numpy(), atol=1e-5)


@pytest.mark.parametrize("precision", ["binary", "ubinary"])
def test_packed_precisions(pair, texts, precision):
    from sentence_transformers.util import quantize_embeddings

    st, emb = pair
    for k in (None, 100):
        got = emb.encode(texts, precision=precision, truncate_dim=k)
        floats = emb.encode(texts, truncate_dim=k)
        np.testing.assert_array_equal(got, quantize_embeddings(floats, precision))  # exactly ST's quantisation
        want = st.encode(texts, precision=precision, truncate_dim=k)
        assert got.dtype == want.dtype and got.shape == want.shape
        # end to end, only a component within float error of 0 may take the other sign
        ref = st.encode(texts, truncate_dim=k)
        differ = np.unpackbits(np.bitwise_xor(got.view(np.uint8), want.view(np.uint8)), axis=1)[:, : ref.shape[1]]
        assert np.all(np.abs(ref[differ.astype(bool)]) < 1e-5)


@pytest.mark.parametrize("precision", ["int8", "uint8"])
def test_scalar_precisions_with_the_same_calibration(pair, texts, precision):
    """Given the same calibration embeddings, moembed's codes are sentence-transformers' codes."""
    from sentence_transformers.util import quantize_embeddings

    st, emb = pair
    calibration, queries = texts[:16], texts[16:]
    emb.calibration = None
    with pytest.raises(Exception, match="calibrat"):
        emb.encode(queries, precision=precision)
    emb.calibrate(calibration)
    try:
        for k, norm in ((None, None), (128, True)):
            got = emb.encode(queries, precision=precision, truncate_dim=k, normalize_embeddings=norm)
            cal = emb.encode(calibration, truncate_dim=k, normalize_embeddings=norm)
            floats = emb.encode(queries, truncate_dim=k, normalize_embeddings=norm)
            exact = quantize_embeddings(floats, precision, calibration_embeddings=cal)
            assert got.dtype == exact.dtype and got.shape == exact.shape == (len(queries), k or 384)
            np.testing.assert_array_equal(got, exact)
            # end to end with sentence-transformers' own floats: a code may sit on a bucket edge
            st_norm = bool(norm)
            want = quantize_embeddings(
                st.encode(queries, truncate_dim=k, normalize_embeddings=st_norm), precision,
                calibration_embeddings=st.encode(calibration, truncate_dim=k, normalize_embeddings=st_norm))
            assert np.abs(got.astype(int) - want.astype(int)).max() <= 1 and (got == want).mean() > 0.99
        # sentence-transformers' encode(precision=...) calibrates on the texts it encodes: calibrate on them too
        emb.calibrate(texts)
        got = emb.encode(texts, precision=precision)
        np.testing.assert_array_equal(got, quantize_embeddings(emb.encode(texts), precision))
        want = st.encode(texts, precision=precision)
        assert got.dtype == want.dtype and np.abs(got.astype(int) - want.astype(int)).max() <= 1
        # each dimension's maximum sits exactly on the top bucket's edge: float rounding may move it one down
        assert (got == want).mean() > 0.95
    finally:
        emb.calibration = None


@pytest.mark.parametrize("fn", ["cosine", "dot"])
def test_similarity(pair, texts, fn):
    st, emb = pair
    st.similarity_fn_name, emb.similarity_fn_name = fn, fn
    try:
        a = emb.encode(texts[:6], normalize_embeddings=False)
        b = emb.encode(texts[6:10], normalize_embeddings=False)
        got, want = emb.similarity(a, b), st.similarity(a, b)
        assert isinstance(got, torch.Tensor) and got.shape == want.shape == (6, 4)
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)
        pw = emb.similarity_pairwise(a[:4], b)
        np.testing.assert_allclose(pw.numpy(), st.similarity_pairwise(a[:4], b).numpy(), atol=1e-5)
        np.testing.assert_allclose(emb.similarity(a[0], b[0]).numpy(), st.similarity(a[0], b[0]).numpy(), atol=1e-5)
    finally:
        st.similarity_fn_name, emb.similarity_fn_name = "cosine", "cosine"
