"""Texts of a corpus read in fixed-size chunks, never the whole file at once: JSONL, plain text or Parquet.

    >>> inp = CorpusInput.open("docs.jsonl", field="text")
    >>> n = inp.scan()                                   # rows, every one checked; errors name file and line
    >>> for i, texts in inp.chunks(4096, wanted=lambda i: i % 2 == 0):
    ...     ...                                          # chunk i holds rows [4096·i, 4096·(i+1))

Formats (one row per text, in file order):
- jsonl: one JSON value per non-blank line: a string, or with `field` an object whose `field` is a string;
- text: one text per line, every line (an empty line is an empty text); a trailing newline ends the last line;
- parquet: the string column `column` (row groups are read batch by batch).

`scan` is the cheap first pass: it counts the rows and validates each one, so that a bad line fails before any
work is done and an output of known shape can be allocated. `chunks` is the second pass; chunks that are not
wanted (done before an interruption, or another rank's) are read but not decoded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from moembed.data.arrow_text import invalid_utf8_row
from moembed.errors import MoembedError
from moembed.fileio import json_kind, open_input, parse_json_line

FORMATS = ("auto", "jsonl", "text", "parquet")
_PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass(frozen=True)
class CorpusInput:
    """A corpus file and how to find its texts.

    format: "jsonl", "text" or "parquet"; field: JSONL key of the text (None: each line is a JSON string);
    column: Parquet column of the text.
    """

    path: Path
    format: str
    field: str | None = None
    column: str | None = None

    @classmethod
    def open(cls, path: str | os.PathLike, format: str = "auto", field: str | None = None,
             column: str | None = None) -> CorpusInput:
        """Check the combination of options; "auto" is parquet for .parquet / .pq files, else jsonl."""
        path = Path(path)
        if format not in FORMATS:
            raise MoembedError(f"--format: unknown {format!r}; choose one of {', '.join(FORMATS)}")
        if format == "auto":
            format = "parquet" if path.suffix.lower() in _PARQUET_SUFFIXES else "jsonl"
        if field is not None and format != "jsonl":
            raise MoembedError(f"--field: only for JSONL input; {path} is read as {format}")
        if format == "parquet" and column is None:
            raise MoembedError(f"--column: {path} is Parquet; name the column that holds the texts")
        if column is not None and format != "parquet":
            raise MoembedError(f"--column: only for Parquet input; {path} is read as {format}")
        open_input(path).close()  # a missing file, a directory or no permission: said now, in those words
        return cls(path, format, field, column)

    def describe(self) -> dict:
        """What identifies this input for a resumed run: the file (size, modification time) and how it is read."""
        st = self.path.stat()
        return {"path": str(self.path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "format": self.format, "field": self.field, "column": self.column}

    # ---- the two passes ----------------------------------------------------------------------------------------

    def scan(self) -> int:
        """The number of rows; every row is checked (bad rows raise, naming file and line or row)."""
        if self.format == "parquet":
            return self._scan_parquet()
        n = 0
        for line_no, raw in self._raw_rows():
            self._decode(line_no, raw)
            n += 1
        return n

    def chunks(self, chunk_rows: int, wanted: Callable[[int], bool] = lambda i: True) -> Iterator[tuple[int, list[str]]]:
        """(chunk index, texts) for each wanted chunk of `chunk_rows` rows, in order; the last may be shorter."""
        if self.format == "parquet":
            yield from self._parquet_chunks(chunk_rows, wanted)
            return
        i, rows = 0, []
        for row in self._raw_rows():
            rows.append(row)
            if len(rows) == chunk_rows:
                if wanted(i):
                    yield i, [self._decode(n, raw) for n, raw in rows]
                i, rows = i + 1, []
        if rows and wanted(i):
            yield i, [self._decode(n, raw) for n, raw in rows]

    def head(self, n: int) -> list[str]:
        """The first `n` texts (or all when fewer): calibration samples."""
        out: list[str] = []
        for _, texts in self.chunks(min(n, 65536)):
            out.extend(texts[: n - len(out)])
            if len(out) >= n:
                break
        return out

    # ---- line formats ------------------------------------------------------------------------------------------

    def _raw_rows(self) -> Iterator[tuple[int, bytes]]:
        """(line number, raw bytes without the newline) per row; JSONL skips blank lines."""
        with open_input(self.path) as fh:
            for line_no, raw in enumerate(fh, 1):
                raw = raw[:-1] if raw.endswith(b"\n") else raw
                if self.format == "jsonl" and not raw.strip():
                    continue
                yield line_no, raw

    def _decode(self, line_no: int, raw: bytes) -> str:
        where = f"{self.path}:{line_no}"
        if self.format == "text":
            try:  # strict UTF-8 refuses encoded surrogates too: a decoded line is valid Unicode
                return raw.decode("utf-8").rstrip("\r")
            except UnicodeDecodeError:
                raise MoembedError(f"{where}: not valid UTF-8") from None
        try:
            value = parse_json_line(raw)  # not UTF-8, not JSON, or a lone surrogate ("\\ud800") the tokenizer refuses
        except ValueError as e:
            raise MoembedError(f"{where}: {e}") from None
        if self.field is None:
            if not isinstance(value, str):  # records (the usual JSONL) are read with a field: say so
                hint = "; name the key of the text with --field KEY" if isinstance(value, dict) else ""
                raise MoembedError(f"{where}: expected a JSON string, got {json_kind(value)}{hint}")
            return value
        if not isinstance(value, dict):
            raise MoembedError(f"{where}: expected a JSON object with field {self.field!r}, got {type(value).__name__}")
        if self.field not in value:
            keys = ", ".join(sorted(value)) or "none"
            raise MoembedError(f"{where}: no field {self.field!r} (keys: {keys})")
        text = value[self.field]
        if not isinstance(text, str):
            raise MoembedError(f"{where}: field {self.field!r} is {type(text).__name__}, expected a string")
        return text

    # ---- Parquet -----------------------------------------------------------------------------------------------

    def _parquet(self):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self.path)
        except OSError as e:
            raise MoembedError(f"{self.path}: cannot read ({e.strerror or e})") from None
        except pa.ArrowException as e:
            raise MoembedError(f"{self.path}: not a Parquet file ({str(e)[:200]})") from None
        schema = pf.schema_arrow
        if self.column not in schema.names:
            raise MoembedError(f"{self.path}: no column {self.column!r} (columns: {', '.join(schema.names)})")
        kind = schema.field(self.column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or getattr(pa.types, "is_string_view", bool)(kind)):
            raise MoembedError(f"{self.path}: column {self.column!r} is {kind}, expected strings")
        return pf

    def _scan_parquet(self) -> int:
        pf, start = self._parquet(), 0
        for batch in pf.iter_batches(batch_size=65536, columns=[self.column]):
            col = batch.column(0)
            if col.null_count:
                first = next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
                raise MoembedError(f"{self.path}: row {start + first}: column {self.column!r} is null")
            bad = invalid_utf8_row(col)
            if bad is not None:
                raise MoembedError(f"{self.path}: row {start + bad}: column {self.column!r} is not valid UTF-8")
            start += len(col)
        return pf.metadata.num_rows

    def _parquet_chunks(self, chunk_rows: int, wanted: Callable[[int], bool]) -> Iterator[tuple[int, list[str]]]:
        import pyarrow as pa

        pf, i, pending = self._parquet(), 0, []  # pending: arrays that make up the next chunk
        have = 0
        for batch in pf.iter_batches(batch_size=chunk_rows, columns=[self.column]):
            col, off = batch.column(0), 0
            while off < len(col):
                take = min(chunk_rows - have, len(col) - off)
                pending.append(col.slice(off, take))
                have, off = have + take, off + take
                if have == chunk_rows:
                    if wanted(i):
                        yield i, pa.concat_arrays(pending).to_pylist()
                    i, pending, have = i + 1, [], 0
        if have and wanted(i):
            yield i, pa.concat_arrays(pending).to_pylist()

