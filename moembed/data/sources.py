"""Streaming readers of training records: JSONL, Parquet (one row group at a time) and `datasets` saved to disk.

A reader yields records one at a time from a resumable position, wrapping around at the end of the file
(a new epoch), so files larger than memory are never loaded whole. Records come in blocks of `shuffle_block`
consecutive records, each block in an order seeded by (training seed, source, epoch, block), so files sorted
by topic do not give batches of near-duplicates; the state holds the block's start and the position in it.
`PairSource` turns records into `Example(query, document, negatives)` with the source's field names and
prefixes; `TextSource` yields raw text for MLM.

Bad input: a record that is not valid UTF-8, JSON or Unicode (a lone surrogate such as "\\ud800"), is not an
object, lacks a field, or has a field of the wrong type stops the run with `file:line` (Parquet: `file:row N`);
with `skip_bad` it is counted in `stats.bad` instead. A record whose query or document is empty (after stripping
whitespace) is dropped and counted in `stats.empty`. `moembed.data.check` finds all of these in every file
before training starts.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moembed.data.config import SourceConfig
from moembed.errors import MoembedError
from moembed.data.arrow_text import INVALID_UTF8, rows_or_invalid
from moembed.fileio import open_input, parse_json_line


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


class BadRecord(Exception):
    """A record that cannot be used; its message names the location and what is wrong."""


# ---- raw readers: (location, value) in seeded blocks, with a small resumable position ----------------------------


def block_order(seed: int, label: str, epoch: int, block: int, n: int) -> list[int]:
    """The order in which the `n` records of one block are emitted: a permutation seeded by a stable hash of
    (training seed, source label, epoch, block index), so every rank and every resumed run derives the same one
    (Python's `hash()` is salted per process and would not)."""
    key = hashlib.sha256(json.dumps([seed, label, epoch, block]).encode()).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(key[:16], "little")))
    return rng.permutation(n).tolist()


