"""`moembed encode`: embed a corpus of texts, streamed in chunks, into a .npy array or Parquet shards.

    moembed encode MODEL docs.jsonl --field text --out docs.npy --prompt search_document
    moembed encode MODEL docs.parquet --column body --out docs/ --nproc 2     # Parquet shards, two processes
"""

from __future__ import annotations

from pathlib import Path

import typer

from moembed.cli import options as o


def register(app: typer.Typer) -> None:
    app.command("encode")(encode)


def encode(
    model: str = typer.Argument(..., help="moembed, Hugging Face BERT or sentence-transformers directory"),
    source: Path = typer.Argument(None, metavar="INPUT", help="texts: JSONL, plain text or Parquet"),
    out: Path = o.out_option("OUT.npy: one row per text, in input order; a directory: Parquet shards (id, embedding)",
                             None),
    format: o.InputFormat = typer.Option("auto", help="auto: parquet for .parquet, else jsonl; text: plain lines"),
    field: str = typer.Option(None, help="JSONL: the key of the text in each object (default: each line a JSON string)"),
    column: str = typer.Option(None, help="Parquet: the column of the texts"),
    plain: bool = typer.Option(False, help="read plain text lines (same as --format text)"),
    prompt: str = typer.Option(None, help="task prefix name, e.g. search_query"),
    dim: int = typer.Option(None, help="Matryoshka truncation to the first DIM components"),
    precision: o.Precision = typer.Option("float32", help="output precision (int8/uint8: calibrated ranges)"),
    batch_size: int = typer.Option(32, help="texts per forward pass"),
    chunk_size: int = typer.Option(4096, help="texts read, embedded and written at a time (the unit of resumption)"),
    max_length: int = typer.Option(None, help="tokens per text (default: the model's)"),
    device: str = o.device_option(),
    bf16: bool = typer.Option(False, help="bfloat16 autocast (same as --dtype bf16)"),
    dtype: o.Compute = typer.Option("float32", help="compute precision: bf16 autocast; int8 dynamic matmuls (CPU)"),
    calibration: Path = typer.Option(None, help="texts (same format as the input) whose embeddings set int8 ranges"),
    nproc: o.Nproc = None,
    quiet: o.Quiet = False,
    old_input: Path = o.old_spelling("--input", "-i"),
    old_output: Path = o.old_spelling("--output"),
    pooling: o.Pooling = typer.Option(None, help="how token states become one vector (default: the model's)"),
    backend: o.Backend = o.backend_option(),
) -> None:
    """Embed texts: one row per input text, float32 unless another precision is asked.

    The input is streamed in chunks and the rows are written in place, so memory does not grow with the corpus.
    An interrupted run leaves OUT.partial/ beside OUT; the same command resumes it.
    """
    from moembed.distributed import launch
    from moembed.errors import MoembedError
    from moembed.recipes.corpus_input import CorpusInput
    from moembed.recipes.encode_corpus import EncodeJob, encode_corpus, load_model, prepare

    src = o.input_path(source, old_input)
    output = o.renamed(out, old_output, "--out", "--output")
    if plain:
        if format not in ("auto", "text"):
            raise MoembedError(f"--plain: contradicts --format {format}")
        format = "text"
    if bf16:
        if dtype not in ("float32", "bf16"):
            raise MoembedError(f"--bf16: contradicts --dtype {dtype}")
        dtype = "bf16"
    inp = CorpusInput.open(src, format, field, column)
    cal = CorpusInput.open(calibration, inp.format, field, column) if calibration is not None else None
    job = EncodeJob(model=model, input=inp, out=output, prompt=prompt, dim=dim, precision=precision, dtype=dtype,
                    max_length=max_length, chunk_rows=chunk_size, batch_size=batch_size, device=device,
                    calibration=cal, pooling=pooling, backend=backend)
    nproc = o.processes(nproc)
    if nproc == 1:
        rows, width, out_dtype = encode_corpus(job, show_progress=not quiet)
    else:
        emb = load_model(job)  # bad input and options fail here, with one clear line, before any process starts
        state = prepare(job, emb)
        rows, width, out_dtype = state.rows, state.width, state.dtype
        del emb
        rc = launch(["encode", *_worker_argv(model, src, job, calibration, quiet)], nproc)
        if rc != 0:
            raise MoembedError(f"--nproc {nproc}: a process failed (exit {rc}); {state.root} is kept: run the same "
                               "command again to resume")
    typer.echo(f"moembed: wrote {rows} x {width} {out_dtype.name} to {output}", err=True)


def _worker_argv(model: str, src: Path, job, calibration: Path | None, quiet: bool) -> list[str]:
    """The command line of one rank: this job's options, without --nproc."""
    argv = [model, str(src), "--out", str(job.out), "--format", job.input.format, "--precision", job.precision,
            "--dtype", job.dtype, "--batch-size", str(job.batch_size), "--chunk-size", str(job.chunk_rows),
            "--device", job.device, "--backend", job.backend]
    for flag, value in (("--field", job.input.field), ("--column", job.input.column), ("--prompt", job.prompt),
                        ("--dim", job.dim), ("--max-length", job.max_length), ("--calibration", calibration),
                        ("--pooling", job.pooling)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--quiet"] if quiet else [])
