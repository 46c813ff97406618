"""`include_prompt: false` (a prompt's tokens left out of the pooling) as sentence-transformers computes it: its
Pooling module on the same token states, and a MiniLM directory it saved, in Python, `moembed encode` and serve."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from moembed.errors import MoembedError
from moembed.model.embedder import Embedder
from moembed.model.io import export_sentence_transformers
from moembed.model.pooling import ST_POOLING, pool
from moembed.model.prompts import PromptIds, prompt_token_count

PROMPTS = {"search_query": "Represent this sentence for searching relevant passages: ", "search_document": "passage: "}
TEXTS = ["a cat sat on the mat", "the quick brown fox jumps over the lazy dog, twice", "", "x", "the cat " * 40]


def st_model(path, **kwargs):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", local_files_only=True, **kwargs)


@pytest.mark.parametrize("mode", list(ST_POOLING))
def test_pool_leaves_the_prompt_out_as_sentence_transformers_pooling(mode):
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    torch.manual_seed(0)
    lengths = torch.tensor([9, 4, 6, 3])  # the last sequence is no longer than the prompt
    padded = torch.randn(4, 9, 8)  # (B, T, d)
    mask = torch.arange(9) < lengths.unsqueeze(1)  # (B, T), right padding
    packed, batch_index = padded[mask], torch.arange(4).repeat_interleave(lengths)
    for p in (1, 3):
        want = Pooling(8, mode, include_prompt=False)(
            {"token_embeddings": padded, "attention_mask": mask.long(), "prompt_length": p})["sentence_embedding"]
        got = pool(packed, batch_index, lengths, ST_POOLING[mode], torch.full((4,), p))
        rows = slice(None) if p == 1 else slice(0, 3)  # nothing left to pool: ST's padded zeros / -inf not followed
        torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-6)
        if mode != "lasttoken":
            assert not torch.allclose(got[:3], pool(packed, batch_index, lengths, ST_POOLING[mode])[:3])


@pytest.mark.parametrize("mode", ["mean", "cls", "max", "weightedmean"])
def test_a_batch_mixing_prompt_lengths_pools_each_sequence_as_alone(mode):
    torch.manual_seed(1)
    lengths, skip = torch.tensor([5, 7, 2]), torch.tensor([2, 0, 1])
    packed, batch_index = torch.randn(14, 8), torch.arange(3).repeat_interleave(lengths)
    got = pool(packed, batch_index, lengths, mode, skip)
    for i, rows in enumerate(packed.split(lengths.tolist())):
        alone = pool(rows, torch.zeros(len(rows), dtype=torch.long), lengths[i:i + 1], mode, skip[i:i + 1])
        torch.testing.assert_close(got[i:i + 1], alone, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def st_dir(minilm_path, tmp_path_factory):
    """MiniLM saved by sentence-transformers with two prompts and include_prompt false in 1_Pooling/config.json."""
    st = st_model(minilm_path)
    st.prompts = dict(PROMPTS)
    st[1].include_prompt = False
    out = tmp_path_factory.mktemp("st") / "minilm-instr"
    st.save(str(out))
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["include_prompt"] is False
    return out


@pytest.mark.real
def test_directory_sentence_transformers_saved_encodes_as_it_in_python_cli_and_serve(st_dir, tmp_path):
    from moembed.serve.engine import EmbedderEngine

    st, emb = st_model(st_dir), Embedder.load(st_dir)
    assert emb.include_prompt is False
    assert emb.mark_prompt([[101, 1, 102]], PROMPTS["search_document"])[0].prompt_length == 3  # [CLS] passage :
    for name in ("search_query", "search_document"):
        want = st.encode(TEXTS, prompt_name=name)
        got = emb.encode(TEXTS, prompt_name=name)
        assert (got * want).sum(1).min() >= 0.99999, name
        # the prompt's tokens are left out: pooling them too gives other vectors
        assert (emb.derive(emb.encoder, include_prompt=True).encode(TEXTS, prompt_name=name) * want).sum(1).min() < 0.99
        # a text alone and in a batch with longer texts
        np.testing.assert_allclose(emb.encode(TEXTS[3], prompt_name=name), got[3], rtol=0, atol=1e-6)
    np.testing.assert_allclose(emb.encode(TEXTS), st.encode(TEXTS), atol=1e-6)  # no prompt: nothing left out
    # moembed encode
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TEXTS))
    r = subprocess.run([sys.executable, "-m", "moembed.cli.main", "encode", str(st_dir), str(tmp_path / "in.jsonl"),
                        "--out", str(tmp_path / "o.npy"), "--prompt", "search_query", "--device", "cpu"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    want = st.encode(TEXTS, prompt_name="search_query")
    assert (np.load(tmp_path / "o.npy") * want).sum(1).min() >= 0.99999
    # serve's engine: queries and documents in one forward pass, each pooled after its own prompt
    engine = EmbedderEngine.load(str(st_dir), device="cpu", dtype="float32")
    q, _ = engine.tokenize(TEXTS, "query")
    d, _ = engine.tokenize(TEXTS[:2], "document", truncate=False)
    got = engine.postprocess(engine.embed(q + d), None, "float32")
    assert (got[:len(TEXTS)] * want).sum(1).min() >= 0.99999
    assert (got[len(TEXTS):] * st.encode(TEXTS[:2], prompt_name="search_document")).sum(1).min() >= 0.99999


def test_include_prompt_is_kept_by_save_and_export(make_tiny, tmp_path):
    emb = make_tiny("bert").derive(make_tiny("bert").encoder, include_prompt=False, prompts=PROMPTS)
    emb.save(tmp_path / "m")
    back = Embedder.load(tmp_path / "m")
    assert back.include_prompt is False and back.settings_key() == emb.settings_key()
    assert emb.settings_key() != emb.derive(emb.encoder, include_prompt=True).settings_key()
    want = emb.encode(TEXTS, prompt_name="search_query")
    np.testing.assert_allclose(back.encode(TEXTS, prompt_name="search_query"), want, rtol=0, atol=1e-6)
    for i, text in enumerate(TEXTS):  # alone, as in a batch with longer texts
        np.testing.assert_allclose(emb.encode(text, prompt_name="search_query"), want[i], rtol=0, atol=1e-6)
    export_sentence_transformers(emb, tmp_path / "st")
    assert json.loads((tmp_path / "st" / "1_Pooling" / "config.json").read_text())["include_prompt"] is False
    assert Embedder.load(tmp_path / "st").include_prompt is False
    np.testing.assert_allclose(st_model(tmp_path / "st").encode(TEXTS, prompt_name="search_query"), want, atol=2e-5)


def test_moe_export_tells_sentence_transformers_the_prompt_length(make_tiny, tmp_path):
    """An encoder saved with moembed's own module: its preprocess gives the Pooling module the prompt's length."""
    emb = make_tiny("nomic").derive(make_tiny("nomic").encoder, include_prompt=False, prompts=PROMPTS)
    export_sentence_transformers(emb, tmp_path / "st")
    st = st_model(tmp_path / "st", trust_remote_code=True)
    want = emb.encode(TEXTS, prompt_name="search_document")
    np.testing.assert_allclose(st.encode(TEXTS, prompt_name="search_document"), want, atol=2e-5)


def test_prompt_token_count_is_sentence_transformers(minilm_path, st_dir):
    st, emb = st_model(st_dir), Embedder.load(minilm_path)
    for prompt in (*PROMPTS.values(), "x", "query:"):
        assert prompt_token_count(emb.tokenizer, prompt) == st[0]._get_prompt_length(prompt)
    assert prompt_token_count(emb.tokenizer, "") == 0
    emb.tokenizer.set_max_length(4)
    emb.include_prompt = False  # the tokenizer truncates the prompt too: one position, its [SEP], is left
    assert emb.token_ids(["a text"], "one two three four five")[0][0].prompt_length == 3
    assert isinstance(emb.token_ids(["a"], "x")[0][0], PromptIds)


def test_bad_include_prompt_names_the_file(make_tiny, tmp_path):
    export_sentence_transformers(make_tiny("bert"), tmp_path / "st")
    (tmp_path / "st" / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean",
                                                                           "include_prompt": "no"}))
    with pytest.raises(MoembedError, match=r"1_Pooling/config.json: include_prompt: expected true or false, got 'no'"):
        Embedder.load(tmp_path / "st")
