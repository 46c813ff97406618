"""Streaming readers of training records: JSONL, Parquet (one row group at a time) and `datasets` saved to disk.

A reader yields records one at a time from a resumable position, wrapping around at the end of the file
(a new epoch), so files larger than memory are never loaded whole. `PairSource` turns records into
`Example(query, document, negatives)` with the source's field names and prefixes; `TextSource` yields raw
text for MLM.

Bad input: a record that is not an object, lacks a field, or has a field of the wrong type stops the run with
`file:line` (Parquet: `file:row N`); with `skip_bad` it is counted in `stats.bad` instead. A record whose query
or document is empty (after stripping whitespace) is dropped and counted in `stats.empty`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moembed.errors import MoembedError
from moembed.train.config import SourceConfig


@dataclass
class Example:
    query: str
    document: str
    negatives: list[str] = field(default_factory=list)


@dataclass
class SourceStats:
    """Per-source counts of records read, dropped as empty, and skipped as malformed."""

    read: Counter = field(default_factory=Counter)
    empty: Counter = field(default_factory=Counter)
    bad: Counter = field(default_factory=Counter)
    no_negatives: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {k: dict(getattr(self, k)) for k in ("read", "empty", "bad", "no_negatives")}


class _BadRecord(Exception):
    pass


# ---- raw readers: (location, value) with a resumable position --------------------------------------------------


class JsonlReader:
    """Lines of a JSONL file. Position: byte offset and line number (seek, no re-reading on resume)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset, self.line, self.epoch = 0, 0, 0
        self._fh = None

    def count(self) -> int:
        with open(self.path, "rb") as fh:
            return sum(1 for raw in fh if raw.strip())

    def next(self) -> tuple[str, Any]:
        """(location, parsed JSON) of the next non-blank line; invalid JSON raises _BadRecord."""
        if self._fh is None:
            self._fh = open(self.path, "rb")
            self._fh.seek(self.offset)
        for _ in range(2):
            raw = self._fh.readline()
            while raw and not raw.strip():
                self.line += 1
                raw = self._fh.readline()
            if raw:
                break
            if self.line == 0:
                raise MoembedError(f"{self.path}: no records")
            self._fh.seek(0)
            self.offset, self.line, self.epoch = 0, 0, self.epoch + 1
        self.line += 1
        self.offset = self._fh.tell()
        where = f"{self.path}:{self.line}"
        try:
            return where, json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise _BadRecord(f"{where}: not valid UTF-8") from None
        except json.JSONDecodeError as e:
            raise _BadRecord(f"{where}: invalid JSON ({e.msg})") from None

    def state(self) -> dict:
        return {"offset": self.offset, "line": self.line, "epoch": self.epoch}

    def load_state(self, s: dict) -> None:
        self.offset, self.line, self.epoch = int(s["offset"]), int(s["line"]), int(s["epoch"])
        if self._fh is not None:
            self._fh.seek(self.offset)


class ParquetReader:
    """Rows of a Parquet file, one row group in memory at a time. Position: row group and row."""

    def __init__(self, path: Path, columns: list[str]):
        import pyarrow.parquet as pq

        try:
            self.file = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError on corrupt files
            raise MoembedError(f"{path}: cannot read Parquet ({e})") from None
        self.path = path
        names = set(self.file.schema_arrow.names)
        self.columns = [c for c in columns if c in names]
        self.group, self.row, self.epoch = 0, 0, 0
        self._rows: list[dict] | None = None
        self._starts = [0]
        for i in range(self.file.num_row_groups):
            self._starts.append(self._starts[-1] + self.file.metadata.row_group(i).num_rows)

    def count(self) -> int:
        return self.file.metadata.num_rows

    def next(self) -> tuple[str, Any]:
        if self.count() == 0:
            raise MoembedError(f"{self.path}: no records")
        while self._rows is None or self.row >= len(self._rows):
            if self._rows is not None:
                self.group, self.row = self.group + 1, 0
            if self.group >= self.file.num_row_groups:
                self.group, self.epoch = 0, self.epoch + 1
            self._rows = self.file.read_row_group(self.group, columns=self.columns).to_pylist()
        value = self._rows[self.row]
        where = f"{self.path}:row {self._starts[self.group] + self.row + 1}"
        self.row += 1
        return where, value

    def state(self) -> dict:
        return {"group": self.group, "row": self.row, "epoch": self.epoch}

    def load_state(self, s: dict) -> None:
        self.group, self.row, self.epoch = int(s["group"]), int(s["row"]), int(s["epoch"])
        self._rows = None
        if self.group < self.file.num_row_groups:
            self._rows = self.file.read_row_group(self.group, columns=self.columns).to_pylist()