class _BlockReader:
    """Records in blocks of `shuffle_block` consecutive records, each block in its `block_order`; blocks follow
    each other in file order and the reader wraps around at the end of the file (a new epoch).

    Only one block of raw records is held in memory. The state is the block's start position in the file
    (reader-specific keys), the epoch, the block index and how many records of the block were emitted (`pos`);
    `load_state` re-reads that block and re-derives its order, so a resumed reader continues exactly.
    `shuffle_block: 0` reads in file order through the same code with the identity order.

    Subclasses implement `_read_block(start) -> (items, end)` (up to `block_size` (location, raw) pairs from
    `start`, in file order, and the position after them; no items at the end of the file), `_decode`, and the
    conversion of a start position to and from state keys.
    """

    # File order still reads in chunks (with the identity order) so both modes share one code path and state
    # layout; 1,024 keeps the re-read on resume negligible.
    _FILE_ORDER_CHUNK = 1024
    _origin: Any  # start position of the file

    def __init__(self, path: Path, shuffle_block: int, seed: int, label: str):
        self.path, self.shuffle_block, self.seed, self.label = path, shuffle_block, seed, label
        self.block_size = shuffle_block or self._FILE_ORDER_CHUNK
        self.start: Any = self._origin
        self.epoch, self.block, self.pos = 0, 0, 0
        self._items: list[tuple[str, Any]] | None = None  # the current block, in file order
        self._end: Any = None  # position after the current block
        self._order: list[int] = []

    # reader-specific
    def _read_block(self, start: Any) -> tuple[list[tuple[str, Any]], Any]:
        raise NotImplementedError

    def _decode(self, where: str, raw: Any) -> Any:
        return raw

    def _start_state(self) -> dict:
        raise NotImplementedError

    def _start_from_state(self, s: dict) -> Any:
        raise NotImplementedError

    # shared
    def _load_block(self) -> None:
        items, end = self._read_block(self.start)
        if not items:  # past the last record: a new epoch
            self.start, self.epoch, self.block, self.pos = self._origin, self.epoch + 1, 0, 0
            items, end = self._read_block(self.start)
            if not items:
                raise MoembedError(f"{self.path}: no records")
        self._items, self._end = items, end
        if self.shuffle_block:
            self._order = block_order(self.seed, self.label, self.epoch, self.block, len(items))
        else:
            self._order = list(range(len(items)))

    def next(self) -> tuple[str, Any]:
        """(location, value) of the next record; a record that cannot be decoded raises BadRecord (after the
        position has moved past it, so `skip_bad` continues with the next one)."""
        if self._items is None:
            self._load_block()
        if self.pos >= len(self._items):
            self.start, self.block, self.pos = self._end, self.block + 1, 0
            self._load_block()
        where, raw = self._items[self._order[self.pos]]
        self.pos += 1
        return where, self._decode(where, raw)

    def scan(self, bad: Callable[[str], None] | None = None) -> Iterator[tuple[str, Any]]:
        """Every record once, in file order, one block in memory at a time: (location, value). For passes over
        a whole file (checking, counting, splitting); does not move the training position. A record that cannot
        be decoded raises MoembedError naming its location, or with `bad` is passed to it (the message) instead."""
        start = self._origin
        while True:
            items, start = self._read_block(start)
            if not items:
                return
            for where, raw in items:
                try:
                    yield where, self._decode(where, raw)
                except BadRecord as e:
                    if bad is None:
                        raise MoembedError(str(e)) from None
                    bad(str(e))

    def field_names(self) -> list[str] | None:
        """The fields every record has (a table's columns), or None when records may differ (JSONL)."""
        return None

    def state(self) -> dict:
        return {**self._start_state(), "epoch": self.epoch, "block": self.block, "pos": self.pos,
                "shuffle_block": self.shuffle_block}

    def load_state(self, s: dict) -> None:
        """Restore a `state()`. A state without `pos` comes from a checkpoint written before block shuffling:
        its position is that of the next record in file order, so reading continues from exactly that record
        (in blocks from there on). With a different `shuffle_block` than when saved, the saved block is read
        again from its start: some records of it may be seen twice, none is skipped."""
        self.start = self._start_from_state(s)
        self.epoch = int(s["epoch"])
        self.block, self.pos = int(s.get("block", 0)), int(s.get("pos", 0))
        if s.get("shuffle_block", self.shuffle_block) != self.shuffle_block:
            self.pos = 0
        self._items = None


class JsonlReader(_BlockReader):
    """Lines of a JSONL file. A block is kept as raw lines and parsed when emitted, so errors name the record's
    true line. Position: byte offset and line number of the block's first line (resume seeks there and re-reads
    one block)."""

    _origin = (0, 0)

    def __init__(self, path: Path, shuffle_block: int = 0, seed: int = 0, label: str = ""):
        super().__init__(path, shuffle_block, seed, label)
        self._fh = None

    def count(self) -> int:
        with open_input(self.path) as fh:
            return sum(1 for raw in fh if raw.strip())

    def _read_block(self, start: tuple[int, int]) -> tuple[list[tuple[str, bytes]], tuple[int, int]]:
        offset, line = start
        if self._fh is None:
            self._fh = open_input(self.path)
        self._fh.seek(offset)
        items = []
        while len(items) < self.block_size:
            raw = self._fh.readline()
            if not raw:
                break
            line += 1
            if raw.strip():
                items.append((f"{self.path}:{line}", raw))
        return items, (self._fh.tell(), line)

    def _decode(self, where: str, raw: bytes) -> Any:
        try:
            return parse_json_line(raw)  # not UTF-8, not JSON, or a lone surrogate the tokenizer would refuse
        except ValueError as e:
            raise BadRecord(f"{where}: {e}") from None

    def _start_state(self) -> dict:
        return {"offset": self.start[0], "line": self.start[1]}

    def _start_from_state(self, s: dict) -> tuple[int, int]:
        return int(s["offset"]), int(s["line"])


