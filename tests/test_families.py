"""Model families against transformers' own classes: for BERT, RoBERTa and XLM-RoBERTa, a tiny random model of the
real class saved with `save_pretrained` is read by `Embedder.load`; hidden states, mean-pooled embeddings and the
upcycled MoE model are compared with transformers, and sentence-transformers wrappers keep their settings."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from moembed.errors import MoembedError
from moembed.model.embedder import Embedder

FAMILIES = ["bert", "roberta", "xlm-roberta"]
TEXTS = ["a cat sat on the mat", "the quick brown fox jumps over the lazy dog, twice", "", "x"]
LETTERS = "abcdefghijklmnopqrstuvwxyz,."


def tiny_unigram(out) -> None:
    """An XLM-R-style Unigram tokenizer (<s>=0, <pad>=1, </s>=2, <unk>=3) over letters and a few words."""
    from moembed.model.convert.unigram_tokenizer import xlmr_unigram_tokenizer

    words = ["▁the", "▁a", "▁cat", "▁sat", "▁on", "▁mat", "▁fox", "▁dog", "▁over"]
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [(w, -2.0) for w in words] + [(c, -4.0) for c in LETTERS] + [("<mask>", 0.0)]
    tok = xlmr_unigram_tokenizer(pieces, {0x9: (0x20,)}, bos=0, eos=2, pad=1, unk=3, mask=len(pieces) - 1)
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "sep_token": "</s>",
               "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 64, **special}))
    (out / "special_tokens_map.json").write_text(json.dumps(special))


def save_tiny(family: str, out, minilm_path, seed: int = 0):
    """A tiny random model of transformers' class for `family`, saved with save_pretrained, plus a tokenizer."""
    import transformers as tf

    cls = {"bert": (tf.BertConfig, tf.BertModel), "roberta": (tf.RobertaConfig, tf.RobertaModel),
           "xlm-roberta": (tf.XLMRobertaConfig, tf.XLMRobertaModel)}[family]
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if family == "bert":  # the packaged MiniLM's WordPiece tokenizer
        cfg = cls[0](vocab_size=30522, max_position_embeddings=64, **shape)
    else:  # RoBERTa's conventions: pad 1, positions from pad + 1 (66 rows = 64 usable), one token type, eps 1e-5
        cfg = cls[0](vocab_size=64, max_position_embeddings=66, type_vocab_size=1, layer_norm_eps=1e-5,
                     pad_token_id=1, bos_token_id=0, eos_token_id=2, **shape)
    torch.manual_seed(seed)
    model = cls[1](cfg).eval()
    with torch.no_grad():  # LayerNorms and biases away from their 1/0 init, so a dropped one shows
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    if family == "bert":
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            if (minilm_path / f).exists():
                shutil.copy(minilm_path / f, out / f)
    else:
        tiny_unigram(out)
    return model


@pytest.fixture(params=FAMILIES)
def tiny(request, tmp_path, minilm_path):
    path = tmp_path / request.param
    model = save_tiny(request.param, path, minilm_path)
    return request.param, path, model


def batch(emb: Embedder, texts: list[str]) -> dict[str, torch.Tensor]:
    """moembed's own tokenisation, right-padded with the tokenizer's pad id (transformers' RoBERTa reads it)."""
    enc = emb.tokenizer.tokenizer.encode_batch(texts)
    T = max(len(e.ids) for e in enc)
    ids = torch.full((len(texts), T), emb.tokenizer.pad_id)
    mask = torch.zeros(len(texts), T, dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, :len(e.ids)], mask[i, :len(e.ids)] = torch.tensor(e.ids), 1
    return {"input_ids": ids, "attention_mask": mask}


