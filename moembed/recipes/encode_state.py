"""The partial state of a corpus encode, beside its output: rows written in place, chunk by chunk, resumable.

    OUT.partial/
        meta.json           what the run is (input, model, settings, shape): a resumed run must match it
        calibration.npy     int8 ranges' sample, when the output is int8 (a resumed run reuses it)
        data.npy            .npy output (OUT ends in .npy): the full array, allocated at the start
        shards/             Parquet output: part-NNNNNN.parquet per chunk, columns id (input row) and embedding
        done-rR.log         the chunks rank R finished, one index per line, fsynced after each chunk

The directory appears in one step (`atomic_dir`), complete; from then on a chunk counts as done only after its
rows are on disk (fsync) and its index is in a log (fsync). A kill at any instant therefore leaves a state whose
logged chunks are all written: the next run writes the others. When every chunk is done the data is moved onto
OUT in one rename (`move_into_place`) and the state is deleted; OUT never exists half-written.

The .npy rows are written with `pwrite` at their offsets into the file created by `numpy.lib.format.open_memmap`,
not through a mapping kept open: pages of a mapping stay resident in the process (and count in its RSS) until the
kernel evicts them, so memory would grow with the output. Ranks of a multi-process run write disjoint rows of
the same file and append to their own logs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from moembed.errors import MoembedError
from moembed.fileio import atomic_dir, atomic_path, move_into_place, remove_dir

STATE_VERSION = 1


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


class PartialState:
    """An existing partial state directory (see the module docstring) and its meta.json."""

    def __init__(self, root: Path, meta: dict):
        self.root, self.meta = root, meta
        self.rows, self.width = int(meta["rows"]), int(meta["width"])
        self.dtype = np.dtype(meta["out_dtype"])
        self.chunk_rows = int(meta["chunk_rows"])
        self.parquet = meta["kind"] == "parquet"
        self.offset = 0 if self.parquet or not self.data.exists() else _header_length(self.data)

    @property
    def chunks(self) -> int:
        return -(-self.rows // self.chunk_rows)

    @property
    def data(self) -> Path:
        return self.root / ("shards" if self.parquet else "data.npy")

    # ---- creating and opening ----------------------------------------------------------------------------------

    @classmethod
    def create(cls, root: Path, meta: dict, calibration: np.ndarray | None) -> PartialState:
        """Write a new state (replacing nothing: the caller checked there is none) in one step."""
        meta = {"version": STATE_VERSION, **meta}
        with atomic_dir(root) as tmp:
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
            if calibration is not None:
                np.save(tmp / "calibration.npy", calibration)
            if meta["kind"] == "parquet":
                (tmp / "shards").mkdir()
            else:  # the header and a sparse file of the full size; rows are written later at their offsets
                mm = np.lib.format.open_memmap(tmp / "data.npy", mode="w+", dtype=np.dtype(meta["out_dtype"]),
                                               shape=(int(meta["rows"]), int(meta["width"])))
                del mm
        return cls(root, meta)

    @classmethod
    def open(cls, root: Path) -> PartialState | None:
        """The state at `root`, or None when there is none. A state left by a run that had already moved its data
        onto the output (killed while deleting the state) is removed and None returned."""
        if not root.exists():
            return None
        try:
            meta = json.loads((root / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = None
        if meta is None or meta.get("version") != STATE_VERSION or not (root / ("shards" if meta.get("kind") == "parquet" else "data.npy")).exists():
            remove_dir(root)
            return None
        return cls(root, meta)

    def check(self, meta: dict) -> None:
        """Raise unless this state was started with the same `meta` (input, model, settings)."""
        for key, value in meta.items():
            if self.meta.get(key) != value:
                raise MoembedError(
                    f"{self.root}: an interrupted run with other settings ({key}: was {self.meta.get(key)!r}, now "
                    f"{value!r}); run again with the same input and options to resume it, or delete {self.root} "
                    "to start over")

    def calibration(self) -> np.ndarray | None:
        path = self.root / "calibration.npy"
        return np.load(path, allow_pickle=False) if path.exists() else None

    # ---- progress ----------------------------------------------------------------------------------------------

    def done(self) -> set[int]:
        """Chunks finished by any rank of any run so far (complete lines of the logs only)."""
        out: set[int] = set()
        for log in self.root.glob("done-r*.log"):
            text = log.read_bytes().decode("ascii", errors="replace")
            for line in text.split("\n")[:-1]:  # the last piece has no newline: empty, or torn by a kill
                if line.isdigit():
                    out.add(int(line))
        return out

    def writer(self, rank: int) -> ChunkWriter:
        return ChunkWriter(self, rank)

    # ---- the end -----------------------------------------------------------------------------------------------

    def finish(self, out: Path) -> None:
        """Move the complete data onto `out` in one step, then delete the state. Raises when chunks are missing."""
        missing = sorted(set(range(self.chunks)) - self.done())
        if missing:
            raise MoembedError(f"{self.root}: {len(missing)} of {self.chunks} chunks are not done (first: {missing[0]}); "
                               "run the same command again to finish them")
        move_into_place(self.data, out)
        remove_dir(self.root)


class ChunkWriter:
    """Writes one rank's chunks into the state and logs each one, durably, after its rows."""

    def __init__(self, state: PartialState, rank: int):
        self.state = state
        log = state.root / f"done-r{rank}.log"
        if log.exists():  # cut a line torn by a kill, so that the next index starts on a line of its own
            raw = log.read_bytes()
            if raw and not raw.endswith(b"\n"):
                os.truncate(log, raw.rfind(b"\n") + 1)
        self.log = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.fd = None if state.parquet else os.open(state.data, os.O_WRONLY)

    def write(self, chunk: int, x: np.ndarray) -> None:
        """Rows of chunk `chunk`: x (n, width) of the state's dtype."""
        st = self.state
        start = chunk * st.chunk_rows
        if x.shape != (min(st.chunk_rows, st.rows - start), st.width) or x.dtype != st.dtype:
            raise AssertionError(f"chunk {chunk}: got {x.shape} {x.dtype}")
        if st.parquet:
            _write_shard(st.data / f"part-{chunk:06d}.parquet", start, x)
        else:
            data = np.ascontiguousarray(x).tobytes()
            at = st.offset + start * st.width * st.dtype.itemsize
            while data:  # pwrite may write less than asked
                n = os.pwrite(self.fd, data, at)
                data, at = data[n:], at + n
            os.fsync(self.fd)
        os.write(self.log, f"{chunk}\n".encode())
        os.fsync(self.log)

    def close(self) -> None:
        os.close(self.log)
        if self.fd is not None:
            os.close(self.fd)


def _header_length(path: Path) -> int:
    """Bytes before the first row of a .npy file."""
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(fh)
        return fh.tell()


def _write_shard(path: Path, start: int, x: np.ndarray) -> None:
    """One Parquet shard: id (int64, the input row) and embedding (fixed-size list of the output dtype)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = pa.array(np.arange(start, start + len(x), dtype=np.int64))
    emb = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(x).reshape(-1)), x.shape[1])  # (n·w,) → (n, w)
    with atomic_path(path) as tmp:
        pq.write_table(pa.table({"id": ids, "embedding": emb}), tmp)
