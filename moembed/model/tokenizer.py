"""A thin wrapper over a `tokenizers.Tokenizer`: batch encoding with truncation counting and right padding.

A text longer than the model can read is cut before the tokenizer sees it, exactly. The tokenizer normalises and
pre-tokenizes the whole string it is given before truncating, so without a cut a text of megabytes costs seconds
and gigabytes to keep 256 tokens (BENCHMARKS.md, "Long texts"). A text of more than `max_length × CUT_CHARS_PER_TOKEN`
characters is tokenized from a prefix of that many characters; the prefix's tokens are kept only when they
provably equal the whole text's: every kept token comes from a word (the tokenizer's pre-token) that ends at
least one whole word before the cut, so the cut, which can change only the word it falls in and the one before
it (a whitespace piece of a byte-level pre-tokenizer), changed none of them. Otherwise the prefix grows fourfold
and is tokenized again, up to the whole text. Embeddings are therefore bit-identical to tokenizing the whole
text. A text whose first kept tokens come from one word longer than the cut (a long run without spaces under a
SentencePiece tokenizer, a 10 MB "word") is still read whole: exactness comes first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from moembed.errors import MoembedError
from moembed.fileio import surrogate_at, unicode_problem

# Characters per token of the first cut: English averages about 4.5 characters per WordPiece token, code and
# numbers fewer; 16 leaves room for runs of spaces and long words, and a cut too short costs one retry.
CUT_CHARS_PER_TOKEN = 16
_GROWTH = 4  # a cut that is not provably exact grows fourfold: at most a third more work than the whole text


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) bool
    token_type_ids: torch.Tensor  # (B, T) long
    truncated: int  # how many texts were cut to max_length


class TextTokenizer:
    """Tokenizes text for an encoder. `max_length` counts special tokens."""

    def __init__(self, tokenizer: Tokenizer, max_length: int = 512, pad_id: int | None = None):
        self.tokenizer = tokenizer
        self.tokenizer.no_padding()
        self.max_length = max_length
        self.tokenizer.enable_truncation(max_length)
        if pad_id is None:
            pad_id = next((tokenizer.token_to_id(t) for t in ("[PAD]", "<pad>") if tokenizer.token_to_id(t) is not None), 0)
        self.pad_id = pad_id

    @classmethod
    def from_dir(cls, path: Path, max_length: int = 512) -> "TextTokenizer":
        """Read tokenizer.json, or build a WordPiece tokenizer from vocab.txt (older BERT directories)."""
        tj, vocab = path / "tokenizer.json", path / "vocab.txt"
        try:
            if tj.exists():
                tok = Tokenizer.from_file(str(tj))
            elif vocab.exists():
                from tokenizers.implementations import BertWordPieceTokenizer

                lower = True
                cfg = path / "tokenizer_config.json"
                if cfg.exists():
                    lower = bool(json.loads(cfg.read_text()).get("do_lower_case", True))
                tok = BertWordPieceTokenizer(str(vocab), lowercase=lower)._tokenizer
            else:
                raise MoembedError(f"{path}: no tokenizer.json or vocab.txt")
        except MoembedError:
            raise
        except Exception as e:  # tokenizers raises bare Exceptions on corrupt files
            raise MoembedError(f"{tj if tj.exists() else vocab}: cannot read tokenizer ({e})") from None
        return cls(tok, max_length)

    def set_max_length(self, max_length: int) -> None:
        self.max_length = max_length
        self.tokenizer.enable_truncation(max_length)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode_ids(self, texts: list[str], prefix: str = "") -> tuple[list[list[int]], int]:
        """Token ids of `prefix + text` per text (with special tokens, truncated) and the number of truncated
        texts. Long texts are cut first, exactly (module docstring)."""
        limit = self.max_length * CUT_CHARS_PER_TOKEN
        try:
            encs = self.tokenizer.encode_batch([prefix + (t if len(t) <= limit else t[:limit]) for t in texts])
        except Exception:
            check_unicode(texts, prefix)  # a lone surrogate: say which text; anything else propagates
            raise
        for i, t in enumerate(texts):
            if len(t) > limit:
                encs[i] = self._encode_long(prefix, t, limit, encs[i])
        return [e.ids for e in encs], sum(1 for e in encs if e.overflowing)

    def _encode_long(self, prefix: str, text: str, cut: int, enc):
        """The encoding of `prefix + text` from `enc`, that of `prefix + text[:cut]`, grown until exact."""
        while not _exact_cut(enc):
            # past a quarter of the text, the whole: the cuts tried before sum to less than a third of it
            cut = len(text) if _GROWTH * _GROWTH * cut > len(text) else _GROWTH * cut
            enc = self.tokenizer.encode(prefix + text[:cut])
            if cut == len(text):
                break
        return enc

    def pad(self, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad id lists → input_ids (B, T), attention_mask (B, T) bool.

        A text with no tokens at all (an empty string under a tokenizer without special tokens) gets one pad
        token that is attended to, so that every sequence pools over at least one position.
        """
        ids = [x if x else [self.pad_id] for x in ids]
        T = max((len(x) for x in ids), default=1) or 1
        input_ids = torch.full((len(ids), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), T), dtype=torch.bool)
        for i, x in enumerate(ids):
            input_ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            mask[i, : len(x)] = True
        return input_ids, mask

    def __call__(self, texts: list[str]) -> Batch:
        ids, truncated = self.encode_ids(texts)
        input_ids, mask = self.pad(ids)
        return Batch(input_ids, mask, torch.zeros_like(input_ids), truncated)

    def save(self, path: Path) -> None:
        self.tokenizer.save(str(path / "tokenizer.json"))


def _exact_cut(enc) -> bool:
    """Whether the kept tokens of a cut text's encoding are those of the whole text: it overflowed, and its last
    kept token belongs to a word at least two words before the last word of the cut text (word ids are those of
    the tokenizer's pre-tokens; a tokenizer without them gives None or one word, and never passes)."""
    if not enc.overflowing:
        return False
    kept = [w for w in enc.word_ids if w is not None]
    tail = [w for w in enc.overflowing[-1].word_ids if w is not None]
    return bool(kept and tail) and kept[-1] < tail[-1] - 1



def check_unicode(texts: list[str], prefix: str = "") -> None:
    """Raise MoembedError naming the first text that is not valid Unicode (a lone surrogate such as "\\ud800",
    which JSON can spell but UTF-8 cannot encode and the tokenizer refuses with a bare TypeError)."""
    for i, t in enumerate([prefix, *texts]):
        at = surrogate_at(t) if isinstance(t, str) else None
        if at is not None:
            what = "prompt prefix" if i == 0 else f"texts[{i - 1}]"
            raise MoembedError(f"{what}: {unicode_problem(t, at)}")
