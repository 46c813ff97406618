"""The default dev suite: small task directories built from the installed real corpora, held-out splits only.

- retrieval-<name>: the held-out `test/` BEIR split of every real-data builder (`moembed.data.corpora`);
- rerank-gcide: the GCIDE test queries, each with its relevant definitions and 9 other test-split definitions;
- classify-chatterbot-lang / cluster-chatterbot-lang: chatterbot-corpus utterances labelled with their
  language (the Latin-script languages with the most text), logistic regression / k-means;
- pairs-freedict-deu-eng: FreeDict German→English translations (label 1) vs the same words with a shuffled
  translation (label 0).
All texts come from the data module's readers; nothing is downloaded. The whole suite is ~10k short texts:
a few minutes on a laptop CPU for a MiniLM-sized model.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import defaultdict
from pathlib import Path

from moembed.fileio import atomic_dir, write_jsonl

SUITE_VERSION = 1
LATIN_LANGS = ("en", "es", "it", "pt", "nl", "id", "tr", "de", "sv", "fr")


def _retrieval(name: str, work: Path, out: Path, seed: int) -> None:
    from moembed.data.corpora import build_dataset

    build_dataset(name, work / name, seed=seed, max_pairs=2000)
    shutil.copytree(work / name / "test", out / f"retrieval-{name}")
    (out / f"retrieval-{name}" / "task.json").write_text(json.dumps({"type": "retrieval", "name": f"retrieval-{name}"}))


def _reranking(src: Path, out: Path, seed: int, n_queries: int = 100, n_neg: int = 9) -> None:
    """Candidate lists from a retrieval test split: the relevant documents plus random other split documents."""
    from moembed.eval.registry import load_task

    data = load_task(src).data
    rng = random.Random(seed)
    doc_ids = sorted(data["corpus"])
    rows = []
    for qid in sorted(data["qrels"])[:n_queries]:
        pos = [d for d, g in data["qrels"][qid].items() if g > 0]
        neg = rng.sample([d for d in doc_ids if d not in pos], n_neg)
        rows.append({"query": data["queries"][qid], "positive": [data["corpus"][d] for d in pos],
                     "negative": [data["corpus"][d] for d in neg]})
    write_jsonl(out / "test.jsonl", rows)


def _chatterbot_lang(out: Path, seed: int, per_lang: int = 40) -> None:
    """Language-labelled utterances: classification (train/test halves) and clustering (all)."""
    from moembed.data.readers import read_chatterbot

    by_lang: dict[str, set[str]] = defaultdict(set)
    for p in read_chatterbot():
        if p.lang in LATIN_LANGS and len(p.query.split()) >= 3:
            by_lang[p.lang].add(p.query)
    rng = random.Random(seed)
    train, test = [], []
    for lang in LATIN_LANGS:
        texts = sorted(by_lang[lang])
        rng.shuffle(texts)
        texts = texts[: 2 * per_lang]
        half = len(texts) // 2
        train += [{"text": t, "label": lang} for t in texts[:half]]
        test += [{"text": t, "label": lang} for t in texts[half:]]
    cls, clu = out / "classify-chatterbot-lang", out / "cluster-chatterbot-lang"
    write_jsonl(cls / "train.jsonl", train)
    write_jsonl(cls / "test.jsonl", test)
    write_jsonl(clu / "test.jsonl", test)
    (clu / "task.json").write_text(json.dumps({"type": "clustering", "name": "cluster-chatterbot-lang"}))


def _freedict_pairs(out: Path, seed: int, n: int = 300) -> None:
    """True translation pairs vs the same source words with another entry's translation."""
    from moembed.data.readers import read_freedict

    seen, pairs = set(), []
    for p in read_freedict("freedict-deu-eng"):
        if p.query.lower() not in seen and p.query.lower() != p.document.lower():
            seen.add(p.query.lower())
            pairs.append((p.query, p.document))
    rng = random.Random(seed)
    rng.shuffle(pairs)
    pos, neg = pairs[:n], pairs[n : 2 * n]
    shifted = [neg[(i + 1) % len(neg)][1] for i in range(len(neg))]  # a derangement: never the true translation
    rows = [{"sentence1": a, "sentence2": b, "label": 1} for a, b in pos]
    rows += [{"sentence1": a, "sentence2": b, "label": 0} for (a, _), b in zip(neg, shifted)]
    rng.shuffle(rows)
    write_jsonl(out / "test.jsonl", rows)


def build_suite(out_dir: str | Path, seed: int = 0, datasets: list[str] | None = None) -> list[Path]:
    """Build (or reuse, when already built with the same version and seed) the dev suite; returns task dirs."""
    from moembed.data.corpora import DATASETS

    out_dir = Path(out_dir)
    names = list(datasets or DATASETS)
    stamp = {"suite_version": SUITE_VERSION, "seed": seed, "datasets": names}
    meta = out_dir / "suite.json"
    if meta.exists() and json.loads(meta.read_text()).get("stamp") == stamp:
        return [out_dir / t for t in json.loads(meta.read_text())["tasks"]]
    with atomic_dir(out_dir) as tmp:
        work = tmp / ".build"
        for name in names:
            _retrieval(name, work, tmp, seed)
        if "gcide" in names:
            _reranking(tmp / "retrieval-gcide", tmp / "rerank-gcide", seed)
        _chatterbot_lang(tmp, seed)
        _freedict_pairs(tmp / "pairs-freedict-deu-eng", seed)
        shutil.rmtree(work)
        tasks = sorted(p.name for p in tmp.iterdir() if p.is_dir())
        (tmp / "suite.json").write_text(json.dumps({"stamp": stamp, "tasks": tasks}, indent=2) + "\n")
    return [out_dir / t for t in tasks]
