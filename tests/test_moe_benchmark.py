"""benchmarks/moe.py sets each MoE variant up through the public backends: the experts a variant is named for are
the ones that run, in its training step and in its encoding, and moe-unpadded pads no expert's rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from spy import calls_of

from moembed.model import cpu
from moembed.model.config import MoEConfig
from moembed.model.experts import Experts
from moembed.model.fast.experts import GroupedExperts, PackedExperts, grouped_support

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from moe import VARIANTS, for_encoding, for_training  # noqa: E402

MOE = ("moe-auto", "moe-unpadded", "moe-grouped", "moe-loop")
EXPECTED = {"grouped": GroupedExperts, "packed-loop": PackedExperts, "loop": Experts}  # path -> experts' class


def experts_of(model) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


@pytest.fixture
def moe_model(make_tiny):
    if not grouped_support(torch.device("cpu"), torch.float32).usable:
        pytest.fail("torch._grouped_mm is unusable on this CPU: the benchmark's grouped variants cannot run")
    return make_tiny("bert", moe=MoEConfig(num_experts=4, top_k=2, every=1, offset=0))


def test_the_naive_variant_is_gone():
    assert "moe-naive" not in VARIANTS and set(MOE) <= set(VARIANTS)


@pytest.mark.parametrize("variant", MOE)
def test_a_training_step_runs_the_experts_the_variant_names(moe_model, variant, monkeypatch):
    kind = for_training(variant, moe_model.train(), torch.device("cpu"), bf16=False)
    want = "loop" if variant == "moe-loop" else "grouped"  # the others as the trainer sets them up
    assert kind == want
    assert all(type(m) is EXPECTED[want] for m in experts_of(moe_model))
    grouped = calls_of(monkeypatch, torch, "_grouped_mm")
    batch = moe_model.tokenizer(["a short text", "another, somewhat longer text"])
    moe_model(batch.input_ids, batch.attention_mask).embeddings.sum().backward()
    assert bool(grouped) == (want == "grouped")  # the grouped matmuls ran, or did not
    if variant == "moe-unpadded":
        assert all(m.row_multiple == 1 for m in experts_of(moe_model))


@pytest.mark.parametrize("switch", ["0", "1"])  # MOEMBED_NO_FASTPATH: "auto" as every fast path on, or off
@pytest.mark.parametrize("variant", MOE)
def test_encoding_runs_the_experts_the_variant_names(moe_model, variant, switch, monkeypatch):
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", switch)
    for_training(variant, moe_model.train(), torch.device("cpu"), bf16=False)  # as the benchmark: training first
    path = for_encoding(variant, moe_model.eval(), bf16=False)
    packs = switch == "0" and cpu.has_packed()
    auto = "packed-loop" if packs else "grouped"
    want = {"moe-grouped": "grouped", "moe-loop": "packed-loop" if packs else "loop"}.get(variant, auto)
    assert path == want
    assert all(type(m) is EXPECTED[want] for m in experts_of(moe_model))
    grouped = calls_of(monkeypatch, torch, "_grouped_mm")
    ran_parts = calls_of(monkeypatch, PackedExperts, "parts")
    moe_model.encode(["a short text", "another, somewhat longer text"])
    assert bool(grouped) == (want == "grouped") and bool(ran_parts) == (want == "packed-loop")
    rows = [m.row_multiple for m in experts_of(moe_model) if isinstance(m, (GroupedExperts, PackedExperts))]
    assert rows == ([1] * len(rows) if variant == "moe-unpadded" else [32] * len(rows))


def test_dense_models_train_and_encode_without_experts(make_tiny):
    dense = make_tiny("bert")
    assert for_training("dense", dense.train(), torch.device("cpu"), bf16=False) == ""
    assert for_encoding("dense", dense.eval(), bf16=False) == ""
