"""Which MoE dispatch runs: torch._grouped_mm's capability is checked once, an unusable kernel falls back to the
expert loop (never an error), the experts a model is given (`GroupedExperts` or the plain loop) are in its backend
record (`moembed.model.backends`, logged once at load), and the bf16 copies
of the expert weights are made once per weight version with gradients that reach the float32 weights."""

from __future__ import annotations

import logging

import pytest
import torch

from moembed.model import backends
from moembed.model.config import MoEConfig
from moembed.model.experts import Experts
from moembed.model.fast import experts as experts_mod
from moembed.model.fast.experts import GroupedExperts, GroupedSupport, cuda_grouped_kernel, grouped_support
from moembed.model.moe import MoEBlock
from moembed.model.presets import tiny_config
from moe_reference import use_reference
from spy import calls_of


@pytest.fixture
def fresh_dispatch_state():
    """Forget the capability cache, before and after the test."""
    experts_mod._grouped_support.cache_clear()
    yield
    experts_mod._grouped_support.cache_clear()


def block(bias: bool = True, seed: int = 0) -> MoEBlock:
    torch.manual_seed(seed)
    blk = MoEBlock(tiny_config(bias=bias, moe=MoEConfig(num_experts=4, top_k=2)))
    if bias:
        with torch.no_grad():
            blk.experts.fc1_bias.normal_()
            blk.experts.fc2_bias.normal_()
    return blk


def grouped_calls(monkeypatch) -> list:
    """The calls of torch._grouped_mm from now on (the capability of CPU float32 and bf16 probed before)."""
    assert grouped_support(torch.device("cpu"), torch.float32).usable
    assert grouped_support(torch.device("cpu"), torch.bfloat16).usable
    return calls_of(monkeypatch, torch, "_grouped_mm")


def moe_record(blk: MoEBlock, caplog) -> backends.LayerPath:
    """The MoE entry of the backend record of a model holding `blk` (as `Embedder.load` makes and logs it)."""
    with caplog.at_level(logging.INFO, logger="moembed"):
        record = backends.use(torch.nn.Sequential(blk), "torch")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("backend torch")]
    assert f"moe {record.path('moe')} ({record.why('moe')})" in line
    return record._get("moe")


def test_grouped_runs_where_supported_and_is_recorded_once(fresh_dispatch_state, caplog, monkeypatch):
    assert grouped_support(torch.device("cpu"), torch.float32).usable  # torch 2.13 has CPU grouped matmuls
    blk = block()
    moe = moe_record(blk, caplog)
    assert moe.path == "grouped" and "grouped matmuls" in moe.why and isinstance(blk.experts, GroupedExperts)
    x = torch.randn(20, 32, requires_grad=True)
    calls = grouped_calls(monkeypatch)
    with caplog.at_level(logging.INFO, logger="moembed"):
        caplog.clear()
        for i in range(3):
            blk(x)[0].sum().backward()
            assert len(calls) == 2 * (i + 1)  # fc1 and fc2 of every expert, two grouped matmuls a pass
    assert not caplog.records  # the forward passes log nothing


def test_capability_probed_first_under_inference_mode_is_not_mistaken_for_unusable(fresh_dispatch_state,
                                                                                   monkeypatch):
    """The first MoE pass of a process is often an encode under inference_mode; the probe must still see the kernel
    (its own forward and backward run outside inference mode), or every later training pass would take the loop."""
    blk = backends.use_experts(block(), "grouped")
    with torch.inference_mode():
        assert grouped_support(torch.device("cpu"), torch.bfloat16).usable
        calls = calls_of(monkeypatch, torch, "_grouped_mm")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            blk(torch.randn(16, 32))
        assert len(calls) == 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        blk(torch.randn(16, 32, requires_grad=True))[0].float().sum().backward()
    assert len(calls) == 4


@pytest.mark.parametrize("failure", ["raises", "absent"])
def test_unusable_grouped_mm_falls_back_to_the_loop(fresh_dispatch_state, caplog, monkeypatch, failure):
    blk = block()
    x = torch.randn(25, 32, requires_grad=True)
    ref = use_reference(torch.nn.Sequential(blk))[0](x)[0]
    if failure == "raises":  # e.g. a GPU generation or dtype a torch release has no kernel for

        def broken(*args, **kwargs):
            raise RuntimeError("grouped gemm is not supported on this device")

        monkeypatch.setattr(torch, "_grouped_mm", broken)
    else:  # a torch release before the API existed
        monkeypatch.delattr(torch, "_grouped_mm")
    support = grouped_support(x.device, x.dtype)
    assert not support.usable
    loop = calls_of(monkeypatch, Experts, "forward")
    backends.use_experts(blk, "grouped")  # asked for, it takes the loop
    y = blk(x)[0]
    assert len(loop) == 1
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    moe = moe_record(blk, caplog)  # a loaded model gets the plain loop
    assert type(blk.experts) is Experts
    why = moe.why
    assert moe.path == "loop" and "expert loop instead of grouped matmuls" in why
    assert ("failed" in why) if failure == "raises" else ("has no torch._grouped_mm" in why)


def test_auto_takes_the_loop_where_grouped_is_not_the_faster_kernel(fresh_dispatch_state, monkeypatch, caplog):
    # As on a CUDA GPU before sm_90: the op works (torch loops over the groups) but brings nothing.
    monkeypatch.setattr(backends, "grouped_support", lambda device, dtype: GroupedSupport(True, False, "test"))
    blk = block()
    x = torch.randn(16, 32, requires_grad=True)
    assert moe_record(blk, caplog).path == "loop" and type(blk.experts) is Experts
    assert not backends.for_training(blk, torch.device("cpu"), torch.float32)  # nor does training take it
    calls = grouped_calls(monkeypatch)
    blk(x)
    assert not calls
    backends.use_experts(blk, "grouped")  # asked for explicitly, it still runs
    blk(x)
    assert len(calls) == 2


