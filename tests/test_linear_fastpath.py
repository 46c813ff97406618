"""The CPU inference fast path of `Linear` equals `F.linear`, and never runs where gradients are needed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moembed.model.linear import Linear, fastpath_enabled

pytestmark = pytest.mark.skipif(not fastpath_enabled(), reason="this torch build has no oneDNN packed linear")


@pytest.mark.parametrize("shape", [(7, 32), (3, 5, 32), (1, 32)])
def test_packed_equals_plain(shape):
    torch.manual_seed(0)
    lin = Linear(32, 48)
    x = torch.randn(*shape)
    with torch.inference_mode():
        fast = lin(x)
    torch.testing.assert_close(fast, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


def test_repacks_after_weight_update():
    lin = Linear(8, 8)
    x = torch.randn(4, 8)
    with torch.no_grad():
        lin(x)
        lin.weight.mul_(2.0)  # an optimizer step updates in place: the cache must notice
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


def test_training_uses_autograd_path(monkeypatch):
    lin = Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and x.grad is not None
    monkeypatch.setenv("MOEMBED_NO_FASTPATH", "1")
    assert not fastpath_enabled()
