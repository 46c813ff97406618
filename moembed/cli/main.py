"""Entry point of the `moembed` command. Each module in COMMANDS defines `register(app)`."""

from __future__ import annotations

import importlib
import logging
import os
import sys

import typer

from moembed.errors import MoembedError
from moembed.heap import configure_process, start_on_mimalloc

# One module per job (moembed/cli/<name>.py). Keep imports inside the command functions so `--help` is fast.
COMMANDS = ["encode", "models", "convert", "data", "moee", "move", "moe", "train", "eval", "quickstart", "serve", "calibrate"]
TRAINING = {"train", "quickstart"}  # commands that train: their process runs with moembed.heap's training settings

app = typer.Typer(
    name="moembed",
    help="Train, evaluate and use text-embedding models with sparse Mixture-of-Experts encoders.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _name in COMMANDS:
    importlib.import_module(f"moembed.cli.{_name}").register(app)


def _print_version(value: bool) -> None:
    if value:
        from moembed.version import __version__

        typer.echo(f"moembed {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="print moembed's version and exit"),
) -> None:
    """Train, evaluate and use text-embedding models with sparse Mixture-of-Experts encoders."""


def _command() -> str | None:
    return next((a for a in sys.argv[1:] if not a.startswith("-")), None)


def run() -> None:
    """The installed `moembed` command: a training command starts itself again on mimalloc (moembed.heap; the
    allocator of a process is fixed when it starts), then `main`."""
    start_on_mimalloc(["-m", "moembed.cli.main", *sys.argv[1:]], training=_command() in TRAINING)
    main()


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    command = _command()
    configure_process(training=command in TRAINING)  # before torch loads: torch, oneDNN and OpenMP read these once
    logging.basicConfig(level=logging.INFO, format="moembed: %(message)s", stream=sys.stderr)
    try:
        app(prog_name="moembed")
    except MoembedError as e:
        print(f"moembed: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("moembed: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run()
