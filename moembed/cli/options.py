"""One grammar for every command: the option definitions they share and the one way an old spelling keeps working.

    moembed COMMAND [MODEL] INPUT... --out/-o OUT [--quiet] [options]

- outputs are `--out/-o`; inputs are positional arguments;
- `--quiet` wherever a progress bar is drawn;
- an option with a closed set of values is typed with a `Literal`, so `--help` lists the values (`<a|b|c>`) and
  click refuses any other value naming the flag; open sets (devices) show their shape as the metavar;
- a renamed flag keeps its old spelling for one release as a hidden option: `renamed(...)` takes the value from
  whichever spelling was given and prints a warning naming the new one.

The choices below mirror the tuples the library registers (moembed.model.pooling.PRECISIONS,
moembed.moee.combine.MODES, ...): importing those would load torch before `--help` could print, so
tests/test_cli_grammar.py checks that each Literal here equals the library's tuple.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from moembed.errors import MoembedError

# ---- closed sets of values (each equal to the library's registered tuple; see the module docstring) -------------
Precision = Literal["float32", "int8", "uint8", "binary", "ubinary"]  # model.pooling.PRECISIONS
Compute = Literal["float32", "bf16", "int8"]  # recipes.encode_corpus.DTYPES: float32, bf16 autocast, dynamic int8
ServeCompute = Literal["auto", "float32", "bf16", "int8"]  # serve.config.ServeConfig.dtype
Backend = Literal["auto", "torch", "fast"]  # model.settings.BACKENDS: how inference runs
InputFormat = Literal["auto", "jsonl", "text", "parquet"]  # recipes.corpus_input.FORMATS
SearchBackend = Literal["auto", "faiss", "exact"]  # data.search.BACKENDS
DataSize = Literal["tiny", "small", "medium", "large"]  # data.multilingual.SIZES, recipes.config.QuickstartConfig.size
TokenizerKind = Literal["bpe", "wordpiece", "unigram"]  # data.tokenizers.TokenizerConfig.kind
ExportFormat = Literal["sentence-transformers", "huggingface", "onnx", "moembed"]
Quantize = Literal["int8"]
Pooling = Literal["mean", "cls", "last", "max", "mean_sqrt_len", "weightedmean"]  # model.pooling.POOLINGS
RouterInit = Literal["random", "kmeans", "sources"]  # model.convert.upcycle.RouterInit
Preset = Literal["english", "multilingual"]  # recipes.config.RECIPE_PRESETS
RecipeDevice = Literal["auto", "cpu", "cuda", "mps"]  # recipes.config.QuickstartConfig.device
MoEEMode = Literal["hs", "rw", "concat", "concat_raw"]  # moee.combine.MODES
MoEEPooling = Literal["last", "mean"]  # moee.extract.ExtractConfig.hs_pooling
MoEELayers = Literal["last", "all"]  # moee.extract.ExtractConfig.hs_layers
VocabKind = Literal["move", "base", "large"]  # data.vocab_pair.make_embedder's kinds
Family = Literal["bert", "nomic"]  # model.config.EncoderConfig.family
Routing = Literal["hash", "learned", "semantic"]  # model.config.MoVEConfig.routing
Suite = Literal["dev"]

# Devices are an open set (cuda:N): the metavar shows their shape.
DEVICE_METAVAR = "<auto|cpu|cuda|cuda:N|mps>"

# ---- shared options ---------------------------------------------------------------------------------------------
Quiet = Annotated[bool, typer.Option("--quiet", help="no progress bars")]
Nproc = Annotated[int | None, typer.Option("--nproc", help="split the work over N processes on this machine "
                                                               "(torchrun; one GPU each on a GPU machine)")]


def out_option(help: str, default: Any = ...) -> Any:
    """`--out/-o`, the output of every command (required unless a default is given)."""
    return typer.Option(default, "--out", "-o", help=help)


def backend_option() -> Any:
    """`--backend`: how inference runs (`moembed.model.backends`), chosen once when the model is loaded."""
    return typer.Option("auto", help="auto: each CPU fast path where it pays here (MOEMBED_NO_FASTPATH=0 or 1 "
                        "overrides); torch: plain torch ops only; fast: every fast path this build has")


def device_option(default: str = "auto",
                  help: str = "where the model runs (auto: the accelerator when there is one)") -> Any:
    """`--device`, its choices shown (cuda:N makes them an open set, checked where the device is resolved)."""
    return typer.Option(default, "--device", metavar=DEVICE_METAVAR, help=help)


def processes(nproc: int | None) -> int:
    """`--nproc`'s value checked: 1 when not given; refused under torchrun, whose processes exist already."""
    import os

    if nproc is None:
        return 1
    if nproc < 1:
        raise MoembedError(f"--nproc: must be >= 1, got {nproc}")
    if nproc > 1 and "WORLD_SIZE" in os.environ:
        raise MoembedError("--nproc: already running under torchrun; leave --nproc out there")
    return nproc


def command_line(ctx: typer.Context) -> list[str]:
    """This command's arguments rebuilt from its parsed values, `--nproc` left out: what each process runs."""
    names, c = [], ctx
    while c.parent is not None:  # the subcommand's words, without the program's name
        names.insert(0, c.info_name)
        c = c.parent
    args = list(names)
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if p.name == "nproc" or v is None or (p.param_type_name == "option" and v == p.default):
            continue
        if p.param_type_name == "argument":
            args += [str(x) for x in v] if isinstance(v, (list, tuple)) else [str(v)]
        elif p.is_flag:
            args.append(p.opts[0] if v else p.secondary_opts[0])
        else:
            for x in v if p.multiple else [v]:
                args += [p.opts[0], str(x)]
    return args


def run_in_processes(ctx: typer.Context, nproc: int) -> None:
    """`--nproc N`: run this very command as N processes on this machine under torchrun, and wait."""
    from moembed.distributed import launch

    rc = launch(command_line(ctx), nproc)
    if rc != 0:
        raise MoembedError(f"--nproc {nproc}: a process failed (exit {rc}, its error is above); the same command "
                           "resumes where it stopped")


def old_spelling(*flags: str) -> Any:
    """A renamed flag's old spelling: accepted for one release, hidden from `--help`; pass it to `renamed`."""
    return typer.Option(None, *flags, hidden=True)


def warn(message: str) -> None:
    typer.echo(f"moembed: warning: {message}", err=True)


def renamed(new: Any, old: Any, new_flag: str, old_flag: str, required: bool = True) -> Any:
    """The value given with `new_flag`, or else with its deprecated spelling `old_flag` (with a warning).

    Both at once is an error, and so is neither when `required`."""
    if old is None:
        if new is None and required:
            raise MoembedError(f"{new_flag}: missing")
        return new
    if new is not None:
        raise MoembedError(f"{old_flag}: the old spelling of {new_flag}; give {new_flag} only")
    warn(f"{old_flag} is deprecated and will be removed in the next release; use {new_flag}")
    return old


def input_path(arg: Path | None, old: Path | None, old_flag: str = "--input") -> Path:
    """The input file, a positional argument; `--input/-i` is its deprecated spelling."""
    return renamed(arg, old, "INPUT", old_flag)
