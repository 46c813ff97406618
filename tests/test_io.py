"""Model directories: moembed round trip, sentence-transformers export, broken directories."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from moembed.errors import MoembedError
from moembed.model.embedder import Embedder
from moembed.model.io import export_sentence_transformers

TEXTS = ["a first sentence", "another, somewhat longer, sentence about routing", ""]


@pytest.mark.parametrize("family", ["bert", "nomic"])
def test_save_load_round_trip(make_tiny, tmp_path, family):
    emb = make_tiny(family)
    emb.calibrate(TEXTS)
    emb.save(tmp_path / "m")
    back = Embedder.load(tmp_path / "m")
    assert back.config == emb.config and back.prompts == emb.prompts and back.pooling == emb.pooling
    np.testing.assert_array_equal(back.encode(TEXTS), emb.encode(TEXTS))
    np.testing.assert_array_equal(back.encode(TEXTS, precision="int8"), emb.encode(TEXTS, precision="int8"))
    assert json.loads((tmp_path / "m" / "config.json").read_text())["format"] == "moembed"


@pytest.mark.real
def test_export_sentence_transformers_same_embeddings(minilm, tmp_path):
    from sentence_transformers import SentenceTransformer

    export_sentence_transformers(minilm, tmp_path / "st")
    st = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    a, b = st.encode(TEXTS), minilm.encode(TEXTS)
    assert (a * b).sum(1).min() >= 0.99999
    again = Embedder.load(tmp_path / "st")  # and it loads back through the sentence-transformers reader
    np.testing.assert_allclose(again.encode(TEXTS), b, atol=1e-6)


def test_export_tiny_bert_round_trip(make_tiny, tmp_path):
    emb = make_tiny("bert")
    export_sentence_transformers(emb, tmp_path / "st")
    np.testing.assert_allclose(Embedder.load(tmp_path / "st").encode(TEXTS), emb.encode(TEXTS), atol=1e-6)


def test_similarity_function_is_kept_and_exported(make_tiny, tmp_path):
    from sentence_transformers import SentenceTransformer

    emb = make_tiny("bert")
    emb.similarity_fn_name = "dot"
    emb.save(tmp_path / "m")
    assert Embedder.load(tmp_path / "m").similarity_fn_name == "dot"
    export_sentence_transformers(emb, tmp_path / "st")
    assert Embedder.load(tmp_path / "st").similarity_fn_name == "dot"
    st = SentenceTransformer(str(tmp_path / "st"), device="cpu", local_files_only=True)
    assert st.similarity_fn_name == "dot"
    assert Embedder.load(tmp_path / "st").similarity(st.encode(TEXTS), st.encode(TEXTS)).allclose(
        st.similarity(st.encode(TEXTS), st.encode(TEXTS)), atol=1e-5)


@pytest.fixture
def saved(make_tiny, tmp_path):
    make_tiny().save(tmp_path / "m")
    return tmp_path / "m"


def test_missing_weights(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(MoembedError, match="no model.safetensors"):
        Embedder.load(saved)


def test_corrupt_weights(saved):
    (saved / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(MoembedError, match="model.safetensors: cannot read weights"):
        Embedder.load(saved)


def test_corrupt_config(saved):
    (saved / "config.json").write_text("{not json")
    with pytest.raises(MoembedError, match="config.json: not valid JSON"):
        Embedder.load(saved)


def test_config_with_bad_key(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["encoder"]["num_heads"] = "many"
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MoembedError, match="encoder.num_heads"):
        Embedder.load(saved)


def test_missing_tokenizer(saved):
    (saved / "tokenizer.json").unlink()
    (saved / "vocab.txt").unlink(missing_ok=True)
    with pytest.raises(MoembedError, match="no tokenizer.json or vocab.txt"):
        Embedder.load(saved)


def test_weights_that_do_not_match_the_config(make_tiny, saved):
    shutil.copy(saved / "model.safetensors", saved.parent / "w")
    make_tiny(hidden_size=64, num_heads=4).save(saved)
    shutil.copy(saved.parent / "w", saved / "model.safetensors")
    with pytest.raises(MoembedError, match="has shape"):
        Embedder.load(saved)


def test_not_a_directory(tmp_path):
    with pytest.raises(MoembedError, match="nothing: no such directory; moembed reads models from local directories"):
        Embedder.load(tmp_path / "nothing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(MoembedError, match="not a model directory"):
        Embedder.load(tmp_path / "file")


def test_hub_name_says_how_to_get_a_local_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no such relative directory here
    with pytest.raises(MoembedError) as e:
        Embedder.load("sentence-transformers/all-MiniLM-L6-v2")
    msg = str(e.value)
    assert "looks like a Hugging Face Hub name" in msg and "local directories only" in msg
    assert "`hf download sentence-transformers/all-MiniLM-L6-v2 --local-dir DIR`" in msg  # huggingface_hub's CLI
    assert "SentenceTransformer('sentence-transformers/all-MiniLM-L6-v2').save('DIR')" in msg


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mpnet"}))
    with pytest.raises(MoembedError, match="'mpnet' is not supported"):
        Embedder.load(tmp_path)


def test_moe_or_rotary_models_are_not_exported_as_bert(make_tiny, tmp_path):
    # Rotary/SwiGLU encoders get moembed's own sentence-transformers module (tests/test_moe.py checks encode parity).
    export_sentence_transformers(make_tiny("nomic"), tmp_path / "st")
    modules = json.loads((tmp_path / "st" / "modules.json").read_text())
    assert modules[0]["type"] == "moembed.model.st_module.MoembedEncoder"
    assert json.loads((tmp_path / "st" / "config.json").read_text())["format"] == "moembed"


def test_loading_a_hugging_face_directory_imports_no_compiler_stack(make_tiny, tmp_path):
    # The shape check builds the encoder on the meta device; drawing its initial values there ran torch's Python
    # normal_, which imported torch._dynamo: 1.5 s of every `moembed encode` of a Hugging Face model.
    import subprocess
    import sys

    export_sentence_transformers(make_tiny("bert"), tmp_path / "st")
    code = ("import sys, torch\n"
            "before = 'torch._dynamo' in sys.modules\n"
            "from moembed.model.embedder import Embedder\n"
            f"Embedder.load({str(tmp_path / 'st')!r})\n"
            "print(before, 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"]