class ParquetReader(_BlockReader):
    """Rows of a Parquet file. In memory: one row group (as Arrow) and one block (as Python objects).
    Position: row group and row of the block's first row."""

    _origin = 0  # global row index

    def __init__(self, path: Path, columns: list[str], shuffle_block: int = 0, seed: int = 0, label: str = ""):
        import pyarrow.parquet as pq

        try:
            self.file = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError on corrupt files
            raise MoembedError(f"{path}: cannot read Parquet ({e})") from None
        super().__init__(path, shuffle_block, seed, label)
        names = set(self.file.schema_arrow.names)
        self.columns = [c for c in columns if c in names]
        self._starts = [0]  # global index of each row group's first row
        for i in range(self.file.num_row_groups):
            self._starts.append(self._starts[-1] + self.file.metadata.row_group(i).num_rows)
        self._group: tuple[int, Any] | None = None  # (index, Arrow table) of the last row group read

    def count(self) -> int:
        return self.file.metadata.num_rows

    def field_names(self) -> list[str]:
        return list(self.file.schema_arrow.names)

    def _table(self, g: int):
        if self._group is None or self._group[0] != g:
            self._group = (g, self.file.read_row_group(g, columns=self.columns))
        return self._group[1]

    def _read_block(self, start: int) -> tuple[list[tuple[str, Any]], int]:
        end = min(start + self.block_size, self.count())
        rows: list[Any] = []
        g = bisect.bisect_right(self._starts, start) - 1
        while start + len(rows) < end:  # the block may span row groups
            lo = start + len(rows) - self._starts[g]
            part = self._table(g).slice(lo, end - start - len(rows))
            try:
                rows.extend(part.to_pylist())
            except UnicodeDecodeError:  # Parquet does not enforce UTF-8: find the rows, refuse them one by one
                rows.extend(rows_or_invalid(part))
            g += 1
        return [(f"{self.path}:row {start + i + 1}", r) for i, r in enumerate(rows)], end

    def _decode(self, where: str, raw: Any) -> Any:
        if raw is INVALID_UTF8:
            raise BadRecord(f"{where}: not valid UTF-8")
        return raw

    def _start_state(self) -> dict:
        g = min(bisect.bisect_right(self._starts, self.start) - 1, max(self.file.num_row_groups - 1, 0))
        return {"group": g, "row": self.start - self._starts[g]}

    def _start_from_state(self, s: dict) -> int:
        group, row = int(s["group"]), int(s["row"])
        if not 0 <= group < len(self._starts):
            raise ValueError(f"row group {group} out of range")
        return self._starts[group] + row


class HFDiskReader(_BlockReader):
    """Rows of a Hugging Face `datasets.Dataset` saved with `save_to_disk` (memory-mapped Arrow): a block is
    only a range of indices, rows are fetched when emitted. Position: index of the block's first row."""

    _origin = 0

    def __init__(self, path: Path, shuffle_block: int = 0, seed: int = 0, label: str = ""):
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
        super().__init__(path, shuffle_block, seed, label)

    def count(self) -> int:
        return len(self.ds)

    def field_names(self) -> list[str]:
        return list(self.ds.column_names)

    def _read_block(self, start: int) -> tuple[list[tuple[str, int]], int]:
        end = min(start + self.block_size, len(self.ds))
        return [(f"{self.path}:row {i + 1}", i) for i in range(start, end)], end

    def _decode(self, where: str, raw: int) -> Any:
        try:
            return self.ds[raw]
        except UnicodeDecodeError:  # Arrow strings are not checked for UTF-8 on write
            raise BadRecord(f"{where}: not valid UTF-8") from None

    def _start_state(self) -> dict:
        return {"index": self.start}

    def _start_from_state(self, s: dict) -> int:
        return int(s["index"])


def open_reader(cfg: SourceConfig, columns: list[str], seed: int = 0) -> _BlockReader:
    """The reader of a source; `seed` (the training seed) and the source's label seed its block orders."""
    path = Path(cfg.path)
    if not path.exists():
        raise MoembedError(f"{path}: no such file or directory (data source {cfg.label!r})")
    if path.is_dir() != (cfg.format == "hf-disk"):
        what = "a directory; a `datasets` save_to_disk directory is read with format: hf-disk" if path.is_dir() \
            else f"not a directory; format {cfg.format} reads a `datasets` save_to_disk directory"
        raise MoembedError(f"{path}: is {what} (data source {cfg.label!r})")
    block = (cfg.shuffle_block, seed, cfg.label)
    if cfg.format == "jsonl":
        return JsonlReader(path, *block)
    if cfg.format == "parquet":
        return ParquetReader(path, columns, *block)
    return HFDiskReader(path, *block)


