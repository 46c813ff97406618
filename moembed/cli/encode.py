"""`moembed encode`: embed a file of texts into a .npy array."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("encode")(encode)


def encode(
    model: str = typer.Argument(..., help="moembed, Hugging Face BERT or sentence-transformers directory"),
    input: Path = typer.Option(..., "--input", "-i", help="one JSON string per line (or plain lines with --plain)"),
    output: Path = typer.Option(..., "--output", "-o", help="output .npy: one row per input line, in order"),
    prompt: str = typer.Option(None, help="task prefix name, e.g. search_query"),
    dim: int = typer.Option(None, help="Matryoshka truncation to the first DIM components"),
    precision: str = typer.Option("float32", help="float32 | int8 | uint8 | binary | ubinary"),
    batch_size: int = typer.Option(32, help="texts per forward pass"),
    plain: bool = typer.Option(False, help="read plain text lines instead of JSON strings"),
    bf16: bool = typer.Option(False, help="bfloat16 autocast (faster on CPUs with AVX-512 BF16)"),
    dtype: str = typer.Option("float32", help="compute precision: float32 | bf16 (autocast) | int8 (dynamic, CPU)"),
    calibration: Path = typer.Option(None, help="texts (same format as --input) whose embeddings set int8 ranges"),
) -> None:
    """Embed texts: one row per input line, float32 unless another precision is asked."""
    import numpy as np

    from moembed.errors import MoembedError
    from moembed.fileio import atomic_path, read_texts
    from moembed.model.embedder import Embedder
    from moembed.model.pooling import PRECISIONS

    if precision not in PRECISIONS:
        raise MoembedError(f"--precision: unknown {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if dtype not in ("float32", "bf16", "int8"):
        raise MoembedError(f"--dtype: unknown {dtype!r}; choose one of float32, bf16, int8")
    bf16 = bf16 or dtype == "bf16"
    if output.suffix != ".npy":
        raise MoembedError(f"--output: {output} must end in .npy")
    texts = read_texts(input, plain=plain)
    emb = Embedder.load(model)
    if dtype == "int8":
        from moembed.model.linear import quantize_int8

        try:
            quantize_int8(emb)
        except RuntimeError as e:
            raise MoembedError(f"--dtype int8: {e}") from None
    if dim is not None and not 1 <= dim <= emb.dim:
        raise MoembedError(f"--dim: {dim} is out of range 1..{emb.dim}")
    emb.prefix(prompt)  # unknown prompt names fail before any work
    if precision in ("int8", "uint8") and emb.calibration is None:
        cal_texts = read_texts(calibration, plain=plain) if calibration else texts
        typer.echo(f"moembed: int8 ranges from {len(cal_texts)} calibration texts ({calibration or input})", err=True)
        emb.calibrate(cal_texts, prompt_name=prompt)
    x = emb.encode(texts, prompt_name=prompt, dim=dim, precision=precision, batch_size=batch_size, show_progress=True, bf16=bf16)
    with atomic_path(output) as tmp:
        with open(tmp, "wb") as fh:
            np.save(fh, x)
    typer.echo(f"moembed: wrote {x.shape[0]} x {x.shape[1]} {x.dtype} to {output}", err=True)
