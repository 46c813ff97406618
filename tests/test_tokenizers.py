"""Tokenizer training: three kinds, vocabulary padded to a multiple of 64, loadable by TextTokenizer, CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moembed.cli.main import app
from moembed.data.corpora import read_dataset
from moembed.data.tokenizers import SPECIAL_TOKENS, TokenizerConfig, train_tokenizer
from moembed.errors import MoembedError
from moembed.model.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "glosses.txt"
    lines = [p.document for _, p in zip(range(4000), read_dataset("wordnet"))]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram"])
def test_train_pad_and_load(tmp_path, corpus, kind):
    size = train_tokenizer([str(corpus)], TokenizerConfig(kind=kind, vocab_size=700), tmp_path / kind)
    assert size % 64 == 0 and 700 - 64 < size <= 768
    tok = TextTokenizer.from_dir(tmp_path / kind, max_length=16)
    assert tok.vocab_size == size and tok.pad_id == 0
    assert [tok.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    batch = tok(["a small domesticated animal", "the act of running quickly across an open field at dawn today"])
    ids = batch.input_ids.tolist()
    assert ids[0][0] == 2 and ids[0][batch.attention_mask[0].sum() - 1] == 3  # [CLS] ... [SEP]
    assert ids[0][-1] == 0 and batch.input_ids.shape[1] == 16 and batch.truncated == 1
    enc = tok.tokenizer.encode("a small domesticated animal")
    assert tok.tokenizer.decode(enc.ids).strip() == "a small domesticated animal"
    assert not any(t.startswith("[unused") for t in enc.tokens)
    pair = tok.tokenizer.encode("a dog", "an animal")
    assert pair.type_ids[-1] == 1 and pair.tokens.count("[SEP]") == 2
    meta = json.loads((tmp_path / kind / "tokenizer_config.json").read_text())
    assert meta["kind"] == kind and meta["vocab_size"] == size


def test_cli_tokenizer_train_reads_jsonl(tmp_path):
    data = tmp_path / "pairs.jsonl"
    pairs = [p for _, p in zip(range(1500), read_dataset("chatterbot-english"))]
    data.write_text("".join(json.dumps({"query": p.query, "document": p.document}) + "\n" for p in pairs))
    res = CliRunner().invoke(app, ["tokenizer", "train", "--kind", "wordpiece", "--vocab-size", "500",
                                   "--out", str(tmp_path / "tok"), str(data)])
    assert res.exit_code == 0, res.output
    tok = TextTokenizer.from_dir(tmp_path / "tok")
    assert tok.vocab_size % 64 == 0 and "you" in tok.tokenizer.get_vocab()


def test_tokenizer_errors(tmp_path):
    with pytest.raises(MoembedError, match="no such file"):
        train_tokenizer([str(tmp_path / "missing.txt")], TokenizerConfig(kind="bpe", vocab_size=100), tmp_path / "t")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"fine"\n[1, 2]\n')
    with pytest.raises(MoembedError, match=r"bad\.jsonl:2: expected a JSON string or object"):
        train_tokenizer([str(bad)], TokenizerConfig(kind="bpe", vocab_size=100), tmp_path / "t")
    assert not (tmp_path / "t").exists()
    with pytest.raises(ValueError, match="kind"):
        TokenizerConfig(kind="sentencepiece", vocab_size=100)
