"""Corpus-scale encode: stream a file of texts through an Embedder into a .npy array or Parquet shards.

    >>> job = EncodeJob(model="path/to/model", input=CorpusInput.open("docs.jsonl", field="text"),
    ...                 out=Path("docs.npy"), prompt="search_document")
    >>> encode_corpus(job)        # under torchrun every rank calls it and encodes its share of the chunks

The input is read in chunks of `chunk_rows` texts (`corpus_input`); each chunk is tokenized, embedded in
length-sorted batches and post-processed exactly as `Embedder.encode` does, and its rows are written at their
input positions in a partial state beside the output (`encode_state`), which is moved onto the output when the
last chunk is done. Memory holds one chunk (texts, token ids, embeddings) and the model, whatever the number of
rows. An embedding does not depend on the other texts of its batch, so the output equals `Embedder.encode` of
the whole input up to float rounding (batches of other shapes: within 1e-6).

A run that is interrupted (kill, out of memory, power loss) resumes where it stopped when started again with the
same input and options: the chunks already logged are skipped. Under torchrun (`moembed encode --nproc N`), rank
R encodes chunks i with i % N == R, all ranks write into the same state, and rank 0 prepares and finishes it.

The Embedder is used through its lowest layer only: `Embedder.load(path, max_length=)`, `prefix(name)`,
`token_ids(texts, prefix)`, `embed_batches(ids, batch_size, amp)`, `postprocess(pooled, dim, precision)`,
`calibration`, `dim` and `settings_key()`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moembed import distributed as dist
from moembed.devices import INT8, resolve_device
from moembed.errors import MoembedError
from moembed.model.pooling import PRECISIONS, SCALAR
from moembed.progress import bar
from moembed.recipes.corpus_input import CorpusInput
from moembed.recipes.encode_state import PartialState, partial_dir

log = logging.getLogger("moembed")

DTYPES = ("float32", "bf16", INT8)  # compute precision: float32, bfloat16 autocast, dynamic int8 (CPU)
CALIBRATION_SAMPLES = 10_000  # texts whose embeddings set the int8 ranges (as Embedder.calibrate)


@dataclass(frozen=True)
class EncodeJob:
    """One corpus encode. out: a .npy file (one array) or a directory (Parquet shards: id, embedding).

    prompt: the model's prompt name (its prefix is prepended); dim: Matryoshka truncation; precision: output
    precision (moembed.model.pooling.PRECISIONS); dtype: compute precision (DTYPES); chunk_rows: texts read,
    embedded and written at a time (the unit of progress and of resumption); calibration: texts for int8 ranges
    (default: the first CALIBRATION_SAMPLES of the input); pooling: replaces the model's.
    """

    model: str
    input: CorpusInput
    out: Path
    prompt: str | None = None
    dim: int | None = None
    precision: str = "float32"
    dtype: str = "float32"
    max_length: int | None = None
    chunk_rows: int = 4096
    batch_size: int = 32
    device: str = "auto"
    calibration: CorpusInput | None = None
    pooling: str | None = None  # replaces the model's pooling (`Embedder.load(pooling=)`)
    backend: str = "auto"  # how inference runs (`Embedder.load(backend=)`, moembed.model.backends)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise MoembedError(f"--precision: unknown {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.dtype not in DTYPES:
            raise MoembedError(f"--dtype: unknown {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.chunk_rows < 1:
            raise MoembedError(f"--chunk-size: must be >= 1, got {self.chunk_rows}")
        if self.batch_size < 1:
            raise MoembedError(f"--batch-size: must be >= 1, got {self.batch_size}")
        if self.max_length is not None and self.max_length < 2:
            raise MoembedError(f"--max-length: must be >= 2, got {self.max_length}")
        if self.out.suffix not in (".npy", ""):
            raise MoembedError(f"--out: {self.out} must end in .npy (one array) or name a directory (Parquet shards)")

    @property
    def kind(self) -> str:
        return "npy" if self.out.suffix == ".npy" else "parquet"


def encode_corpus(job: EncodeJob, show_progress: bool = False) -> tuple[int, int, np.dtype]:
    """Run (or resume) the job in this process, or as one rank under torchrun; returns (rows, width, dtype).

    Joins torchrun's process group (gloo: it only synchronises) when there is one and leaves it at the end.
    """
    already = torch.distributed.is_available() and torch.distributed.is_initialized()
    joined = dist.init_from_env(backend="gloo") and not already
    rank, world = dist.rank(), dist.world_size()
    try:
        emb = load_model(job)
        state = prepare(job, emb) if rank == 0 else None
        dist.barrier()  # rank 0 has created or checked the state
        if state is None:
            state = PartialState.open(partial_dir(job.out))
            if state is None:
                raise MoembedError(f"{partial_dir(job.out)}: rank {rank} found no partial state")
            _use_calibration(emb, state)
        encode_chunks(job, emb, state, rank, world, show_progress and rank == 0)
        dist.barrier()  # every rank's chunks are on disk
        if rank == 0:
            state.finish(job.out)
        return state.rows, state.width, state.dtype
    finally:
        if joined:
            torch.distributed.destroy_process_group()


def load_model(job: EncodeJob):
    """The Embedder on this process's device (a bare "cuda" is the GPU of torchrun's LOCAL_RANK), checked
    against the job's dim and prompt, int8-quantised when asked."""
    from moembed.model.embedder import Embedder

    device = resolve_device(job.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", dist.local_rank())
    # int8 refused off the CPU before the weights are read (`resolve_dtype`)
    emb = Embedder.load(job.model, max_length=job.max_length, device=str(device),
                        dtype=INT8 if job.dtype == INT8 else "float32", pooling=job.pooling,
                        backend=job.backend)
    if job.dtype == INT8:
        from moembed.model.fast.int8 import int8_path

        log.info("int8 matmuls on %s", int8_path())
    if job.dim is not None and not 1 <= job.dim <= emb.dim:
        raise MoembedError(f"--dim: {job.dim} is out of range 1..{emb.dim}")
    emb.prefix(job.prompt)  # an unknown prompt name fails before any work
    return emb.to(device).eval()


def pooled(emb, texts: list[str], prefix: str, batch_size: int, bf16: bool) -> tuple[torch.Tensor, int]:
    """Pooled float32 embeddings (n, d) of `prefix + text` in input order, and how many texts were truncated."""
    ids, truncated = emb.token_ids(texts, prefix)
    return emb.embed_batches(ids, batch_size, torch.bfloat16 if bf16 else None), truncated


def identity(job: EncodeJob, emb) -> dict:
    """Everything that makes the output what it is; a resumed run must have the same (batch size, device and
    number of processes may differ: embeddings do not depend on them beyond float rounding)."""
    return {"input": job.input.describe(), "model": emb.settings_key(), "prefix": emb.prefix(job.prompt),
            "dim": job.dim, "precision": job.precision, "dtype": job.dtype, "chunk_rows": job.chunk_rows,
            "kind": job.kind}


def prepare(job: EncodeJob, emb) -> PartialState:
    """The partial state of the job: the existing one when it matches (its int8 calibration is put on `emb`), or a
    new one after a scan of the input (row count, every row checked: UTF-8, JSON, field, type, and Unicode the
    tokenizer takes). Raises when a state with other settings exists, and on empty or bad input before anything is
    written (when resuming, before any chunk is embedded)."""
    root, ident = partial_dir(job.out), identity(job, emb)
    state = PartialState.open(root)
    if state is not None:
        state.check(ident)
        try:  # the same input, scanned again: a bad row fails now, not in the middle of the remaining chunks
            job.input.scan()
        except MoembedError as e:
            raise MoembedError(f"{e} (while resuming {root}: the input cannot be embedded as it is; fix it and "
                               f"delete {root} to start over)") from None
        _use_calibration(emb, state)
        done = len(state.done())
        if done:
            log.info("resuming %s: %d of %d chunks done", root, done, state.chunks)
        return state
    rows = job.input.scan()
    if rows == 0:
        raise MoembedError(f"{job.input.path}: no texts to embed")
    calibration = None
    if job.precision in SCALAR and emb.calibration is None:
        source = job.calibration or job.input
        texts = source.head(CALIBRATION_SAMPLES)
        if not texts:
            raise MoembedError(f"{source.path}: no calibration texts")
        log.info("%s ranges from %d calibration texts (%s)", job.precision, len(texts), source.path)
        calibration = pooled(emb, texts, emb.prefix(job.prompt), job.batch_size, bf16=False)[0].numpy()
        emb.calibration = calibration
    probe = emb.postprocess(torch.zeros(1, emb.dim), job.dim, job.precision)  # (1, width): the output's row shape
    meta = {**ident, "rows": rows, "width": probe.shape[1], "out_dtype": probe.dtype.str}
    return PartialState.create(root, meta, calibration)


def _use_calibration(emb, state: PartialState) -> None:
    cal = state.calibration()
    if cal is not None:
        emb.calibration = cal


def encode_chunks(job: EncodeJob, emb, state: PartialState, rank: int = 0, world: int = 1,
                  show_progress: bool = False) -> int:
    """Embed and write this rank's chunks that are not done yet; returns the number of rows written."""
    done = state.done()
    prefix, bf16 = emb.prefix(job.prompt), job.dtype == "bf16"
    mine = [i for i in range(state.chunks) if i % world == rank and i not in done]
    total = sum(min(state.chunk_rows, state.rows - i * state.chunk_rows) for i in mine)
    todo = set(mine)
    written = truncated = 0
    writer = state.writer(rank)
    try:
        with bar("encode", enabled=show_progress) as progress:
            for i, texts in job.input.chunks(state.chunk_rows, todo.__contains__):
                x, t = pooled(emb, texts, prefix, job.batch_size, bf16)
                writer.write(i, emb.postprocess(x, job.dim, job.precision))
                written, truncated = written + len(texts), truncated + t
                if progress is not None:
                    progress(written, total)
    finally:
        writer.close()
    if truncated:
        log.warning("%d of %d texts were longer than %d tokens and were truncated", truncated, written, emb.max_length)
    if world > 1:
        log.info("rank %d of %d: %d texts in %d chunks", rank, world, written, len(mine))
    return written
