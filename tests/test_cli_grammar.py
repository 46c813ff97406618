"""One grammar for every command: --out/-o, positional inputs, --quiet where a bar is drawn, choices in --help,
--version, --nproc on train; old spellings work for one release and warn (moembed/cli/options.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing

import numpy as np
import pytest
import typer

from moembed.cli import options as o
from moembed.cli.main import app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, **env):
    return subprocess.run([sys.executable, "-m", "moembed.cli.main", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **env})


def commands(group, prefix: str = ""):
    """(name, click command) of every subcommand, nested groups included."""
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from commands(cmd, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", cmd


ALL = dict(commands(typer.main.get_command(app)))


def test_version_prints_the_package_version():
    from moembed import __version__

    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"moembed {__version__}"


def test_every_output_is_out_and_o_and_no_old_spelling_is_shown():
    outs = 0
    for name, cmd in ALL.items():
        for p in cmd.params:
            if p.param_type_name == "option" and not p.hidden:
                assert "--output" not in p.opts and "--input" not in p.opts, (name, p.opts)
                if "--out" in p.opts:
                    assert p.opts == ["--out", "-o"], (name, p.opts)
                    outs += 1
    assert outs >= 15  # encode, eval, export, upcycle, convert, data build/multilingual, filter, mine, moee, ...


def test_quiet_wherever_a_progress_bar_is_drawn():
    drawing = ["encode", "eval", "filter", "mine", "moee", "train", "quickstart", "move build-vocab"]
    for name in drawing:
        assert any("--quiet" in p.opts for p in ALL[name].params if p.param_type_name == "option"), name


def test_nproc_on_every_command_that_splits_work():
    for name in ("encode", "train", "quickstart", "filter", "mine"):
        assert any("--nproc" in p.opts for p in ALL[name].params if p.param_type_name == "option"), name


@pytest.mark.parametrize("command, flag, choices", [
    ("encode", "--precision", "<float32|int8|uint8|binary|ubinary>"),
    ("encode", "--dtype", "<float32|bf16|int8>"),
    ("encode", "--format", "<auto|jsonl|text|parquet>"),
    ("encode", "--device", "<auto|cpu|cuda|cuda:N|mps>"),
    ("moee", "--mode", "<hs|rw|concat|concat_raw>"),
    ("serve", "--dtype", "<auto|float32|bf16|int8>"),
    ("export", "--format", "<sentence-transformers|huggingface|onnx|moembed>"),
    ("quickstart", "--preset", "<english|multilingual>"),
    ("filter", "--backend", "<auto|faiss|exact>"),
])
def test_help_lists_the_choices(command, flag, choices):
    r = run(*command.split(), "--help", TERMINAL_WIDTH="300")
    assert r.returncode == 0
    line = next(x for x in r.stdout.splitlines() if x.startswith(f"│ {flag} ") or x.startswith(f"│    {flag} "))
    assert choices in line and "<str>" not in line


def test_a_value_outside_the_choices_names_the_flag_and_writes_nothing(tiny_dir, tmp_path):
    (tmp_path / "in.jsonl").write_text('"a"\n')
    r = run("encode", tiny_dir, tmp_path / "in.jsonl", "--out", tmp_path / "o.npy", "--precision", "fp4")
    assert r.returncode == 2 and "'--precision'" in r.stderr and "'fp4' is not one of" in r.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "in.jsonl"]


def test_choices_mirror_the_library_registries():
    # options.py spells the choices out (importing the library would load torch before --help); they must not drift.
    from moembed.data.search import BACKENDS
    from moembed.data.multilingual import SIZES
    from moembed.data.tokenizers import TokenizerConfig
    from moembed.model.config import EncoderConfig, MoVEConfig
    from moembed.model.pooling import POOLINGS, PRECISIONS
    from moembed.moee.combine import MODES
    from moembed.moee.extract import ExtractConfig
    from moembed.recipes.config import RECIPE_PRESETS, QuickstartConfig
    from moembed.recipes.corpus_input import FORMATS
    from moembed.recipes.encode_corpus import DTYPES
    from moembed.serve.config import ServeConfig

    def field(model, name):
        return typing.get_args(model.model_fields[name].annotation)

    args = typing.get_args
    assert args(o.Precision) == PRECISIONS
    assert args(o.Pooling) == POOLINGS
    from moembed.model.convert.upcycle import RouterInit
    assert args(o.RouterInit) == args(RouterInit)
    assert args(o.Compute) == DTYPES
    assert args(o.ServeCompute) == field(ServeConfig, "dtype")
    assert args(o.InputFormat) == FORMATS
    assert args(o.SearchBackend) == BACKENDS
    assert args(o.DataSize) == tuple(SIZES) == field(QuickstartConfig, "size")
    assert args(o.TokenizerKind) == field(TokenizerConfig, "kind")
    assert args(o.MoEEMode) == MODES
    assert args(o.MoEEPooling) == field(ExtractConfig, "hs_pooling")
    assert args(o.MoEELayers) == field(ExtractConfig, "hs_layers")
    assert args(o.Family) == field(EncoderConfig, "family")
    assert args(o.Routing) == field(MoVEConfig, "routing")
    assert args(o.Preset) == tuple(RECIPE_PRESETS)
    assert args(o.RecipeDevice) == field(QuickstartConfig, "device")


# ---- old spellings: hidden, working, warning ------------------------------------------------------------------


def test_encode_old_spellings_work_and_warn(tiny_dir, tmp_path):
    (tmp_path / "in.txt").write_text("one\ntwo\n")
    new = run("encode", tiny_dir, tmp_path / "in.txt", "-o", tmp_path / "new.npy", "--plain", "--quiet")
    assert new.returncode == 0, new.stderr
    assert "deprecated" not in new.stderr
    for old, warned in ((["--input", tmp_path / "in.txt", "--output", tmp_path / "old.npy"], ["--input", "--output"]),
                        (["-i", tmp_path / "in.txt", "--out", tmp_path / "old.npy"], ["--input"])):
        r = run("encode", tiny_dir, *old, "--plain", "--quiet")
        assert r.returncode == 0, r.stderr
        np.testing.assert_array_equal(np.load(tmp_path / "old.npy"), np.load(tmp_path / "new.npy"))
        (tmp_path / "old.npy").unlink()
        warnings = [x for x in r.stderr.splitlines() if x.startswith("moembed: warning:")]
        assert [w.split()[2] for w in warnings] == warned and all("is deprecated" in w for w in warnings)
    r = run("encode", tiny_dir, tmp_path / "in.txt", "--input", tmp_path / "in.txt", "-o", tmp_path / "x.npy")
    assert r.returncode == 1 and "--input: the old spelling of INPUT" in r.stderr
    r = run("encode", tiny_dir, tmp_path / "in.txt")
    assert r.returncode == 1 and "moembed: error: --out: missing" in r.stderr


def test_moee_input_is_positional_and_the_old_flags_warn(make_tiny, tmp_path):
    from moembed.model.config import MoEConfig

    make_tiny("nomic", moe=MoEConfig(num_experts=4, top_k=2)).save(tmp_path / "m")
    (tmp_path / "in.jsonl").write_text('"one text"\n"another text"\n')
    new = run("moee", tmp_path / "m", tmp_path / "in.jsonl", "--out", tmp_path / "new.npy", "--quiet", "--no-bf16")
    assert new.returncode == 0, new.stderr
    assert "warning" not in new.stderr
    old = run("moee", tmp_path / "m", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "old.npy", "--no-bf16",
              TQDM_MININTERVAL="0")  # the bar drawn at 100% however fast the two texts are
    assert old.returncode == 0, old.stderr
    assert "--input is deprecated" in old.stderr and "use INPUT" in old.stderr
    assert "--output is deprecated" in old.stderr and "use --out" in old.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "old.npy"), np.load(tmp_path / "new.npy"))
    assert "moee: 100%" in old.stderr and "moee:" not in new.stderr  # the bar without --quiet, none with it


def test_renamed_refuses_both_spellings_and_requires_one():
    from moembed.errors import MoembedError

    assert o.renamed("a", None, "--out", "--output") == "a"
    with pytest.raises(MoembedError, match="--output: the old spelling of --out"):
        o.renamed("a", "b", "--out", "--output")
    with pytest.raises(MoembedError, match="--out: missing"):
        o.renamed(None, None, "--out", "--output")
    assert o.renamed(None, None, "--out", "--output", required=False) is None


# ---- train --nproc --------------------------------------------------------------------------------------------


@pytest.mark.dist
def test_train_nproc_runs_the_config_on_two_processes(tmp_path, minilm_path):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from train_helpers import chatterbot_pairs, write_pairs

    pairs = write_pairs(tmp_path / "p.jsonl", chatterbot_pairs()[:64])
    out = tmp_path / "run"
    args = ["train", os.path.join(ROOT, "configs", "tiny", "contrastive.yaml"), f"tokenizer={minilm_path}",
            f"data.0.path={pairs}", f"output_dir={out}", "steps=2", "checkpoint.every=2", "--quiet"]
    bad = run(*args, "--nproc", 3)  # batch_size 8 cannot be split over 3 processes: refused before any starts
    assert bad.returncode == 1 and "--nproc: batch_size (8) must be divisible" in bad.stderr
    assert not out.exists()
    r = run(*args, "--nproc", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "model" / "config.json").exists()
    states = [json.loads(p.read_text()) for p in out.rglob("state.json")]
    assert states and all(s["meta"]["world_size"] == 2 for s in states)  # one data-parallel group of 2 processes


def test_nproc_runs_the_same_command_line_without_nproc(tmp_path, monkeypatch):
    # filter, mine and train start themselves again as N torchrun processes through one launcher
    # (moembed.distributed.launch), with the options the user gave, defaults left out.
    from typer.testing import CliRunner

    import moembed.distributed

    launched = []
    monkeypatch.setattr(moembed.distributed, "launch", lambda args, nproc: launched.append((args, nproc)) or 0)
    (tmp_path / "p.jsonl").write_text('{"query": "q", "document": "d"}\n')
    for cmd in ("filter", "mine"):
        r = CliRunner().invoke(app, [cmd, str(tmp_path / "p.jsonl"), "--teacher", "T", "-o", "o.jsonl", "--nproc", "2",
                                     "--bf16", "--batch-size", "16", "--quiet"])
        assert r.exit_code == 0, r.output
    config = os.path.join(ROOT, "configs", "tiny", "contrastive.yaml")
    r = CliRunner().invoke(app, ["train", config, "steps=3", "--fresh", "--nproc", "2"])
    assert r.exit_code == 0, r.output
    common = [str(tmp_path / "p.jsonl"), "--teacher", "T", "--out", "o.jsonl", "--batch-size", "16", "--bf16",
              "--quiet"]
    assert launched == [(["filter", *common], 2), (["mine", *common], 2),
                        (["train", config, "steps=3", "--fresh"], 2)]


def test_eval_takes_its_task_directories_as_arguments_and_tasks_still_works(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from moembed.errors import MoembedError

    seen = []

    def stop(d):  # the tasks are read before any model: record which, then stop
        seen.append(d)
        raise MoembedError("stop here")

    monkeypatch.setattr("moembed.eval.load_task", stop)
    r = CliRunner().invoke(app, ["eval", "M", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(tmp_path / "r")])
    assert seen == [tmp_path / "a"] and "stop here" in str(r.exception) and "deprecated" not in r.output
    seen.clear()
    r = CliRunner().invoke(app, ["eval", "M", "--tasks", str(tmp_path / "a"), "-o", str(tmp_path / "r")])
    assert seen == [tmp_path / "a"] and "--tasks is deprecated" in r.output and "use TASK_DIR" in r.output
