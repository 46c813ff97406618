"""Train / dev / test splits that never share a document, and the BEIR layout for evaluation sets.

Pairs are grouped by document text, so every pair of a document lands in the same split (a title and a subtitle
of one article, or several questions with one answer, stay together). Document groups are shuffled with the seed
and dealt out: test first, then dev, then train. An evaluation corpus holds every document of its split — the
relevant documents of its sampled queries plus the rest as distractors.

BEIR task layout (Thakur et al., 2021), read by the evaluation code:
    corpus.jsonl    {"_id": "d0", "title": "", "text": "..."}
    queries.jsonl   {"_id": "q0", "text": "..."}
    qrels/test.tsv  query-id<TAB>corpus-id<TAB>score, with that header line
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from moembed.data.readers import Pair
from moembed.fileio import write_jsonl


class SplitConfig(BaseModel):
    """Sizes of the splits. Defaults keep a dataset small enough to train and evaluate on a laptop CPU."""

    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    max_pairs: int | None = Field(5000, ge=1)  # training pairs kept (None: all)
    eval_queries: int = Field(300, ge=1)  # queries per evaluation split (dev and test each)
    eval_docs: int = Field(1000, ge=1)  # documents per evaluation corpus, distractors included
    eval_fraction: float = Field(0.1, gt=0, lt=0.5)  # at most this share of documents per evaluation split


@dataclass
class Splits:
    train: list[Pair]
    dev: list[Pair]  # all pairs whose document is in dev (queries are sampled when written)
    test: list[Pair]
    counts: dict = field(default_factory=dict)


def clean_pairs(pairs: Iterable[Pair]) -> tuple[list[Pair], dict]:
    """Drop pairs with an empty query or document and exact duplicates; return the rest and the counts."""
    out, seen, empty, dup, total = [], set(), 0, 0, 0
    for p in pairs:
        total += 1
        if not p.query.strip() or not p.document.strip():
            empty += 1
            continue
        if p in seen:
            dup += 1
            continue
        seen.add(p)
        out.append(p)
    return out, {"read": total, "dropped_empty": empty, "dropped_duplicate": dup}


def split_pairs(pairs: Iterable[Pair], cfg: SplitConfig) -> Splits:
    """Deal document groups into test, dev and train; deterministic for a given input order and seed."""
    kept, counts = clean_pairs(pairs)
    groups: dict[str, list[Pair]] = {}
    for p in kept:
        groups.setdefault(p.document, []).append(p)
    docs = list(groups)
    rng = random.Random(cfg.seed)
    rng.shuffle(docs)
    n_eval = min(cfg.eval_docs, int(len(docs) * cfg.eval_fraction))
    test_docs, dev_docs, train_docs = docs[:n_eval], docs[n_eval : 2 * n_eval], docs[2 * n_eval :]
    train = [p for d in train_docs for p in groups[d]]
    rng.shuffle(train)
    counts["train_available"] = len(train)
    if cfg.max_pairs is not None:
        train = train[: cfg.max_pairs]
    counts["documents"] = {"train": len(train_docs), "dev": len(dev_docs), "test": len(test_docs)}

    def take(ds):
        return [p for d in ds for p in groups[d]]

    return Splits(train, take(dev_docs), take(test_docs), counts)


def write_beir(pairs: list[Pair], out: Path, max_queries: int, seed: int) -> dict:
    """Write one BEIR task directory from the pairs of a split; every split document is in the corpus.

    Queries are sampled (up to `max_queries`); a query's relevant documents are all split documents it was
    paired with. Returns {"queries", "corpus", "qrels"} counts.
    """
    doc_ids: dict[str, str] = {}
    for p in pairs:
        doc_ids.setdefault(p.document, f"d{len(doc_ids)}")
    relevant: dict[str, list[str]] = {}
    for p in pairs:
        rel = relevant.setdefault(p.query, [])
        if doc_ids[p.document] not in rel:
            rel.append(doc_ids[p.document])
    queries = list(relevant)
    random.Random(seed).shuffle(queries)
    queries = queries[:max_queries]
    write_jsonl(out / "corpus.jsonl", ({"_id": i, "title": "", "text": d} for d, i in doc_ids.items()))
    write_jsonl(out / "queries.jsonl", ({"_id": f"q{n}", "text": q} for n, q in enumerate(queries)))
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    lines = ["query-id\tcorpus-id\tscore"]
    lines += [f"q{n}\t{d}\t1" for n, q in enumerate(queries) for d in relevant[q]]
    (out / "qrels" / "test.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"queries": len(queries), "corpus": len(doc_ids), "qrels": len(lines) - 1}
