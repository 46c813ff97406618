"""benchmarks/expert_gemm.py times like with like: the grouped matmul and the expert loop compute the same thing, and
the wide MLP does the same arithmetic on half as many rows (each token has two experts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from expert_gemm import grouped, loop, measure, operands, wide  # noqa: E402


def test_grouped_and_loop_agree_and_wide_matches_their_flops():
    from moembed.model.fast.experts import grouped_support

    if not grouped_support(torch.device("cpu"), torch.float32).usable:
        pytest.fail("torch._grouped_mm is unusable on this CPU: the benchmark's training path cannot be measured")
    torch.manual_seed(0)
    loads = [5, 0, 9, 2]  # uneven, one expert idle
    o = operands(loads, d=8, i=16, dtype=torch.float32, device=torch.device("cpu"))
    y = grouped(o)
    grads = [o[k].grad.clone() for k in ("x", "w1", "w2")]
    for k in ("x", "w1", "w2"):
        o[k].grad = None
    torch.testing.assert_close(loop(o), y)
    for k, g in zip(("x", "w1", "w2"), grads):
        torch.testing.assert_close(o[k].grad, g)
    assert wide(o).shape == (sum(loads) // 2, 8)
    # fc1 + fc2 multiply-adds: every assignment through one expert = every token through the twice-as-wide MLP
    experts = sum(loads) * (8 * 16 + 16 * 8)
    assert o["xw"].shape[0] * (8 * o["ww1"].shape[0] + o["ww2"].shape[1] * 8) == experts


def test_split_phases_compute_what_they_are_named_for():
    """--split's phases: `frozen` computes the input's gradient only, `forward` no gradient at all, and afterwards
    the operands are left as `step` needs them. (Each variant's run starts from cleared gradients, so the operands
    hold the last one's, the loop's: x, w1, w2.)"""
    torch.manual_seed(0)
    o = operands([3, 1, 4, 0], d=8, i=16, dtype=torch.float32, device=torch.device("cpu"))
    fns = {"wide": wide, "grouped": grouped, "loop": loop}
    med, paired = measure(fns, [o], "frozen", reps=1, device=torch.device("cpu"), j=1)
    assert set(med) == set(fns) and paired > 0
    assert o["x"].grad is not None and o["w1"].grad is None and o["w2"].grad is None
    measure(fns, [o], "forward", reps=1, device=torch.device("cpu"), j=1)
    assert o["x"].grad is None
    measure(fns, [o], "step", reps=1, device=torch.device("cpu"), j=1)
    assert all(o[k].grad is not None for k in ("x", "w1", "w2"))
