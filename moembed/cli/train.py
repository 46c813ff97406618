"""`moembed train CONFIG.yaml [key=value ...]` and `moembed validate CONFIG.yaml [key=value ...]`."""

from __future__ import annotations

import typer

from moembed.cli import options as o


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train_cmd(
        ctx: typer.Context,
        config: str = typer.Argument(..., help="YAML training config (see docs/training.md)"),
        overrides: list[str] = typer.Argument(None, help="dotted key=value overrides, e.g. optim.lr=1e-4 steps=100"),
        fresh: bool = typer.Option(False, "--fresh", help="ignore existing checkpoints instead of resuming"),
        nproc: o.Nproc = None,
        quiet: o.Quiet = False,
    ) -> None:
        """Train (stages mlm | contrastive | finetune); resumes from the latest checkpoint in the run directory."""
        from moembed.errors import MoembedError
        from moembed.train.config import load_config

        cfg = load_config(config, overrides or [])  # a bad config fails here, once, before any process starts
        nproc = o.processes(nproc)
        if nproc > 1:
            if cfg.batch_size % nproc:
                raise MoembedError(f"--nproc: batch_size ({cfg.batch_size}) must be divisible by the number of "
                                   f"processes ({nproc})")
            o.run_in_processes(ctx, nproc)
            typer.echo(f"model saved to {cfg.output_dir}/model")
            return
        from moembed.distributed import rank
        from moembed.heap import bounded_heap
        from moembed.train.loop import train

        with bounded_heap():  # this command owns its process: variable-length batches do not grow its heap
            final = train(cfg, progress=not quiet, resume=not fresh)
        if rank() == 0:
            typer.echo(f"model saved to {final}")

    @app.command("validate")
    def validate_cmd(
        config: str = typer.Argument(..., help="YAML training config"),
        overrides: list[str] = typer.Argument(None, help="dotted key=value overrides"),
    ) -> None:
        """Check a training config (keys, types, paths) and every record of its data without training; errors name
        the key, or the file and line (all malformed records, up to 20 listed)."""
        from moembed.train.build import check_paths, check_training_data
        from moembed.train.config import load_config

        cfg = load_config(config, overrides or [])
        check_paths(cfg)
        data = check_training_data(cfg)
        sources = ", ".join(s.label for s in cfg.data)
        typer.echo(f"{config}: ok (stage {cfg.stage}, {cfg.steps} steps, batch {cfg.batch_size}, sources: {sources}; "
                   f"data: {data.summary()})")

