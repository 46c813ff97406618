"""Reading JSONL input and writing outputs atomically.

Every file moembed writes goes through `atomic_path` / `atomic_dir`: the data is written beside the target
under a temporary name and renamed into place only when complete, so an interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moembed.errors import MoembedError


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success rename it onto `target`, on error delete it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; on success it replaces `target` (old content removed)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def read_text_lines(path: str | os.PathLike) -> list[str]:
    """All lines of a UTF-8 text file (without newlines); errors name the file and line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise MoembedError(f"{path}: cannot read ({e.strerror or e})") from None
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


def iter_jsonl(path: str | os.PathLike, skip_bad: bool = False, bad: list | None = None) -> Iterator[tuple[int, Any]]:
    """Yield (line_number, parsed_value) for each non-blank line of a JSONL file, streaming.

    A line that is not valid UTF-8 or JSON raises MoembedError naming file and line; with `skip_bad` it is
    skipped and its line number appended to `bad` (when given) instead.
    """
    path = Path(path)
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise MoembedError(f"{path}: cannot read ({e.strerror or e})") from None
    with fh:
        for i, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                yield i, json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                if not skip_bad:
                    what = "not valid UTF-8" if isinstance(e, UnicodeDecodeError) else f"invalid JSON ({e.msg})"
                    raise MoembedError(f"{path}:{i}: {what}") from None
                if bad is not None:
                    bad.append(i)


def read_texts(path: str | os.PathLike, plain: bool = False) -> list[str]:
    """Texts to embed: one JSON string per line, or with `plain` one raw text per line."""
    if plain:
        return read_text_lines(path)
    texts = []
    for i, value in iter_jsonl(path):
        if not isinstance(value, str):
            raise MoembedError(f"{path}:{i}: expected a JSON string, got {type(value).__name__}")
        texts.append(value)
    return texts


def write_jsonl(path: str | os.PathLike, records) -> int:
    """Write records as JSONL atomically; returns the count."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_yaml(path: str | os.PathLike) -> Any:
    """Parse a YAML file (empty → {}); errors name the file and, when known, the line."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise MoembedError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise MoembedError(f"{path}: not valid UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise MoembedError(f"{path}{line}: invalid YAML") from None
    return {} if doc is None else doc
