"""Real training text for the training tests: question → answer pairs from the installed chatterbot corpus."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import yaml


def chatterbot_pairs(lang: str = "english") -> list[tuple[str, str]]:
    import chatterbot_corpus

    root = Path(os.path.dirname(chatterbot_corpus.__file__)) / "data" / lang
    pairs = []
    for f in sorted(root.glob("*.yml")):
        doc = yaml.safe_load(f.read_text(encoding="utf-8")) or {}
        for conv in doc.get("conversations") or []:
            if len(conv) >= 2 and isinstance(conv[0], str) and isinstance(conv[1], str):
                pairs.append((conv[0].strip(), conv[1].strip()))
    return [p for p in pairs if p[0] and p[1]]


def write_pairs(path: Path, pairs, negatives: int = 0, seed: int = 0) -> Path:
    """JSONL {"query", "document", "negatives"}: negatives are other answers of the corpus."""
    rng = random.Random(seed)
    answers = [a for _, a in pairs]
    with open(path, "w", encoding="utf-8") as fh:
        for q, a in pairs:
            rec = {"query": q, "document": a}
            if negatives:
                rec["negatives"] = [x for x in rng.sample(answers, negatives + 1) if x != a][:negatives]
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def write_texts(path: Path, texts) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts)
    return path