def reference_mean(model, b) -> np.ndarray:
    with torch.no_grad():
        h = model(**b).last_hidden_state  # (B, T, d)
    m = b["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy()


def test_config_follows_the_family(tiny):
    family, path, model = tiny
    c = Embedder.load(path).config
    assert c.hf_model_type == family and c.vocab_size == model.config.vocab_size
    assert c.layer_norm_eps == model.config.layer_norm_eps and c.type_vocab_size == model.config.type_vocab_size
    # RoBERTa's table of 66 rows starts at padding_idx + 1 = 2: 64 usable positions
    assert c.max_position == 64 and c.pad_token_id == model.config.pad_token_id


def test_hidden_states_equal_transformers(tiny):
    family, path, model = tiny
    emb = Embedder.load(path)
    b = batch(emb, TEXTS)
    assert b["attention_mask"].sum(1).tolist()[2] == 2 and b["input_ids"].shape[1] > 10  # padding is exercised
    with torch.no_grad():
        want = model(**b).last_hidden_state
        got = emb.encoder(b["input_ids"], b["attention_mask"]).last_hidden_state
    mask = b["attention_mask"].bool()
    assert (want[mask] - got[mask]).abs().max().item() < 1e-5


def test_mean_pooled_embeddings_equal_transformers(tiny):
    family, path, model = tiny
    emb = Embedder.load(path)
    emb.pooling, emb.normalize = "mean", True
    cos = (emb.encode(TEXTS) * reference_mean(model, batch(emb, TEXTS))).sum(1)
    assert cos.min() >= 0.99999


def test_upcycling_reproduces_the_dense_embeddings(tiny):
    from moembed.model.convert.upcycle import upcycle

    family, path, _ = tiny
    dense = Embedder.load(path)
    moe = upcycle(dense, num_experts=4, top_k=2, every=2)
    assert moe.config.moe_layers() == [1] and moe.config.hf_model_type == family
    np.testing.assert_allclose(moe.encode(TEXTS), dense.encode(TEXTS), atol=1e-5)


def wrap_sentence_transformers(path, pooling: str, prompts: dict[str, str]) -> None:
    """modules.json (Transformer → Pooling → Normalize), a max length and prompts around a Hugging Face directory."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "2_Normalize").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean"}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 24, "do_lower_case": False}))
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_sentence_transformers_wrapper_keeps_pooling_and_prompts(tiny, pooling):
    from sentence_transformers import SentenceTransformer

    family, path, _ = tiny
    wrap_sentence_transformers(path, pooling, {"search_query": "query: "})
    emb = Embedder.load(path)
    assert (emb.pooling, emb.normalize, emb.max_length) == (pooling, True, 24)
    assert emb.prompts["search_query"] == "query: "
    st = SentenceTransformer(str(path), device="cpu")
    long = ["the cat " * 40]  # truncated at 24 tokens by both
    want = st.encode(TEXTS + long, prompt_name="search_query")
    np.testing.assert_allclose(emb.encode(TEXTS + long, prompt_name="search_query"), want, atol=1e-5)


def test_positions_table_smaller_than_the_offset(tmp_path, minilm_path):
    save_tiny("roberta", tmp_path, minilm_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 2}))
    with pytest.raises(MoembedError, match="config.json: max_position_embeddings 2 leaves no positions"):
        Embedder.load(tmp_path)


# ---- write-back: `moembed export MODEL --format huggingface` ----------------------------------------------------


def cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "moembed.cli.main", *map(str, args)], capture_output=True, text=True)


def test_export_huggingface_loads_without_moembed(tiny, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from moembed.model.io import export_huggingface

    family, path, model = tiny
    emb = Embedder.load(path)
    assert export_huggingface(emb, tmp_path / "hf") == family
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["max_position_embeddings"] == model.config.max_position_embeddings
    back = AutoModel.from_pretrained(tmp_path / "hf").eval()
    assert type(back) is type(model)
    b = batch(emb, TEXTS)
    with torch.no_grad():
        want, got = model(**b).last_hidden_state, back(**b).last_hidden_state
    mask = b["attention_mask"].bool()
    assert (want[mask] - got[mask]).abs().max().item() < 1e-5
    st = SentenceTransformer(str(tmp_path / "hf"), device="cpu")  # the tiny source's CLS pooling, no normalisation
    np.testing.assert_allclose(st.encode(TEXTS), emb.encode(TEXTS), atol=1e-5)
    again = Embedder.load(tmp_path / "hf")
    assert again.config == emb.config and again.pooling == emb.pooling
    np.testing.assert_allclose(again.encode(TEXTS), emb.encode(TEXTS), atol=1e-6)


def test_export_huggingface_cli_and_moe_refusal(tmp_path, minilm_path):
    from moembed.model.convert.upcycle import upcycle

    save_tiny("xlm-roberta", tmp_path / "src", minilm_path)
    r = cli("export", tmp_path / "src", "--format", "huggingface", "--out", tmp_path / "hf")
    assert r.returncode == 0 and "huggingface xlm-roberta" in r.stderr, r.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["XLMRobertaModel"]
    upcycle(Embedder.load(tmp_path / "src"), num_experts=4, top_k=2, every=2).save(tmp_path / "moe")
    r = cli("export", tmp_path / "moe", "--format", "huggingface", "--out", tmp_path / "moe-hf")
    assert r.returncode == 1 and "has no Hugging Face layout (MoE layers [2])" in r.stderr, r.stderr
    assert "--format sentence-transformers" in r.stderr and not (tmp_path / "moe-hf").exists()


def info_rows(path) -> dict[str, str]:
    r = cli("info", path)
    assert r.returncode == 0, r.stderr
    return dict(line.split("  ", 1) for line in r.stdout.splitlines())


def test_info_shows_family_positions_vocabulary_and_parameters(tmp_path, minilm_path):
    from moembed.model.convert.upcycle import upcycle

    model = save_tiny("xlm-roberta", tmp_path / "src", minilm_path)
    rows = {k.strip(): v.strip() for k, v in info_rows(tmp_path / "src").items()}
    assert rows["family"].startswith("xlm-roberta (bert-style layers, gelu MLP)")
    assert rows["positions"] == "absolute, 64 learned" and rows["vocabulary"] == "64"
    n = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("pooler"))  # moembed reads no pooler
    n -= 2 * 32  # the 2 position rows before padding_idx + 1 are not kept
    assert rows["parameters"] == f"{n:,} total, {n:,} active per token"
    dense = Embedder.load(tmp_path / "src")
    upcycle(dense, num_experts=4, top_k=2, every=2).save(tmp_path / "moe")
    rows = {k.strip(): v.strip() for k, v in info_rows(tmp_path / "moe").items()}
    mlp = 2 * 32 * 64 + 64 + 32  # fc1 + fc2 weights and biases of one expert
    total = n + 3 * mlp + 4 * 32  # three more experts and a 4-way router (no bias)
    assert rows["parameters"] == f"{total:,} total, {total - 2 * mlp:,} active per token"


def test_info_rotary_positions(make_tiny, tmp_path):
    make_tiny("nomic").save(tmp_path / "m")
    rows = {k.strip(): v.strip() for k, v in info_rows(tmp_path / "m").items()}
    assert rows["family"].startswith("moembed (nomic-style layers, swiglu MLP)")
    assert rows["positions"] == "rotary, base 10000, 64 trained, Dynamic NTK alpha 2 beyond"


# ---- bad input -----------------------------------------------------------------------------------------------------


def test_unsupported_model_type_names_file_type_and_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deberta-v2"}))
    with pytest.raises(MoembedError) as e:
        Embedder.load(tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'config.json'}: model_type 'deberta-v2' is not supported; supported: ")
    assert all(f in msg for f in FAMILIES)


@pytest.mark.parametrize(("key", "value", "tensor", "got", "want"), [
    ("hidden_size", 48, "embeddings.LayerNorm.bias", (32,), (48,)),  # the first tensor in the file
    ("intermediate_size", 80, "encoder.layer.0.intermediate.dense.bias", (64,), (80,)),
    ("max_position_embeddings", 34, "embeddings.position_embeddings.weight", (66, 32), (34, 32)),
])
def test_tensor_that_does_not_match_its_config(tmp_path, minilm_path, key, value, tensor, got, want):
    save_tiny("roberta", tmp_path, minilm_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value, "num_attention_heads": 4}))
    with pytest.raises(MoembedError) as e:
        Embedder.load(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'model.safetensors'}: tensor {tensor!r} has shape {got}, but "
                            f"{tmp_path / 'config.json'} implies {want}")