def test_cuda_grouped_kernel_needs_bf16_on_sm90_or_sm100():
    assert cuda_grouped_kernel((9, 0), torch.bfloat16) and cuda_grouped_kernel((10, 0), torch.bfloat16)
    assert not cuda_grouped_kernel((8, 0), torch.bfloat16)  # A100: torch's per-group fallback
    assert not cuda_grouped_kernel((8, 9), torch.bfloat16)
    assert not cuda_grouped_kernel((12, 0), torch.bfloat16)
    assert not cuda_grouped_kernel((9, 0), torch.float32)


def test_bf16_expert_weights_are_cast_once_per_version_and_gradients_reach_float32(monkeypatch):
    blk = backends.use_experts(block(), "grouped")
    x = torch.randn(24, 32)
    calls = grouped_calls(monkeypatch)

    def step():
        blk.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = blk(x)[0]
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        assert calls and calls.clear() is None  # the grouped matmuls ran
        return {n: p.grad.clone() for n, p in blk.named_parameters() if p.grad is not None}

    first = step()
    cast = blk.experts.weight_cache["cast"][1][0]
    second = step()
    assert blk.experts.weight_cache["cast"][1][0] is cast  # reused, not cast again
    for name, g in first.items():
        assert g.dtype == torch.float32 and torch.equal(g, second[name]), name
    blk.experts.weight_cache.clear()  # a fresh cast gives the same gradients
    for name, g in step().items():
        assert torch.equal(g, first[name]), name
    with torch.no_grad():  # an optimizer step bumps the version: the cast is made again
        blk.experts.fc1_weight.mul_(2.0)
    step()
    fresh = blk.experts.weight_cache["cast"][1][0]
    assert torch.equal(fresh, blk.experts.fc1_weight.detach().to(torch.bfloat16))


def test_a_fused_optimizer_step_renews_the_bf16_expert_casts(monkeypatch):
    """The trainer's fused AdamW writes the weights without bumping their versions; the next pass must still use
    the updated weights (a cast kept from step 1 would train every later step on the experts' first weights)."""
    blk = backends.use_experts(block(), "grouped")
    opt = torch.optim.AdamW(blk.parameters(), lr=1e-2, fused=True)
    x = torch.randn(24, 32)
    calls = grouped_calls(monkeypatch)

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = blk(x)[0]
        return (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()

    before = loss()
    before.backward()
    version = blk.experts.fc1_weight._version
    opt.step()
    assert blk.experts.fc1_weight._version == version, "torch's fused AdamW now bumps versions: test another way"
    with torch.no_grad():
        after = loss()
        assert calls  # the grouped matmuls ran
        blk.experts.weight_cache.clear()
        fresh = loss()  # cast again from the updated weights
    assert not torch.equal(after, before.detach())
    assert torch.equal(after, fresh)


def test_passes_of_a_step_share_one_cast_node_and_gradients_equal_separate_casts():
    """Three passes (queries, documents, negatives) share one cast node per expert weight: one backward casts their
    summed gradient back once. Gradients match casts made per pass, with one backward or one per pass (GradCache);
    a new weight version or a frozen weight gets a new node."""
    xs = [torch.randn(n, 32, generator=torch.Generator().manual_seed(n)) for n in (7, 12, 12)]

    def grads(blk, share: bool, backward_each: bool):
        blk.zero_grad()
        total = 0
        for x in xs:
            if not share:
                blk.experts.weight_cache.pop("cast-node", None)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = blk(x)[0]
            loss = (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()
            if backward_each:
                loss.backward()
            else:
                total = total + loss
        if not backward_each:
            total.backward()
        return {n: p.grad.clone() for n, p in blk.named_parameters() if p.grad is not None}

    blk = backends.use_experts(block(), "grouped")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nodes = blk.experts._weights_as(torch.bfloat16)
        assert blk.experts._weights_as(torch.bfloat16)[0] is nodes[0]  # one node while the version holds
    want = grads(blk, share=False, backward_each=False)
    for backward_each in (False, True):
        got = grads(blk, share=True, backward_each=backward_each)
        assert set(got) == set(want)
        for name, g in want.items():
            # the shared node sums the passes' gradients in bf16 before the cast (as autocast does for nn.Linear)
            assert torch.allclose(got[name], g, rtol=2e-2, atol=1e-2 * g.abs().max().item()), name
    with torch.no_grad():
        blk.experts.fc1_weight.mul_(1.0)  # a version bump (an optimizer step)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert blk.experts._weights_as(torch.bfloat16)[0] is not nodes[0]
    blk.experts.fc1_weight.requires_grad_(False)
    assert "experts.fc1_weight" not in grads(blk, share=True, backward_each=False)
    blk.experts.fc1_weight.requires_grad_(True)
    assert "experts.fc1_weight" in grads(blk, share=True, backward_each=False)


def test_the_capability_probe_draws_no_random_numbers(fresh_dispatch_state):
    # It runs at the first MoE pass of a process: a draw there would shift the dropout masks of a training run,
    # so that a resumed run (a new process, the generator restored) would not repeat the uninterrupted one.
    state = torch.get_rng_state()
    assert grouped_support(torch.device("cpu"), torch.float32).usable
    assert torch.equal(torch.get_rng_state(), state)
