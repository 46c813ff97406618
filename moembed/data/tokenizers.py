"""Train BPE, WordPiece or Unigram tokenizers with the `tokenizers` library, for MLM from scratch and MoVE.

    train_tokenizer(["corpus.txt"], TokenizerConfig(kind="wordpiece", vocab_size=8000), "tok/")

Every kind gets the BERT special tokens ([PAD] [UNK] [CLS] [SEP] [MASK], ids 0–4) and a BERT-style
post-processor: "[CLS] A [SEP]" and "[CLS] A [SEP] B [SEP]" with token types 0/1, so `TextTokenizer` and the
encoders use them unchanged. Pre-tokenization: WordPiece splits on whitespace and punctuation (BERT), BPE is
byte-level (no unknown tokens), Unigram uses SentencePiece's metaspace.

The vocabulary is padded up to a multiple of 64 (nomic-embed-v1 §4.1.2: matmuls over the embedding table run
faster) by appending filler special tokens "[unused0]", "[unused1]", ... that never occur in encoded text, as
BERT's own vocabulary does. The saved tokenizer.json therefore reports the padded size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from moembed.errors import MoembedError
from moembed.fileio import atomic_dir, iter_jsonl, read_text_lines
from moembed.model.config import pad_vocab

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


class TokenizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["bpe", "wordpiece", "unigram"]
    vocab_size: int = Field(..., ge=len(SPECIAL_TOKENS) + 1)
    multiple: int = Field(64, ge=1)
    lowercase: bool = True
    min_frequency: int = Field(2, ge=1)


def iter_training_text(paths: list[str]) -> Iterator[str]:
    """Lines of plain text files; for .jsonl files, JSON strings or the query/document/text fields of objects."""
    for path in paths:
        if not Path(path).exists():
            raise MoembedError(f"{path}: no such file")
        if not str(path).endswith(".jsonl"):
            yield from (line for line in read_text_lines(path) if line.strip())
            continue
        for line, row in iter_jsonl(path):
            if isinstance(row, str):
                yield row
            elif isinstance(row, dict):
                yield from (row[k] for k in ("query", "document", "text") if isinstance(row.get(k), str))
            else:
                raise MoembedError(f"{path}:{line}: expected a JSON string or object")


def _build(cfg: TokenizerConfig):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    norm = [normalizers.NFKC()] + ([normalizers.Lowercase(), normalizers.NFD(), normalizers.StripAccents()]
                                   if cfg.lowercase else [])
    if cfg.kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                            special_tokens=SPECIAL_TOKENS, show_progress=False)
    elif cfg.kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                      special_tokens=SPECIAL_TOKENS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=cfg.vocab_size, special_tokens=SPECIAL_TOKENS,
                                          unk_token="[UNK]", show_progress=False)
    tok.normalizer = normalizers.Sequence(norm)
    return tok, trainer


def _bert_template(tok) -> None:
    from tokenizers import processors

    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )


def pad_vocabulary(tok, multiple: int) -> int:
    """Append "[unusedN]" special tokens until the vocabulary size is a multiple of `multiple`; return it."""
    size = tok.get_vocab_size(with_added_tokens=True)
    target = pad_vocab(size, multiple)
    tok.add_special_tokens([f"[unused{i}]" for i in range(target - size)])
    return tok.get_vocab_size(with_added_tokens=True)


def train_tokenizer(paths: list[str], cfg: TokenizerConfig, out: str | Path) -> int:
    """Train on the files, pad, save OUT/tokenizer.json and OUT/tokenizer_config.json; return the vocab size."""
    tok, trainer = _build(cfg)
    texts = iter_training_text(paths)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() <= len(SPECIAL_TOKENS):
        raise MoembedError(f"{', '.join(paths)}: no training text")
    _bert_template(tok)
    size = pad_vocabulary(tok, cfg.multiple)
    with atomic_dir(out) as tmp:
        tok.save(str(tmp / "tokenizer.json"))
        meta = {"kind": cfg.kind, "do_lower_case": cfg.lowercase, "vocab_size": size, "pad_token": "[PAD]",
                "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
        (tmp / "tokenizer_config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return size
