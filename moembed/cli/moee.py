"""`moembed moee`: training-free HS / RW / MoEE(concat) embeddings from an MoE model into a .npy array."""

from __future__ import annotations

from pathlib import Path

import typer

from moembed.cli import options as o


def register(app: typer.Typer) -> None:
    app.command("moee")(moee)


def moee(
    model: str = typer.Argument(..., help="Hugging Face MoE causal-LM directory, or a moembed MoE encoder directory"),
    input_file: Path = typer.Argument(None, metavar="INPUT",
                                      help="one JSON string per line (or plain lines with --plain)"),
    out: Path = o.out_option("output .npy: one row per input line, in order", None),
    mode: o.MoEEMode = typer.Option("concat", help="concat = [HS/|HS| ; RW/|RW|], concat_raw = the paper's [HS ; RW]"),
    prompt: str = typer.Option(None, help="language models: a Table 2 name (none, prompteol, ...) or a template "
                                          "with *sent*; encoders: a prefix name such as search_query"),
    pooling: o.MoEEPooling = typer.Option(None, help="token pooling of HS and RW (language models; default last). "
                                                     "Encoders always take the mean"),
    hs_layers: o.MoEELayers = typer.Option("last", help="HS from the last layer or the mean over all layers"),
    batch_size: int = typer.Option(32, help="texts per forward pass"),
    max_length: int = typer.Option(None, help="tokens per text (language models keep the last ones)"),
    plain: bool = typer.Option(False, help="read plain text lines instead of JSON strings"),
    bf16: bool = typer.Option(True, "--bf16/--no-bf16", help="bfloat16 weights (language models) or autocast (encoders)"),
    load_in_8bit: bool = typer.Option(False, help="8-bit weights through bitsandbytes (language models)"),
    device: str = o.device_option(),
    quiet: o.Quiet = False,
    old_input: Path = o.old_spelling("--input", "-i"),
    old_output: Path = o.old_spelling("--output"),
) -> None:
    """Embed texts with the hidden state, the routing weights, or both, of an MoE model (no training)."""
    import numpy as np

    from moembed.errors import MoembedError
    from moembed.fileio import atomic_path, read_texts
    from moembed.moee import ExtractConfig, MoEEModel, load_source
    from moembed.moee.hf import is_hf_moe_dir

    input = o.input_path(input_file, old_input)
    output = o.renamed(out, old_output, "--out", "--output")
    if output.suffix != ".npy":
        raise MoembedError(f"--out: {output} must end in .npy")
    texts = read_texts(input, plain=plain)
    if is_hf_moe_dir(model):
        extract = ExtractConfig(rw_pooling=pooling or "last", hs_pooling=pooling or "last", hs_layers=hs_layers)
        source = load_source(model, extract=extract, prompt=prompt, bf16=bf16, load_in_8bit=load_in_8bit,
                             max_length=max_length, device=device)
        prompt_name = None  # the template is the source's default
    else:
        if pooling == "last" or hs_layers != "last":
            raise MoembedError("--pooling/--hs-layers: apply to language models; an encoder's HS is its pooled "
                               "output and its RW the mean over tokens")
        source = load_source(model, bf16=bf16, load_in_8bit=load_in_8bit, max_length=max_length, device=device)
        if prompt is not None and prompt not in source.prompts:
            known = ", ".join(sorted(source.prompts)) or "none"
            raise MoembedError(f"--prompt: unknown name {prompt!r}; this model knows: {known}")
        prompt_name = prompt
    x = MoEEModel(source, mode).encode(texts, prompt_name=prompt_name, batch_size=batch_size,
                                        show_progress_bar=not quiet)
    with atomic_path(output) as tmp, open(tmp, "wb") as fh:
        np.save(fh, x)
    typer.echo(f"moembed: wrote {x.shape[0]} x {x.shape[1]} {x.dtype} ({mode}) to {output}", err=True)