# ---- typed sources --------------------------------------------------------------------------------------------


def _text(record: dict, key: str, where: str, required: bool = True) -> str | None:
    if key not in record or record[key] is None:
        if required:
            raise BadRecord(f"{where}: missing field {key!r}")
        return None
    value = record[key]
    if not isinstance(value, str):
        raise BadRecord(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


class _Source:
    def __init__(self, cfg: SourceConfig, stats: SourceStats, skip_bad: bool, columns: list[str], seed: int):
        self.cfg, self.stats, self.skip_bad = cfg, stats, skip_bad
        self.name = cfg.label
        self.reader = open_reader(cfg, columns, seed)
        self.size = cfg.size or self.reader.count()
        if self.size == 0:
            raise MoembedError(f"{cfg.path}: no records (data source {self.name!r})")

    @staticmethod
    def parse(cfg: SourceConfig, value: Any, where: str):
        """The item of one decoded record; None when it is empty; BadRecord when it is malformed. Static, so that
        a whole file can be checked before training without opening it as a source (moembed.data.check)."""
        raise NotImplementedError

    def next(self):
        """The next usable item; malformed records raise (or are counted), empty ones are counted."""
        for _ in range(10 * self.size + 10):
            try:
                where, value = self.reader.next()
                item = self.parse(self.cfg, value, where)
            except BadRecord as e:
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
        try:
            self.reader.load_state(s)
        except (KeyError, TypeError, ValueError) as e:
            raise MoembedError(f"data source {self.name!r} ({self.cfg.path}): cannot restore the reader position "
                               f"{s!r} from the checkpoint ({type(e).__name__}: {e})") from None


class PairSource(_Source):
    """Records → Example(prefix + query, prefix + document, [prefix + negative, ...])."""

    def __init__(self, cfg: SourceConfig, stats: SourceStats, skip_bad: bool = False, seed: int = 0):
        super().__init__(cfg, stats, skip_bad, self.columns(cfg), seed)

    @staticmethod
    def columns(cfg: SourceConfig) -> list[str]:
        return [cfg.query_field, cfg.document_field] + ([cfg.negatives_field] if cfg.negatives_field else [])

    @staticmethod
    def parse(c: SourceConfig, value: Any, where: str) -> Example | None:
        if not isinstance(value, dict):
            raise BadRecord(f"{where}: expected an object, got {type(value).__name__}")
        q, d = _text(value, c.query_field, where), _text(value, c.document_field, where)
        negs: list[str] = []
        if c.negatives_field and value.get(c.negatives_field) is not None:
            raw = value[c.negatives_field]
            if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
                raise BadRecord(f"{where}: field {c.negatives_field!r} must be a list of strings")
            negs = [c.document_prefix + n for n in raw if n.strip()]
        if not q.strip() or not d.strip():
            return None
        return Example(c.query_prefix + q, c.document_prefix + d, negs)


class TextSource(_Source):
    """Raw text for MLM: a record's `text_field`, or the record itself when it is a JSON string."""

    def __init__(self, cfg: SourceConfig, stats: SourceStats, skip_bad: bool = False, seed: int = 0):
        super().__init__(cfg, stats, skip_bad, self.columns(cfg), seed)

    @staticmethod
    def columns(cfg: SourceConfig) -> list[str]:
        return [cfg.text_field]

    @staticmethod
    def parse(c: SourceConfig, value: Any, where: str) -> str | None:
        if isinstance(value, str):
            text = value
        elif isinstance(value, dict):
            text = _text(value, c.text_field, where)
        else:
            raise BadRecord(f"{where}: expected a string or an object, got {type(value).__name__}")
        return text if text.strip() else None
