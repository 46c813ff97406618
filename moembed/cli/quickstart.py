"""`moembed quickstart`: the main job, end to end on real data — the user's pairs or the built-in corpora."""

from __future__ import annotations

from pathlib import Path

import typer

from moembed.cli import options as o


def register(app: typer.Typer) -> None:
    app.command("quickstart")(quickstart)


def quickstart(
    out: Path = o.out_option("work and report directory (rerun to resume)", Path("moembed-quickstart")),
    data: list[Path] = typer.Option(None, "--data", help="your pairs: JSONL, Parquet or a `datasets` save_to_disk "
                                    "directory (repeat for several); default: the built-in corpora"),
    fields: str = typer.Option(None, "--fields", help="field names of your records, e.g. query=q,document=d "
                               "(roles: query, document, negatives, source, language)"),
    base: str = typer.Option(None, "--base", help="base model directory (default: all-MiniLM-L6-v2)"),
    teacher: str = typer.Option(None, "--teacher", help="teacher for filtering and mining (default: the base)"),
    preset: o.Preset = typer.Option(None, "--preset", help="a named recipe (default: english)"),
    steps: int = typer.Option(None, "--steps", help="finetuning steps per model (default 120)"),
    batch_size: int = typer.Option(None, "--batch-size", help="global training batch (default 32)"),
    max_pairs: int = typer.Option(None, "--max-pairs", help="training pairs kept (your data: in all; built-in: per dataset)"),
    nproc: int = typer.Option(None, "--nproc", help="training processes per model, launched with torchrun (default 1)"),
    device: o.RecipeDevice = typer.Option(None, "--device", help="where the teacher, training and evaluation run "
                                          "(default auto: the GPU when there is one)"),
    size: o.DataSize = typer.Option(None, "--size", help="pairs per dataset, eval sizes"),
    config: Path = typer.Option(None, "--config", help="a YAML file over configs/quickstart.yaml's defaults"),
    quiet: o.Quiet = False,
) -> None:
    """Split, filter, mine, upcycle to MoE, finetune MoE and dense, evaluate and report (time per CPU:
    docs/quickstart.md)."""
    import json

    from moembed.recipes.quickstart import Quickstart, load_quickstart_config
    from moembed.recipes.report import print_headline

    cfg = load_quickstart_config(config, preset, steps=steps, size=size, data=data, fields=fields, base=base,
                                 teacher=teacher, batch_size=batch_size, max_pairs=max_pairs, nproc=nproc,
                                 device=device)
    results = Quickstart(cfg, out, progress=not quiet, owns_process=True).run()  # training bounds its heap
    report = results["report"]
    if "table" not in report:  # finished in an earlier run: read the stored report
        report = json.loads((out / "stages" / "report.json").read_text())
    print_headline(report)
    typer.echo(f"\nreport: {out / 'report' / 'README.md'}")
