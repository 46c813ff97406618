"""Texts for the int8 calibration sample stored with a model (`moembed.model.calibration`).

    training_sample(cfg.data, seed)   a trained model's own training texts: queries and documents (or MLM texts)
                                      drawn evenly from every source, with the sources' prefixes, by the run's seed
    builtin_sample()                  questions and answers of chatterbot-corpus (a dependency of moembed), every
                                      language, for conversions that have no training data
    ensure_calibration(emb)           the built-in sample, unless the model already has a calibration
"""

from __future__ import annotations

import logging
import math
import random

from moembed.data.config import SourceConfig
from moembed.data.readers import read_chatterbot
from moembed.data.sources import PairSource, SourceStats, TextSource
from moembed.model.calibration import SAMPLE_PAIRS, calibrate_roles

log = logging.getLogger("moembed")


def training_sample(sources: list[SourceConfig], seed: int, texts: bool = False,
                    pairs: int = SAMPLE_PAIRS) -> tuple[list[str], list[str]]:
    """(queries, documents) of about `pairs` records drawn evenly from `sources`, prefixes included; with `texts`
    (MLM data) no queries and twice as many texts as documents. Each source is read as training reads it (seeded
    blocks, the run's seed), from its start; malformed records are skipped. Deterministic for a seed."""
    per_source = math.ceil((2 * pairs if texts else pairs) / max(len(sources), 1))
    queries: list[str] = []
    documents: list[str] = []
    for cfg in sources:
        source = (TextSource if texts else PairSource)(cfg, SourceStats(), True, seed)
        for _ in range(min(per_source, source.size)):
            item = source.next()
            if texts:
                documents.append(item)
            else:
                queries.append(item.query)
                documents.append(item.document)
    return queries, documents


def builtin_sample(pairs: int = SAMPLE_PAIRS, seed: int = 0) -> tuple[list[str], list[str]]:
    """(questions, answers) of `pairs` conversation turns drawn by `seed` from chatterbot-corpus, every language
    (about 13,000 pairs in 28 languages): real short texts, installed with moembed."""
    turns = sorted({(p.query, p.document) for p in read_chatterbot() if p.query and p.document})
    chosen = random.Random(seed).sample(turns, min(pairs, len(turns)))
    return [q for q, _ in chosen], [d for _, d in chosen]


def ensure_calibration(emb) -> str:
    """Calibrate `emb` on the built-in sample unless it has a calibration (carried over by an exact conversion);
    says which for the command's log."""
    if emb.calibration is not None:
        return "int8 calibration carried over from the source model"
    queries, documents = builtin_sample()
    calibrate_roles(emb, queries, documents)
    return f"int8 calibration from {len(queries) + len(documents)} built-in chatterbot-corpus texts"
