"""Recomputed MLP activations (moembed.model.recompute): gradients bitwise those of the plain pass, forward and
backward, for dense GELU and SwiGLU MLPs and both expert paths; the activation output is really not kept; and the
recipe refuses to hand backward a tensor unlike the one the forward pass saved."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moembed.model import recompute
from moembed.model.config import MoEConfig
from moembed.model.encoder import Encoder
from moembed.model import backends
from moembed.model.experts import Experts
from moembed.model.fast.experts import GroupedExperts
from moembed.model.presets import tiny_config
from moembed.model.recompute import set_recompute, then_recomputed


def count_remakes(monkeypatch) -> list[int]:
    made = []
    original = recompute._Recipe.remake
    monkeypatch.setattr(recompute._Recipe, "remake", lambda self: made.append(1) or original(self))
    return made


@pytest.mark.parametrize("family", ["bert", "nomic"])  # GELU with dropout; SwiGLU without bias
@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
def test_gradients_are_bitwise_those_of_the_plain_pass(family, dispatch, monkeypatch):
    torch.manual_seed(0)
    plain = Encoder(tiny_config(family, moe=MoEConfig(num_experts=4, top_k=2, every=2)))  # dense and MoE layers
    plain.train()
    backends.use_experts(plain, dispatch)
    again = copy.deepcopy(plain)
    set_recompute(again, True)
    ids = torch.randint(1, plain.config.vocab_size, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, 6:] = 0
    made = count_remakes(monkeypatch)
    results = []
    for model in (plain, again):
        torch.manual_seed(1)  # the same dropout masks
        out = model(ids, mask).last_hidden_state
        out.pow(2).sum().backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters()}))
    kinds = {type(m) for m in again.modules() if isinstance(m, Experts)}
    assert kinds == {GroupedExperts if dispatch == "grouped" else Experts}
    # One remake per dense MLP, and per MoE layer one (grouped) or one per expert that got tokens (loop).
    layers = plain.config.num_layers
    assert len(made) == layers if dispatch == "grouped" else len(made) > layers
    (a, ga), (b, gb) = results
    assert torch.equal(a, b)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)


def test_the_activation_output_is_not_kept():
    from torch.multiprocessing.reductions import StorageWeakRef

    h = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(32, 256, requires_grad=True)

    def forward(enabled):
        seen = {}

        def consume(a):
            seen["a"] = StorageWeakRef(a.untyped_storage())
            return F.linear(a, w)

        return then_recomputed(F.gelu, h, consume, enabled), seen["a"]

    y, a = forward(False)
    assert not a.expired()  # the graph keeps GELU's output for fc2's weight gradient
    y, a = forward(True)
    assert a.expired()  # freed after the forward pass
    y.pow(2).sum().backward()
    assert w.grad is not None and h.grad is not None


def test_no_graph_no_hooks():
    h = torch.randn(4, 8)
    with torch.no_grad():
        y = then_recomputed(F.gelu, h.requires_grad_(), lambda a: a * 2)
    assert torch.equal(y, F.gelu(h) * 2) and y.grad_fn is None


def test_a_different_recomputation_is_refused():
    h = torch.randn(4, 8, requires_grad=True)
    calls = []

    def act(x):  # the second call (in backward) returns another dtype: a bug the recipe must not hide
        calls.append(1)
        return F.gelu(x) if len(calls) == 1 else F.gelu(x).double()

    y = then_recomputed(act, h, lambda a: a @ torch.ones(8, 2, requires_grad=True))  # keeps a for the weight
    with pytest.raises(RuntimeError, match="differs from the saved"):
        y.sum().backward()


def test_training_turns_it_on(tmp_path):
    from moembed.train.config import TrainConfig

    assert TrainConfig(model="m", data=[{"path": "x.jsonl"}], steps=1, output_dir=str(tmp_path)).recompute_activations
