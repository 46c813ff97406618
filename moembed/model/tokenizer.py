"""A thin wrapper over a `tokenizers.Tokenizer`: batch encoding with truncation counting and right padding."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from moembed.errors import MoembedError


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

    def encode_ids(self, texts: list[str]) -> tuple[list[list[int]], int]:
        """Token ids per text (with special tokens, truncated) and the number of truncated texts."""
        encs = self.tokenizer.encode_batch(texts)
        return [e.ids for e in encs], sum(1 for e in encs if e.overflowing)

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
