"""`moembed calibrate MODEL TEXTS`: store the int8 calibration sample of a model that has none (or replace it).

    moembed calibrate models/minilm docs.jsonl --field text --n 2000
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)


def calibrate(
    model: str = typer.Argument(..., help="model directory (moembed, Hugging Face or sentence-transformers)"),
    texts: Path = typer.Argument(..., help="texts like the ones the model will embed: JSONL, plain text or Parquet"),
    field: str = typer.Option(None, "--field", help="JSONL: the key of the text in each object (default: each line a JSON string)"),
    column: str = typer.Option(None, "--column", help="Parquet: the column of the texts"),
    format: str = typer.Option("auto", "--format", help="auto | jsonl | text | parquet (auto: parquet for .parquet, else jsonl)"),
    n: int = typer.Option(10_000, "--n", help="embed the first N texts"),
    prompt: str = typer.Option(None, "--prompt", help="prompt name the texts are embedded with (default: the model's document prompt)"),
) -> None:
    """Embed the first N texts and write their embeddings into MODEL/calibration.safetensors (atomically; the
    model's other files are untouched), so that `precision: int8` / uint8 work in encode, eval and serve."""
    from moembed.errors import MoembedError
    from moembed.model.embedder import Embedder
    from moembed.model.io import CALIBRATION_FILE, store_calibration
    from moembed.recipes.corpus_input import CorpusInput

    if n < 1:
        raise MoembedError(f"--n: must be >= 1, got {n}")
    sample = CorpusInput.open(texts, format, field, column).head(n)
    if not sample:
        raise MoembedError(f"{texts}: no texts")
    emb = Embedder.load(model)
    prompt = prompt if prompt is not None else emb.role_prompt("document")
    emb.calibrate(sample, prompt_name=prompt, max_samples=n)
    store_calibration(model, emb.calibration)
    how = f"with prompt {prompt!r}" if prompt else "without a prompt"
    typer.echo(f"moembed: wrote {Path(model) / CALIBRATION_FILE} ({len(sample)} texts of {texts}, {how})", err=True)
