"""`moembed quickstart`: the main job, end to end on real data."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("quickstart")(quickstart)


def quickstart(
    out: Path = typer.Option(Path("moembed-quickstart"), "--out", help="work and report directory (rerun to resume)"),
    steps: int = typer.Option(None, "--steps", help="finetuning steps per model (default 200)"),
    size: str = typer.Option(None, "--size", help="small | medium | large: pairs per dataset"),
    config: Path = typer.Option(None, "--config", help="a YAML file over configs/quickstart.yaml's defaults"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bars"),
) -> None:
    """Build data, filter, mine, upcycle to MoE, finetune MoE and dense, evaluate and report (10-12 min on 2 cores)."""
    import json

    from moembed.recipes.quickstart import Quickstart, load_quickstart_config
    from moembed.recipes.report import print_headline

    cfg = load_quickstart_config(config, steps=steps, size=size)
    results = Quickstart(cfg, out, progress=not quiet).run()
    report = results["report"]
    if "table" not in report:  # finished in an earlier run: read the stored report
        report = json.loads((out / "stages" / "report.json").read_text())
    print_headline(report)
    typer.echo(f"\nreport: {out / 'report' / 'README.md'}")
