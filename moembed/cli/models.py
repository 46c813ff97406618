"""`moembed info` and `moembed export`: inspect and convert model directories."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("info")(info)
    app.command("export")(export)


def count_parameters(emb) -> tuple[int, int]:
    """(total, active per token): in an MoE layer only top_k of num_experts experts run for each token."""
    total = sum(p.numel() for p in emb.encoder.parameters())
    moe = emb.config.moe
    if moe is None:
        return total, total
    expert = sum(p.numel() for n, p in emb.encoder.named_parameters() if ".mlp.experts" in n)
    return total, total - expert + expert * moe.top_k // moe.num_experts


def info(model: str = typer.Argument(..., help="model directory")) -> None:
    """Architecture, parameter counts, dimensions, prefixes and maximum length of a model."""
    from moembed.model.embedder import Embedder

    emb = Embedder.load(model)
    c = emb.config
    total, active = count_parameters(emb)
    rows = [
        ("name", emb.name),
        ("family", f"{c.family} ({c.position} positions, {c.mlp} MLP)"),
        ("layers x hidden", f"{c.num_layers} x {c.hidden_size} ({c.num_heads} heads, MLP {c.intermediate_size})"),
        ("vocabulary", str(c.vocab_size)),
        ("parameters", f"{total:,} total, {active:,} active per token"),
        ("embedding dim", str(emb.dim)),
        ("pooling", f"{emb.pooling}{', normalized' if emb.normalize else ''}"),
        ("max length", f"{emb.max_length} tokens (trained positions {c.max_position})"),
        ("prompts", ", ".join(f"{k}={v!r}" for k, v in emb.prompts.items()) or "none"),
    ]
    if c.moe is not None:
        m = c.moe
        rows.append(("MoE", f"{m.num_experts} experts, top-{m.top_k}, layers {[i + 1 for i in c.moe_layers()]}"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        typer.echo(f"{k:<{w}}  {v}")


def export(
    model: str = typer.Argument(..., help="model directory"),
    format: str = typer.Option("sentence-transformers", "--format", help="sentence-transformers | moembed"),
    out: Path = typer.Option(..., "--out", help="output directory"),
) -> None:
    """Convert a model to another format."""
    from moembed.errors import MoembedError
    from moembed.model.embedder import Embedder
    from moembed.model.io import export_sentence_transformers

    emb = Embedder.load(model)
    if format == "sentence-transformers":
        export_sentence_transformers(emb, out)
    elif format == "moembed":
        emb.save(out)
    else:
        raise MoembedError(f"--format: unknown {format!r}; choose sentence-transformers or moembed")
    typer.echo(f"moembed: wrote {format} model to {out}", err=True)
