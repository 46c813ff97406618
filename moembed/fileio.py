"""Writing outputs atomically and durably (the readers of input files are `moembed.inputs`, re-exported here).

Every file moembed writes goes through `atomic_path` / `atomic_dir`: the data is written beside the target under a
hidden temporary name, flushed to disk (fsync of every file and directory written), and moved into place only when
complete; the parent directory is fsynced after the move. Guarantees:

- a process killed at any instant (SIGKILL, out of memory) leaves the target either as it was or complete with the
  new content, never half-written and never missing (when it existed before);
- after the function returns, the new content survives a power loss (as far as fsync holds on the filesystem);
- a write that fails (full disk, permissions, I/O error) raises a MoembedError naming the target, removes its
  temporary files and leaves the previous content untouched;
- outputs get the modes `open` and `mkdir` give under the process's umask: files 0666 and directories 0777 less
  the umask (0644 / 0755 under umask 022, 0600 / 0700 under 077), so a report or a model can be read by a web
  server or a server running as another user when the umask allows it. The temporary file or directory is created
  with those modes (`tempfile.mkstemp` / `mkdtemp` would give 0600 / 0700 whatever the umask), and whatever a
  writer left under it is set to them before the move (safetensors writes its files 0600).

Replacing a directory cannot be one `rename` (POSIX refuses to rename onto a non-empty directory). Where Linux's
renameat2(RENAME_EXCHANGE) works (ext4, xfs, btrfs, tmpfs, ...), the complete new directory and the old one swap
names in one atomic step, then the old one (now under the temporary name) is deleted: the target exists and is
complete at every instant, and readers need nothing special. Elsewhere (other systems, NFS) the old directory is
first renamed aside to `.NAME.old`, then the new one into place, then the aside deleted; a kill between the two
renames leaves only the aside, which `recover_dir` (called by `Embedder.load`, by checkpoint pruning and by the
next write to the same target) renames back. A versioned directory with a pointer file would avoid the recovery but
change the layout other tools (sentence-transformers, transformers) read.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import secrets
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from moembed.errors import MoembedError
from moembed.inputs import (  # noqa: F401 - re-exported: most commands import their readers from here
    iter_jsonl,
    json_kind,
    json_surrogate,
    open_input,
    parse_json_line,
    read_error,
    read_labelled_texts,
    read_text_lines,
    read_texts,
    read_yaml,
    surrogate_at,
    unicode_problem,
)

__all__ = ["atomic_dir", "atomic_path", "make_parent", "move_into_place", "recover_dir", "remove_dir", "write_jsonl",
           "iter_jsonl", "json_kind", "json_surrogate", "open_input", "parse_json_line", "read_error",
           "read_labelled_texts", "read_text_lines", "read_texts", "read_yaml", "surrogate_at", "unicode_problem"]

log = logging.getLogger("moembed")

# ---- durability primitives -----------------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY if os.name == "posix" else os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable. Not possible on Windows: there a no-op."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory bottom-up (a directory after its entries)."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_file(Path(dirpath, name))
        _fsync_dir(Path(dirpath))


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _load_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    except OSError:
        return None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names of two existing paths; False where the system or filesystem cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False  # not supported here: the caller falls back to rename-aside-then-swap
    raise OSError(err, os.strerror(err), str(b))


def _aside(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def recover_dir(target: str | os.PathLike) -> None:
    """Finish an interrupted directory replacement of `target` (rename-aside fallback; see the module docstring).

    If `target` is missing but its aside `.NAME.old` exists, a kill struck between the two renames: the aside is the
    complete previous content and is renamed back. If both exist, the new content landed and the aside is deleted.
    """
    target = Path(target)
    aside = _aside(target)
    if not aside.exists():
        return
    if target.exists():
        _remove_tree(aside)
    else:
        os.replace(aside, target)
        _fsync_dir(target.parent)


def _remove_tree(path: Path) -> None:
    """Delete a directory without ever leaving a half-deleted one under a visible name: rename it to a hidden
    temporary name first (one atomic step), then delete. A kill during the deletion leaves hidden litter only."""
    if not path.name.endswith(".tmp"):
        doomed = Path(tempfile.mkdtemp(prefix=f".{path.name.lstrip('.')}.", suffix=".del.tmp", dir=path.parent))
        os.replace(path, doomed)  # replaces the empty placeholder
        path = doomed
    shutil.rmtree(path, ignore_errors=True)


def remove_dir(path: str | os.PathLike) -> None:
    """Delete a directory so that it is either complete or gone at every instant (for pruning old outputs)."""
    path = Path(path)
    if path.exists():
        _remove_tree(path)
        _fsync_dir(path.parent)


def _replace_dir(tmp: Path, target: Path) -> None:
    """Move the complete directory `tmp` onto `target`, which is complete (old or new) at every instant."""
    if not target.exists():
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    elif _exchange(tmp, target):
        _fsync_dir(target.parent)  # the swap is durable before the old content (now under tmp's name) goes
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        aside = _aside(target)
        os.replace(target, aside)  # from here until the next rename, `recover_dir` restores the old content
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        _remove_tree(aside)


def _new_temp(parent: Path, name: str, directory: bool) -> Path:
    """Create a new hidden `.NAME.XXXXXXXX.tmp` file or directory in `parent`, mode 0666 / 0777 less the umask.

    The kernel applies the umask as for any `open` / `mkdir`, so nothing reads or changes the process's umask (which
    `os.umask` can only do by setting it, racing other threads). O_EXCL / mkdir refuse an existing name."""
    for _ in range(100):
        tmp = parent / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            if directory:
                os.mkdir(tmp, 0o777)
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary name", str(parent / f".{name}.*.tmp"))


def _apply_modes(root: Path, file_mode: int, dir_mode: int) -> None:
    """Set `root` (a file, or a directory and everything under it) to the modes the umask gives: files `file_mode`,
    directories `dir_mode` (read from the temporary file or directory, which was created under the umask). Special
    bits (a setgid directory's) are kept; symbolic links are left alone."""
    paths = [(root, root.is_dir())]
    if root.is_dir():
        for dirpath, dirs, files in os.walk(root):
            paths += [(Path(dirpath, d), True) for d in dirs] + [(Path(dirpath, f), False) for f in files]
    for path, is_dir in paths:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            continue
        want = dir_mode if is_dir else file_mode
        if stat.S_IMODE(st.st_mode) & 0o777 != want:
            os.chmod(path, (stat.S_IMODE(st.st_mode) & 0o7000) | want)


# ---- errors ------------------------------------------------------------------------------------------------------

# What writers raise when the disk fails them: OSError from Python, "I/O error: ... (os error N)" from safetensors,
# "[enforce fail at inline_container.cc] ..." or "PytorchStreamWriter failed ..." from torch.save.
_WRITER_FAILURES = ("I/O error", "os error", "inline_container", "PytorchStreamWriter", "file write failed")


def _write_error(target: Path, e: BaseException, free_at_failure: int | None, unchanged: bool) -> MoembedError | None:
    """A clear error for a failed write, or None when `e` is not a write failure (then it propagates as is)."""
    if isinstance(e, MoembedError) or not isinstance(e, Exception):
        return None
    if isinstance(e, OSError):
        detail, code = (f"{e.strerror}: {e.filename}" if e.filename and e.strerror else e.strerror or str(e)), e.errno
    elif any(s in str(e) for s in _WRITER_FAILURES):
        detail, code = f"{type(e).__name__}: {str(e)[:200]}", None
    else:
        return None
    full = code == errno.ENOSPC or "os error 28" in str(e) or (free_at_failure is not None and free_at_failure < 2**20)
    if full and code != errno.ENOSPC:
        detail = f"no space left on device ({detail})"
    kept = "; the previous content is unchanged" if unchanged else ""
    return MoembedError(f"{target}: cannot write ({detail}){kept}")


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


# ---- atomic outputs ----------------------------------------------------------------------------------------------


def make_parent(target: Path) -> None:
    """The one rule for an output whose directory is missing, for every command: the missing directories are
    created and one log line says so (a typo in a path then shows, and nothing fails late for want of a mkdir).
    A path component that exists but is not a directory is an error naming it."""
    parent = target.parent
    if parent.is_dir():
        return
    top = parent
    while not top.parent.is_dir() and top.parent != top:
        top = top.parent
    for p in (top, *top.parents):
        if p.exists() and not p.is_dir():
            raise MoembedError(f"{target}: cannot write ({p} is a file, not a directory)")
    parent.mkdir(parents=True, exist_ok=True)
    log.info("created directory %s (for %s)", top, target)


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `target` (an empty file, mode 0666 less the umask); on success fsync it and
    rename it onto `target` (then fsync the directory), on error delete it. A failed write raises MoembedError
    naming `target`; `target` is unchanged.
    """
    target = Path(target)
    try:
        make_parent(target)
        tmp = _new_temp(target.parent, target.name, directory=False)
    except OSError as e:
        raise _write_error(target, e, None, True) from None
    unchanged, mode = True, stat.S_IMODE(os.stat(tmp).st_mode)  # 0666 less the umask
    try:
        yield tmp
        _apply_modes(tmp, mode, mode)
        _fsync_file(tmp)
        unchanged = False
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException as e:
        failure = _write_error(target, e, _free_bytes(target.parent), unchanged)
        if failure is None:
            raise
        raise failure from e
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; on success it replaces `target` (old content removed). The
    directory and what is written into it get the process's umask (module docstring).

    Files and directories written are fsynced before the move; `target` is complete (old or new) at every instant
    (module docstring). A failed write raises MoembedError naming `target`; `target` is unchanged and the temporary
    directory is removed.
    """
    target = Path(target)
    try:
        make_parent(target)
        recover_dir(target)  # a replacement interrupted by a kill (rename-aside fallback)
        tmp = _new_temp(target.parent, target.name, directory=True)
    except OSError as e:
        raise _write_error(target, e, None, True) from None
    unchanged, mode = True, stat.S_IMODE(os.stat(tmp).st_mode) & 0o777  # 0777 less the umask
    try:
        yield tmp
        _apply_modes(tmp, mode & 0o666, mode)
        _fsync_tree(tmp)
        unchanged = False
        _replace_dir(tmp, target)
    except BaseException as e:
        failure = _write_error(target, e, _free_bytes(target.parent), unchanged)
        if failure is None:
            raise
        raise failure from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_into_place(src: str | os.PathLike, target: str | os.PathLike) -> None:
    """Move a complete file or directory `src` onto `target` (same filesystem) as `atomic_path` / `atomic_dir` end:
    `src` is fsynced, then renamed in one step (a directory replaces an existing one as in `atomic_dir`), then the
    directory entry is fsynced. For outputs built in place over a long run (a resumable partial state)."""
    src, target = Path(src), Path(target)
    try:
        if src.is_dir():
            recover_dir(target)
            _fsync_tree(src)
            _replace_dir(src, target)
        else:
            _fsync_file(src)
            os.replace(src, target)
            _fsync_dir(target.parent)
    except OSError as e:
        raise _write_error(target, e, _free_bytes(target.parent), False) from None


def write_jsonl(path: str | os.PathLike, records) -> int:
    """Write records as JSONL atomically; returns the count."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    return n
