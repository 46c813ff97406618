"""benchmarks/step_profile.py's split of a training step's operators into kinds of work, on a real profile."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from step_profile import AUTOGRAD, OTHER, kind_of  # noqa: E402

from moembed.model.encoder import Encoder  # noqa: E402
from moembed.model.presets import tiny_config  # noqa: E402


def test_training_step_operators_go_to_their_kind_of_work():
    torch.manual_seed(0)
    enc = Encoder(tiny_config("bert", hidden_dropout=0.1, attention_dropout=0.0)).train()
    opt = torch.optim.AdamW(enc.parameters(), lr=1e-3)
    ids = torch.randint(1, 100, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, 4:] = False
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        enc(ids, mask).packed_hidden.square().sum().backward()
        opt.step()
    def callers(e):
        while (e := e.cpu_parent) is not None:
            yield e.name

    kinds: dict[str, set[str]] = {}
    in_optimizer: set[str] = set()
    for e in prof.events():
        kinds.setdefault(e.name, set()).add(kind_of(e))
        if any(c.startswith("Optimizer.step") for c in callers(e)):
            in_optimizer.add(kind_of(e))
    assert kinds["aten::bernoulli_"] == {"dropout"}
    assert kinds["aten::addmm"] == {"matmul"}  # forward linear layers
    assert kinds["aten::mm"] == {"matmul"}  # their backward
    assert kinds["aten::native_layer_norm"] == {"normalisation"}
    assert kinds["aten::gelu"] == {"activation"}
    assert {k for n, ks in kinds.items() if "scaled_dot_product" in n for k in ks} == {"attention"}
    assert in_optimizer == {"optimizer and clipping"}  # AdamW's arithmetic, whichever kernels it picks
    assert kinds["aten::index_select"] == {"indexing and copies"}  # padding removal
    assert {k for n, ks in kinds.items() if n.startswith("autograd::engine") for k in ks} == {AUTOGRAD}
    assert OTHER in kinds["aten::add"]  # the residual adds