class HFDiskReader:
    """Rows of a Hugging Face `datasets.Dataset` saved with `save_to_disk` (memory-mapped Arrow)."""

    def __init__(self, path: Path):
        try:
            import datasets
        except ImportError:
            raise MoembedError(f"{path}: format hf-disk needs the `datasets` package (pip install datasets)") from None
        try:
            self.ds = datasets.load_from_disk(str(path))
        except Exception as e:
            raise MoembedError(f"{path}: cannot read a saved dataset ({e})") from None
        if isinstance(self.ds, datasets.DatasetDict):
            raise MoembedError(f"{path}: is a DatasetDict; point `path` at one split's directory")
        self.path, self.index, self.epoch = path, 0, 0

    def count(self) -> int:
        return len(self.ds)

    def next(self) -> tuple[str, Any]:
        if len(self.ds) == 0:
            raise MoembedError(f"{self.path}: no records")
        if self.index >= len(self.ds):
            self.index, self.epoch = 0, self.epoch + 1
        value = self.ds[self.index]
        self.index += 1
        return f"{self.path}:row {self.index}", value

    def state(self) -> dict:
        return {"index": self.index, "epoch": self.epoch}

    def load_state(self, s: dict) -> None:
        self.index, self.epoch = int(s["index"]), int(s["epoch"])


def open_reader(cfg: SourceConfig, columns: list[str]):
    path = Path(cfg.path)
    if not path.exists():
        raise MoembedError(f"{path}: no such file or directory (data source {cfg.label!r})")
    if cfg.format == "jsonl":
        return JsonlReader(path)
    if cfg.format == "parquet":
        return ParquetReader(path, columns)
    return HFDiskReader(path)


# ---- typed sources --------------------------------------------------------------------------------------------


def _text(record: dict, key: str, where: str, required: bool = True) -> str | None:
    if key not in record or record[key] is None:
        if required:
            raise _BadRecord(f"{where}: missing field {key!r}")
        return None
    value = record[key]
    if not isinstance(value, str):
        raise _BadRecord(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


class _Source:
    def __init__(self, cfg: SourceConfig, stats: SourceStats, skip_bad: bool, columns: list[str]):
        self.cfg, self.stats, self.skip_bad = cfg, stats, skip_bad
        self.name = cfg.label
        self.reader = open_reader(cfg, columns)
        self.size = cfg.size or self.reader.count()
        if self.size == 0:
            raise MoembedError(f"{cfg.path}: no records (data source {self.name!r})")

    def _parse(self, value: Any, where: str):
        raise NotImplementedError

    def next(self):
        """The next usable item; malformed records raise (or are counted), empty ones are counted."""
        for _ in range(10 * self.size + 10):
            try:
                where, value = self.reader.next()
                item = self._parse(value, where)
            except _BadRecord as e:
                if not self.skip_bad:
                    raise MoembedError(str(e)) from None
                self.stats.bad[self.name] += 1
                continue
            self.stats.read[self.name] += 1
            if item is None:
                self.stats.empty[self.name] += 1
                continue
            return item
        raise MoembedError(f"{self.cfg.path}: no usable records (all empty or malformed)")

    def state(self) -> dict:
        return self.reader.state()

    def load_state(self, s: dict) -> None:
        self.reader.load_state(s)


class PairSource(_Source):
    """Records → Example(prefix + query, prefix + document, [prefix + negative, ...])."""

    def __init__(self, cfg: SourceConfig, stats: SourceStats, skip_bad: bool = False):
        cols = [cfg.query_field, cfg.document_field] + ([cfg.negatives_field] if cfg.negatives_field else [])
        super().__init__(cfg, stats, skip_bad, cols)

    def _parse(self, value: Any, where: str) -> Example | None:
        c = self.cfg
        if not isinstance(value, dict):
            raise _BadRecord(f"{where}: expected an object, got {type(value).__name__}")
        q, d = _text(value, c.query_field, where), _text(value, c.document_field, where)
        negs: list[str] = []
        if c.negatives_field and value.get(c.negatives_field) is not None:
            raw = value[c.negatives_field]
            if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
                raise _BadRecord(f"{where}: field {c.negatives_field!r} must be a list of strings")
            negs = [c.document_prefix + n for n in raw if n.strip()]
        if not q.strip() or not d.strip():
            return None
        return Example(c.query_prefix + q, c.document_prefix + d, negs)


class TextSource(_Source):
    """Raw text for MLM: a record's `text_field`, or the record itself when it is a JSON string."""

    def __init__(self, cfg: SourceConfig, stats: SourceStats, skip_bad: bool = False):
        super().__init__(cfg, stats, skip_bad, [cfg.text_field])

    def _parse(self, value: Any, where: str) -> str | None:
        if isinstance(value, str):
            text = value
        elif isinstance(value, dict):
            text = _text(value, self.cfg.text_field, where)
        else:
            raise _BadRecord(f"{where}: expected a string or an object, got {type(value).__name__}")
        return text if text.strip() else None
