"""The user's own pairs → training pairs per source and held-out dev/test sets, streamed, split by document.

    prepare_user_data(cfg, "OUT/data/user")   # cfg: QuickstartConfig with data.files set

Input: JSONL files, Parquet files or `datasets` directories (save_to_disk), read one block at a time by the
training readers (moembed.data.sources), never loaded whole. Each record needs a query and a document (field
names from `data.fields`); optional: a list of negatives, a source and a language. Each source — the record's
source (else the file's stem), with its language appended when given — is its own source for batching
(nomic-embed-v1 §4.2.2, arctic-embed-2 App. C).

Two passes over the files:
    1. check and count: every record is validated (not UTF-8, JSON or Unicode, a missing field: named by file,
       line and the fields found; all of them, the first 20 listed), exact duplicate (query, document) pairs
       are counted; a file with fewer distinct usable pairs than one training batch is refused here, before any
       model work;
    2. write: each document goes to test, dev or train by a seeded hash of its text, so every pair of one
       document lands in the same split and no document is shared across splits (as moembed.data.splits does
       for the built-in corpora, but without holding the corpus in memory). Training pairs go to
       train.jsonl (with their given negatives); dev and test pairs become BEIR task directories.

With `max_pairs`, the training pairs kept are the `max_pairs` with the smallest seeded pair hash — a uniform
sample that needs no shuffle of the file. Memory: the evaluation pairs (bounded by `eval_docs`) and one
8-byte hash per distinct pair and per document (duplicate detection and the split size).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moembed.data.check import MAX_LISTED, listing
from moembed.data.readers import Pair
from moembed.data.sources import HFDiskReader, JsonlReader, ParquetReader
from moembed.data.splits import write_beir
from moembed.errors import MoembedError
from moembed.fileio import atomic_dir

EVAL_FRACTION = 0.1  # at most this share of documents per evaluation split (dev and test each)


@dataclass
class Record:
    query: str
    document: str
    negatives: list[str]
    source: str


@dataclass
class FileCounts:
    read: int = 0
    empty: int = 0
    duplicate: int = 0
    usable: int = 0
    sources: Counter = field(default_factory=Counter)


def open_file(path: Path, columns: list[str]):
    """The streaming reader for one input: a directory is a `datasets` save, `.parquet` Parquet, else JSONL."""
    if not path.exists():
        raise MoembedError(f"--data: {path}: no such file or directory")
    if path.is_dir():
        if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
            raise MoembedError(f"--data: {path}: a directory must be a Hugging Face `datasets` save_to_disk directory")
        return HFDiskReader(path)
    if path.suffix in (".parquet", ".pq"):
        return ParquetReader(path, columns)
    return JsonlReader(path)


def _name(text: str) -> str:
    """A source name usable as a file name."""
    return re.sub(r"[^\w.-]+", "_", text.strip()).strip("._") or "source"


def iter_records(path: Path, fields, bad: Callable[[str], None] | None = None) -> Iterator[tuple[str, Record | None]]:
    """(location, record) for each record of one input; None for a record with an empty query or document.

    A record that cannot be decoded (not UTF-8, not JSON, a lone surrogate) or has a missing or mistyped field
    raises MoembedError naming the location and the fields the record has; with `bad`, the message is passed to
    it and the record skipped (the first pass collects them all)."""
    f = fields
    reader = open_file(path, [f.query, f.document, f.negatives, f.source, f.language])
    columns = reader.field_names()
    if columns is not None:
        missing = [n for n in (f.query, f.document) if n not in columns]
        if missing:
            raise MoembedError(f"--data: {path}: no field {', '.join(map(repr, missing))}; fields found: "
                               f"{', '.join(columns)} (name them with --fields query=...,document=...)")
    for where, row in reader.scan(None if bad is None else lambda e: bad(f"--data: {e}")):
        try:
            yield where, _record(path, fields, where, row)
        except MoembedError as e:
            if bad is None:
                raise
            bad(str(e))


def _record(path: Path, f, where: str, row) -> Record | None:
    if not isinstance(row, dict):
        raise MoembedError(f"--data: {where}: expected an object with fields {f.query!r} and {f.document!r}, "
                           f"got {type(row).__name__}")
    for key in (f.query, f.document):
        if row.get(key) is None:
            raise MoembedError(f"--data: {where}: missing field {key!r}; fields found: {', '.join(row) or 'none'} "
                               "(name them with --fields query=...,document=...)")
        if not isinstance(row[key], str):
            raise MoembedError(f"--data: {where}: field {key!r} must be a string, got {type(row[key]).__name__}")
    negs = row.get(f.negatives)
    if negs is not None and (not isinstance(negs, list) or not all(isinstance(n, str) for n in negs)):
        raise MoembedError(f"--data: {where}: field {f.negatives!r} must be a list of strings")
    q, d = " ".join(row[f.query].split()), " ".join(row[f.document].split())
    if not q or not d:
        return None
    source = str(row.get(f.source) or path.stem)
    if row.get(f.language):
        source += f".{row[f.language]}"
    return Record(q, d, [n for n in negs or [] if n.strip()], _name(source))


def _hash(seed: int, *texts: str) -> int:
    h = hashlib.blake2b(digest_size=8, key=seed.to_bytes(8, "little", signed=True))
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "little")


_SPAN = 2**64


def _scan(files: list[Path], fields, seed: int, min_pairs: int) -> tuple[dict[str, FileCounts], int]:
    """Pass 1: validate, count duplicates and usable pairs per file; the number of distinct documents."""
    counts: dict[str, FileCounts] = {}
    seen: set[int] = set()
    docs: set[int] = set()
    errors: list[str] = []
    total_bad = 0

    def bad(message: str) -> None:
        nonlocal total_bad
        total_bad += 1
        if len(errors) < MAX_LISTED:
            errors.append(message)

    for path in files:
        c = counts[str(path)] = FileCounts()
        for _, rec in iter_records(path, fields, bad):
            c.read += 1
            if rec is None:
                c.empty += 1
                continue
            key = _hash(seed, rec.query, rec.document)
            if key in seen:
                c.duplicate += 1
                continue
            seen.add(key)
            docs.add(_hash(seed, rec.document))
            c.usable += 1
            c.sources[rec.source] += 1
    if total_bad:  # every file read: all the malformed records at once, before any model work
        raise MoembedError(f"--data: {total_bad} malformed record(s):{listing(errors, total_bad)}")
    for path in files:
        c = counts[str(path)]
        if c.usable < min_pairs:
            raise MoembedError(f"--data: {path}: {c.usable} usable pairs ({c.read} records, {c.empty} empty, "
                               f"{c.duplicate} duplicates); at least one batch ({min_pairs}) is needed")
    return counts, len(docs)


def prepare_user_data(cfg, out_dir: str | Path) -> dict:
    """Write OUT/train.jsonl, OUT/dev, OUT/test (BEIR) and OUT/meta.json from `cfg.data.files`; return the counts."""
    files = [Path(p) for p in cfg.data.files]
    fields, seed = cfg.data.fields, cfg.seed
    sizes = cfg.split_sizes()
    counts, n_docs = _scan(files, fields, seed, cfg.train.batch_size)
    # Evaluation documents: a share of the corpus, capped so that evaluation stays affordable.
    n_eval = min(sizes["eval_docs"], int(n_docs * EVAL_FRACTION))
    if n_eval < 1:
        raise MoembedError(f"--data: {n_docs} distinct documents in all; too few to hold out a test split")
    cut = n_eval / n_docs * _SPAN

    def split(doc: str) -> str:
        u = _hash(seed + 1, doc)
        return "test" if u < cut else "dev" if u < 2 * cut else "train"

    threshold = _SPAN
    if sizes["max_pairs"] is not None:  # the max_pairs smallest pair hashes among the training pairs
        smallest = heapq.nsmallest(sizes["max_pairs"] + 1, (
            _hash(seed + 2, r.query, r.document) for r in _distinct(files, fields, seed) if split(r.document) == "train"))
        if len(smallest) > sizes["max_pairs"]:
            threshold = smallest[-1]

    evals: dict[str, list[Pair]] = {"dev": [], "test": []}
    train_sources: Counter = Counter()
    split_docs: dict[str, set[int]] = {"train": set(), "dev": set(), "test": set()}
    available = 0
    with atomic_dir(out_dir) as tmp, open(tmp / "train.jsonl", "w", encoding="utf-8") as fh:
        for r in _distinct(files, fields, seed):
            part = split(r.document)
            split_docs[part].add(_hash(seed, r.document))
            if part != "train":
                evals[part].append(Pair(r.query, r.document, r.source, ""))
                continue
            available += 1
            if _hash(seed + 2, r.query, r.document) >= threshold:
                continue
            row = {"query": r.query, "document": r.document, "source": r.source}
            if r.negatives:
                row["given_negatives"] = r.negatives
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            train_sources[r.source] += 1
        fh.close()
        meta = {
            "files": {k: {"read": c.read, "empty": c.empty, "duplicate": c.duplicate, "usable": c.usable,
                          "sources": dict(sorted(c.sources.items()))} for k, c in counts.items()},
            "documents": {k: len(v) for k, v in split_docs.items()},
            "pairs": {"train": sum(train_sources.values()), "train_available": available,
                      "dev": len(evals["dev"]), "test": len(evals["test"])},
            "duplicates": sum(c.duplicate for c in counts.values()),
            "train_sources": dict(sorted(train_sources.items())),
            "dev": write_beir(evals["dev"], tmp / "dev", sizes["eval_queries"], seed + 1),
            "test": write_beir(evals["test"], tmp / "test", sizes["eval_queries"], seed + 2),
        }
        meta["train"] = meta["pairs"]["train"]
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if not meta["test"]["queries"]:
        raise MoembedError(f"--data: {n_docs} distinct documents; too few to hold out a test split")
    if not meta["train"]:
        raise MoembedError("--data: no training pairs left after holding out the dev and test documents")
    return meta


def _distinct(files: list[Path], fields, seed: int) -> Iterator[Record]:
    """Pass 2 (and the max_pairs sample): the usable records, exact duplicates dropped, in file order."""
    seen: set[int] = set()
    for path in files:
        for _, rec in iter_records(path, fields):
            if rec is None:
                continue
            key = _hash(seed, rec.query, rec.document)
            if key not in seen:
                seen.add(key)
                yield rec


def task_name(cfg) -> str:
    """The user's test set's name in the report: data.name, the single file's stem, or "user-data"."""
    if cfg.data.name:
        return cfg.data.name
    return _name(Path(cfg.data.files[0]).stem) if len(cfg.data.files) == 1 else "user-data"
