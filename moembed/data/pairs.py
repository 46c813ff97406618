"""Streaming a JSONL file of pairs in shards, with the bad-input rules of every curation job.

Each line must be a JSON object with string "query" and "document" fields (other fields are kept). A malformed
line raises MoembedError naming file and line, or with `skip_bad` is counted; pairs with an empty query or
document are dropped and counted. A row without "source" gets the file's stem, so a file is one source.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moembed.errors import MoembedError
from moembed.fileio import iter_jsonl


@dataclass
class ReadStats:
    bad_lines: list[int] = field(default_factory=list)
    dropped_empty: int = 0


def _check(path: Path, line: int, row) -> str | None:
    """None when the row is a valid pair, else what is wrong with it."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    for key in ("query", "document"):
        if key not in row:
            return f"missing key {key!r}"
        if not isinstance(row[key], str):
            return f"{key!r} must be a string, got {type(row[key]).__name__}"
    return None


def iter_pairs(path: str | Path, skip_bad: bool = False, stats: ReadStats | None = None) -> Iterator[dict]:
    """Valid, non-empty pair rows of a JSONL file, in order."""
    path = Path(path)
    stats = stats if stats is not None else ReadStats()
    for line, row in iter_jsonl(path, skip_bad=skip_bad, bad=stats.bad_lines):
        problem = _check(path, line, row)
        if problem is not None:
            if not skip_bad:
                raise MoembedError(f"{path}:{line}: {problem}")
            stats.bad_lines.append(line)
            continue
        if not row["query"].strip() or not row["document"].strip():
            stats.dropped_empty += 1
            continue
        row.setdefault("source", path.stem)
        yield row


def iter_shards(path: str | Path, shard_size: int, skip_bad: bool = False,
                stats: ReadStats | None = None) -> Iterator[list[dict]]:
    """Consecutive lists of up to `shard_size` valid rows."""
    shard: list[dict] = []
    for row in iter_pairs(path, skip_bad, stats):
        shard.append(row)
        if len(shard) == shard_size:
            yield shard
            shard = []
    if shard:
        yield shard
