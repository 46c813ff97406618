"""`moembed info` and `moembed export`: inspect and convert model directories."""

from __future__ import annotations

from pathlib import Path

import typer

from moembed.cli import options as o


def register(app: typer.Typer) -> None:
    app.command("info")(info)
    app.command("export")(export)


def count_parameters(emb) -> tuple[int, int]:
    """(total, active per token): in an MoE layer only top_k of num_experts experts run for each token."""
    from moembed.model.card import parameter_counts

    return parameter_counts(emb.config, dict(emb.encoder.named_parameters()))


def describe_positions(c) -> str:
    """Absolute (a learned table) or rotary (its base, and Dynamic NTK beyond the trained length)."""
    if c.position == "absolute":
        return f"absolute, {c.max_position} learned"
    ntk = f", Dynamic NTK alpha {c.ntk_alpha:g} beyond" if c.dynamic_ntk else ""
    return f"rotary, base {c.rope_base:g}, {c.max_position} trained{ntk}"


def info(
    model: str = typer.Argument(..., help="model directory"),
    probe: Path = typer.Option(None, "--probe", help="texts (one JSON string per line) to measure MoE expert load on"),
    plain: bool = typer.Option(False, "--plain", help="read --probe as plain text lines"),
    pooling: o.Pooling = typer.Option(None, help="how token states become one vector (default: the model's)"),
    label: str = typer.Option(None, "--label", help="with --probe: lines are JSON objects {\"text\": ..., KEY: ...}; "
                              "also the mutual information between chosen expert and the label under KEY"),
) -> None:
    """Architecture, parameter counts, dimensions, prefixes and maximum length of a model."""
    from moembed.model.embedder import Embedder
    from moembed.model.io import pooling_origin

    emb = Embedder.load(model, pooling=pooling)
    origin = "--pooling" if pooling is not None else pooling_origin(model)
    c = emb.config
    total, active = count_parameters(emb)
    rows = [
        ("name", emb.name),
        ("family", f"{c.hf_model_type or 'moembed'} ({c.family}-style layers, {c.mlp} MLP)"),
        ("positions", describe_positions(c)),
        ("layers x hidden", f"{c.num_layers} x {c.hidden_size} ({c.num_heads} heads, MLP {c.intermediate_size})"),
        ("vocabulary", str(c.vocab_size)),
        ("parameters", f"{total:,} total, {active:,} active per token"),
        ("embedding dim", str(emb.dim)),
        ("pooling", f"{emb.pooling}{', normalized' if emb.normalize else ''} (from {origin})"),
        ("max length", f"{emb.max_length} tokens (trained positions {c.max_position})"),
        ("prompts", ", ".join(f"{k}={v!r}" for k, v in emb.prompts.items()) or "none"),
        ("default prompt", emb.default_prompt_name or "none"),
    ]
    if c.moe is not None:
        m = c.moe
        rows.append(("MoE", f"{m.num_experts} experts, top-{m.top_k}, layers {[i + 1 for i in c.moe_layers()]}"))
    if c.move is not None:
        v = c.move
        rows.append(("MoVE", f"V_s {v.base_vocab_size} -> V_l {c.vocab_size}, {v.num_experts} experts x {v.expert_dim}, {v.routing} routing"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        typer.echo(f"{k:<{w}}  {v}")
    if probe is not None:
        _probe(emb, probe, plain, label)


def _probe(emb, path: Path, plain: bool, label: str | None = None) -> None:
    """Per-layer expert load and router entropy over the texts of a file; expert divergence, and with `label` the
    mutual information between expert and label (moembed.model.diagnostics)."""
    from moembed.errors import MoembedError
    from moembed.fileio import read_labelled_texts, read_texts
    from moembed.model.diagnostics import diagnose, format_diagnostics
    from moembed.model.utilisation import format_report

    if emb.config.moe is None:
        raise MoembedError(f"--probe: {emb.name} has no MoE layers")
    texts, labels = read_labelled_texts(path, label, "--label") if label else (read_texts(path, plain=plain), None)
    if not texts:
        raise MoembedError(f"{path}: no texts")
    rows = diagnose(emb, texts, labels)
    typer.echo(f"expert load over {len(texts)} texts of {path}:")
    for line in format_report([r.utilisation for r in rows]) + format_diagnostics(rows):
        typer.echo(f"  {line}")


def export(
    model: str = typer.Argument(..., help="model directory"),
    format: o.ExportFormat = typer.Option("sentence-transformers", "--format",
                                          help="huggingface: the family's own layout; onnx: onnx/model.onnx in a "
                                          "sentence-transformers directory"),
    out: Path = o.out_option("output directory"),
    quantize: o.Quantize = typer.Option(None, "--quantize", help="onnx: also write an int8 graph (ONNX Runtime's "
                                         "dynamic quantiser)"),
) -> None:
    """Convert a model to another format, with a model card (README.md)."""
    from moembed.errors import MoembedError
    from moembed.model.embedder import Embedder
    from moembed.model.io import export_huggingface, export_sentence_transformers

    if quantize is not None and format != "onnx":
        raise MoembedError(f"--quantize: applies to --format onnx only, not {format}")
    from moembed.data.calibration import ensure_calibration

    emb = Embedder.load(model)
    typer.echo(f"moembed: {ensure_calibration(emb)}", err=True)
    if format == "sentence-transformers":
        export_sentence_transformers(emb, out)
    elif format == "huggingface":
        format = f"huggingface {export_huggingface(emb, out)}"
    elif format == "onnx":
        from moembed.model.onnx_export import export_onnx

        format = f"onnx ({', '.join(export_onnx(emb, out, quantize))})"
    else:
        emb.save(out)
    typer.echo(f"moembed: wrote {format} model to {out}", err=True)
