"""Reading the input files moembed takes: JSONL (streamed), plain text lines and YAML.

Every reader names the file, and the line where one is known, in the MoembedError it raises: a directory or a
missing file, bytes that are not UTF-8, invalid JSON or YAML, a JSON string holding a lone surrogate (which JSON
can spell but UTF-8 and the tokenizers cannot take), or a value of the wrong kind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moembed.errors import MoembedError


def read_error(path: str | os.PathLike, e: OSError) -> MoembedError:
    """The error for an input that cannot be opened: a directory and a missing file are named as such."""
    path = Path(path)
    if isinstance(e, IsADirectoryError) or path.is_dir():
        return MoembedError(f"{path}: cannot read (is a directory, not a file)")
    if isinstance(e, FileNotFoundError):
        return MoembedError(f"{path}: cannot read (no such file)")
    return MoembedError(f"{path}: cannot read ({e.strerror or e})")


def open_input(path: str | os.PathLike):
    """An input file opened for binary reading; a directory, a missing file or no permission is a MoembedError."""
    try:
        if Path(path).is_dir():
            raise IsADirectoryError(path)
        return open(path, "rb")
    except OSError as e:
        raise read_error(path, e) from None


def read_text_lines(path: str | os.PathLike) -> list[str]:
    """All lines of a UTF-8 text file (without newlines); errors name the file and line."""
    path = Path(path)
    with open_input(path) as fh:
        raw = fh.read()
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out = []
    for i, line in enumerate(lines, 1):
        try:
            out.append(line.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError:
            raise MoembedError(f"{path}:{i}: not valid UTF-8") from None
    return out


def surrogate_at(text: str) -> int | None:
    """The index of the first lone surrogate (U+D800..U+DFFF) in `text`, or None. JSON can spell one ("\\ud800")
    and Python holds it, but UTF-8 cannot encode it and tokenizers refuse it, so text is checked where it enters."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def unicode_problem(text: str, at: int) -> str:
    return f"not valid Unicode (lone surrogate U+{ord(text[at]):04X} at character {at})"


def json_surrogate(value: Any) -> str | None:
    """What is wrong when a parsed JSON value holds a lone surrogate in any string (key or value), else None."""
    if isinstance(value, str):
        at = surrogate_at(value)
        return None if at is None else unicode_problem(value, at)
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        items = value
    else:
        return None
    for item in items:
        problem = json_surrogate(item)
        if problem is not None:
            return problem
    return None


def parse_json_line(raw: bytes) -> Any:
    """One JSONL line (bytes) → its value; ValueError with what is wrong (not UTF-8, invalid JSON, a lone
    surrogate). Lone surrogates can only come from `\\uD8xx`-`\\uDFxx` escapes (raw ones are not UTF-8), so only lines
    with such an escape are searched: other lines cost one substring test."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg})") from None
    if b"\\ud" in raw or b"\\uD" in raw:
        problem = json_surrogate(value)
        if problem is not None:
            raise ValueError(problem)
    return value


def iter_jsonl(path: str | os.PathLike, skip_bad: bool = False, bad: list | None = None) -> Iterator[tuple[int, Any]]:
    """Yield (line_number, parsed_value) for each non-blank line of a JSONL file, streaming.

    A line that is not valid UTF-8, JSON or Unicode (a lone surrogate) raises MoembedError naming file and line;
    with `skip_bad` it is skipped and its line number appended to `bad` (when given) instead.
    """
    path = Path(path)
    with open_input(path) as fh:
        for i, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                value = parse_json_line(raw)
            except ValueError as e:
                if not skip_bad:
                    raise MoembedError(f"{path}:{i}: {e}") from None
                if bad is not None:
                    bad.append(i)
                continue
            yield i, value


def json_kind(value) -> str:
    """How an error names a JSON value that is not what it wanted: an object by its keys, else by its type."""
    if isinstance(value, dict):
        return f"an object (keys: {', '.join(sorted(value)) or 'none'})"
    return type(value).__name__


def read_texts(path: str | os.PathLike, plain: bool = False) -> list[str]:
    """Texts to embed: one JSON string per line, or with `plain` one raw text per line."""
    if plain:
        return read_text_lines(path)
    texts = []
    for i, value in iter_jsonl(path):
        if not isinstance(value, str):
            raise MoembedError(f"{path}:{i}: expected a JSON string, got {json_kind(value)}; this command reads one "
                               "JSON string per line, or plain text lines with --plain")
        texts.append(value)
    return texts


def read_labelled_texts(path: str | os.PathLike, key: str, flag: str) -> tuple[list[str], list[str]]:
    """Texts and their labels from one JSON object per line, {"text": ..., key: ...} (the labels as strings);
    `flag` names the option that asked for `key` in the error."""
    texts, labels = [], []
    for i, r in iter_jsonl(path):
        if not isinstance(r, dict) or not isinstance(r.get("text"), str) or key not in r:
            raise MoembedError(f'{path}:{i}: {flag} {key}: expected an object with a string "text" and a "{key}"')
        texts.append(r["text"])
        labels.append(str(r[key]))
    return texts, labels


def read_yaml(path: str | os.PathLike) -> Any:
    """Parse a YAML file (empty → {}); errors name the file and, when known, the line."""
    import yaml

    try:
        with open_input(path) as fh:
            doc = yaml.safe_load(fh.read().decode("utf-8"))
    except UnicodeDecodeError:
        raise MoembedError(f"{path}: not valid UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise MoembedError(f"{path}{line}: invalid YAML") from None
    return {} if doc is None else doc
