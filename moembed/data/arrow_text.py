"""Arrow strings that are not valid UTF-8: found by row, so that an error names the row instead of a bare
UnicodeDecodeError from the conversion to Python. Parquet and Arrow files do not enforce UTF-8: a writer may store
any bytes in a string column, encoded surrogates included."""

from __future__ import annotations

from typing import Any

INVALID_UTF8 = object()  # a row that Python cannot decode, in place of its dict (readers refuse it, naming it)


def rows_or_invalid(table) -> list[Any]:
    """The rows of an Arrow table as dicts, a row with a string that is not valid UTF-8 as `INVALID_UTF8`."""
    out = []
    for i in range(table.num_rows):
        try:
            out.append(table.slice(i, 1).to_pylist()[0])
        except UnicodeDecodeError:
            out.append(INVALID_UTF8)
    return out


def invalid_utf8_row(col) -> int | None:
    """The index of the first string of an Arrow string array that is not valid UTF-8, or None: Parquet does not
    enforce UTF-8 (a writer may store any bytes, encoded surrogates included), and Python's decoding would fail
    later with a bare UnicodeDecodeError."""
    import pyarrow as pa

    try:
        col.validate(full=True)
        return None
    except pa.ArrowInvalid:
        pass
    for i in range(len(col)):
        try:
            col[i].as_py()
        except UnicodeDecodeError:
            return i
    return None
