"""Sparse MoE blocks: dispatch parity, padding, aux losses, upcycling, I/O, utilisation, export and CLI."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from moembed.errors import MoembedError
from moembed.losses.moe_aux import load_balancing_loss, router_z_loss, routing_fractions
from moembed.model.config import EncoderConfig, MoEConfig
from moembed.model.encoder import Encoder, GeluMLP, SwiGLUMLP
from moembed.model import cpu, kernels
from moembed.model import backends
from moembed.model.settings import Settings, apply
from moembed.model.experts import Experts
from moembed.model.fast.experts import GroupedExperts, PackedExperts, grouped_support
from moembed.model.fast.moe import InPlaceMoEBlock
from moembed.model.moe import MoEBlock
from moembed.model.convert.upcycle import upcycle
from moembed.model.presets import nomic_v2_moe_base, tiny_config
from moembed.model.utilisation import format_report, from_output, probe, router_entropy
from moe_reference import use_blocks, use_reference
from spy import calls_of


def real_texts(n: int = 24) -> list[str]:
    """Question/answer lines of the installed chatterbot corpus (real English of mixed length)."""
    import chatterbot_corpus
    import yaml

    root = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    out = []
    for name in ("science.yml", "computers.yml", "history.yml"):
        for conv in yaml.safe_load((root / name).read_text(encoding="utf-8"))["conversations"]:
            out.extend(str(t) for t in conv)
    return out[:n]


def block_config(mlp: str = "gelu", bias: bool = True, **moe) -> EncoderConfig:
    moe = {"num_experts": 4, "top_k": 2, "every": 1, "offset": 0, **moe}
    return tiny_config("bert" if mlp == "gelu" else "nomic", bias=bias, moe=MoEConfig(**moe))


def kinds(module: torch.nn.Module) -> set[type]:
    """The classes of the expert sets of `module`."""
    return {type(m) for m in module.modules() if isinstance(m, Experts)}


def as_kind(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """`model` with its MoE blocks computed as `kind`: "reference" (the paper's sum, `moe_reference`), or its
    experts run as "loop" / "grouped" (`backends.use_experts`)."""
    if kind == "reference":
        return use_reference(model)
    return backends.use_experts(use_blocks(model), kind)


def grads(module: torch.nn.Module, x: torch.Tensor, out: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad()
    x.grad = None
    (out * g).sum().backward()
    res = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    res["x"] = x.grad.clone()
    return res


# ---- the block -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mlp,bias", [("gelu", True), ("swiglu", False)])
def test_one_expert_with_copied_weights_equals_dense(mlp, bias, monkeypatch):
    torch.manual_seed(0)
    cfg = block_config(mlp, bias, num_experts=1, top_k=1)
    dense = (GeluMLP if mlp == "gelu" else SwiGLUMLP)(cfg.hidden_size, cfg.intermediate_size, bias)
    moe = MoEBlock(cfg)
    with torch.no_grad():
        moe.experts.fc1_weight.copy_(dense.fc1.weight[None])
        moe.experts.fc2_weight.copy_(dense.fc2.weight[None])
        if bias:
            dense.fc1.bias.normal_()
            dense.fc2.bias.normal_()
            moe.experts.fc1_bias.copy_(dense.fc1.bias[None])
            moe.experts.fc2_bias.copy_(dense.fc2.bias[None])
    x = torch.randn(37, cfg.hidden_size, requires_grad=True)
    g = torch.randn(37, cfg.hidden_size)
    assert grouped_support(torch.device("cpu"), torch.float32).usable  # probed here, before the calls are counted
    grouped = calls_of(monkeypatch, torch, "_grouped_mm")
    for mode in ("grouped", "loop", "reference"):
        grouped.clear()
        moe = as_kind(moe, mode)
        y_moe, logits, counts = moe(x)
        assert bool(grouped) == (mode == "grouped")  # the path asked for is the one that ran
        torch.testing.assert_close(y_moe, dense(x), rtol=1e-5, atol=1e-6)
        assert logits.shape == (37, 1) and counts.tolist() == [37]
        gm, gd = grads(moe, x, y_moe, g), grads(dense, x, dense(x), g)
        torch.testing.assert_close(gm["x"], gd["x"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gm["experts.fc1_weight"][0], gd["fc1.weight"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gm["experts.fc2_weight"][0], gd["fc2.weight"], rtol=1e-5, atol=1e-6)
        if bias:
            torch.testing.assert_close(gm["experts.fc1_bias"][0], gd["fc1.bias"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("mlp,bias", [("gelu", True), ("swiglu", False)])
def test_grouped_and_loop_dispatch_equal_naive_reference_in_a_padded_batch(top_k, mlp, bias, monkeypatch):
    torch.manual_seed(1)
    cfg = block_config(mlp, bias, top_k=top_k).model_copy(update={"hidden_dropout": 0.0, "attention_dropout": 0.0})
    cfg = EncoderConfig(**cfg.model_dump())
    enc = Encoder(cfg)
    for blk in enc.modules():
        if isinstance(blk, MoEBlock) and bias:
            with torch.no_grad():
                blk.experts.fc1_bias.normal_()
                blk.experts.fc2_bias.normal_()
    ids = torch.randint(1, cfg.vocab_size, (3, 11))
    mask = torch.tensor([[1] * 11, [1] * 6 + [0] * 5, [1] * 2 + [0] * 9], dtype=torch.bool)
    g = torch.randn(3, 11, cfg.hidden_size)
    results = {}
    assert grouped_support(torch.device("cpu"), torch.float32).usable  # probed here, before the calls are counted
    grouped = calls_of(monkeypatch, torch, "_grouped_mm")
    for mode in ("reference", "loop", "grouped"):
        grouped.clear()
        as_kind(enc, mode)
        enc.zero_grad()
        out = enc(ids, mask)
        (out.last_hidden_state * g).sum().backward()
        assert len(grouped) == (4 if mode == "grouped" else 0)  # two matmuls in each of the two MoE layers
        results[mode] = (out, {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None})
    ref_out, ref_grads = results["reference"]
    assert sum(int(c.sum()) for c in ref_out.expert_counts) == 2 * int(mask.sum()) * top_k  # 2 MoE layers
    for mode in ("loop", "grouped"):
        out, gr = results[mode]
        torch.testing.assert_close(out.last_hidden_state, ref_out.last_hidden_state, rtol=1e-5, atol=1e-5)
        for a, b in zip(out.expert_counts, ref_out.expert_counts):
            assert torch.equal(a, b)
        assert gr.keys() == ref_grads.keys() and any("router" in k for k in gr)
        for k in gr:
            torch.testing.assert_close(gr[k], ref_grads[k], rtol=1e-4, atol=1e-5, msg=f"{mode}: grad of {k}")
    enc.eval()
    with torch.no_grad():  # inference takes the backend's paths (oneDNN-packed expert weights on CPU, where on)
        unpacked = GroupedExperts if grouped_support(torch.device("cpu"), torch.float32).preferred else Experts
        for name in ("fast", "torch"):  # packing on wherever the build has it; off
            use_blocks(enc)
            record = backends.use(enc, name)
            packed = Settings.for_backend(name).packing()
            expected = "packed-loop" if packed else "grouped" if unpacked is GroupedExperts else "loop"
            assert record.path("moe") == expected
            assert kinds(enc) == {PackedExperts if packed else unpacked}
            assert all(isinstance(m, InPlaceMoEBlock) == packed for m in enc.modules() if isinstance(m, MoEBlock))
            out = enc(ids, mask).last_hidden_state
            torch.testing.assert_close(out, ref_out.last_hidden_state, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_grouped_matches_loop(monkeypatch):
    torch.manual_seed(2)
    blk = MoEBlock(block_config("gelu", True, num_experts=8))
    x = torch.randn(64, 32)
    outs = {}
    assert grouped_support(torch.device("cpu"), torch.bfloat16).usable  # probed here, before the calls are counted
    grouped = calls_of(monkeypatch, torch, "_grouped_mm")
    for mode in ("grouped", "loop"):
        grouped.clear()
        backends.use_experts(blk, mode)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[mode] = blk(x)[0].float()
        assert len(grouped) == (2 if mode == "grouped" else 0)
    torch.testing.assert_close(outs["grouped"], outs["loop"], rtol=2e-2, atol=2e-2)
    assert outs["grouped"].abs().max() > 0


def test_bf16_grouped_training_pads_each_expert_and_keeps_values_and_gradients(monkeypatch):
    """On a CPU in bf16 the grouped matmuls run on slices padded to `row_multiple` rows (oneDNN makes a kernel per
    shape): the padded run gives the unpadded run's outputs and gradients, and its matmuls saw only whole multiples."""
    torch.manual_seed(4)
    blk = MoEBlock(block_config("gelu", True, num_experts=4, top_k=2))
    with torch.no_grad():
        blk.experts.fc1_bias.normal_()
        blk.experts.fc2_bias.normal_()
    backends.use_experts(blk, "grouped")
    x0 = torch.randn(37, 32)
    seen, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: seen.append(offs.tolist()) or real(a, b, offs=offs))

    def run(rows: int):
        blk.experts.row_multiple = rows
        blk.zero_grad()
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = blk(x)[0]
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        return y.float(), x.grad, blk.experts.fc1_weight.grad, blk.experts.fc2_bias.grad

    plain = run(1)
    assert any(o % 8 for offs in seen for o in offs)  # uneven slices (8: the smallest alignment _grouped_mm needs)
    seen.clear()
    padded = run(8)
    assert seen and all(o % 8 == 0 for offs in seen for o in offs)  # every slice padded to whole multiples
    assert seen[0][-1] > x0.shape[0] * 2  # padding rows were added
    for a, b in zip(padded, plain):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    blk.experts.row_multiple = 8
    assert blk.experts.grouped_rows(x0.bfloat16()) == 8 and blk.experts.grouped_rows(x0) == 1  # float32: never
    apply(blk, Settings("off"))
    assert blk.experts.grouped_rows(x0.bfloat16()) == 1  # every CPU fast path off


@pytest.mark.skipif(not Settings().bf16_packing(), reason="bf16 matmuls are emulated on this CPU (no AVX-512 BF16 / AMX)")
def test_bf16_inference_runs_packed_bf16_experts_independent_of_the_batch(monkeypatch):
    torch.manual_seed(3)
    model = torch.nn.Sequential(MoEBlock(block_config("gelu", True, num_experts=8))).eval()
    with torch.no_grad():
        model[0].experts.fc1_bias.normal_()
        model[0].experts.fc2_bias.normal_()
    x = torch.randn(45, 32)  # expert slices of a few rows each, padded to `row_multiple` inside
    ref = use_reference(model)[0]
    assert backends.use(use_blocks(model), "auto", torch.bfloat16).path("moe") == "packed-bf16-loop"
    blk, parts = model[0], calls_of(monkeypatch, PackedExperts, "parts")
    with torch.inference_mode():
        ref = ref(x)[0]  # float32 reference
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = blk(x)[0]
            assert len(parts) == 1 and blk.experts.dtype == torch.bfloat16
            alone = torch.cat([blk(x[i : i + 1])[0] for i in range(5)])
    torch.testing.assert_close(got.float(), ref, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(alone, got[:5], rtol=0, atol=1e-6)  # padding rows never reach a real row


@pytest.mark.parametrize("bf16,top_k", [(False, 2), (True, 2), (False, 3)])
def test_packed_inference_combines_in_place_and_matches_torch_ops(monkeypatch, bf16, top_k):
    """CPU inference on packed experts (float32; bf16 under autocast): one gather into padded slices, the experts'
    buffers combined by combine.c (the fast path ran), equal to the torch-ops combine and to the naive float32
    reference, output bias included, and a token's output the same alone as in its batch."""
    import contextlib

    if not (Settings("on").bf16_packing() if bf16 else Settings("on").packing()):
        pytest.skip("no oneDNN-packed kernels for this dtype on this CPU / torch build")
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    path, tol = ("packed-bf16-loop", 3e-2) if bf16 else ("packed-loop", 1e-5)

    torch.manual_seed(6)
    model = torch.nn.Sequential(MoEBlock(block_config("gelu", True, num_experts=8, top_k=top_k, output_bias=True)))
    model.eval()
    with torch.no_grad():
        for p in (model[0].experts.fc1_bias, model[0].experts.fc2_bias, model[0].output_bias):
            p.normal_()
    reference = use_reference(model)[0]
    # packed wherever this torch build has it, whatever this CPU's default
    assert backends.use(use_blocks(model), "fast", torch.bfloat16 if bf16 else None).path("moe") == path
    blk = model[0]
    assert isinstance(blk, InPlaceMoEBlock) and blk.compiled
    blk.experts.row_multiple = 8
    x = torch.randn(45, 32)
    calls = []

    assert kernels.available("combine"), f"combine.c was not built: {kernels.why_not('combine')}"
    combine_rows = kernels.combine_rows  # its calls counted
    monkeypatch.setattr(kernels, "combine_rows", lambda *a: calls.append(a[3].shape[0]) or combine_rows(*a))
    parts = calls_of(monkeypatch, PackedExperts, "parts")
    with torch.inference_mode():
        ref = reference(x)[0]
        with amp:
            got = blk(x)[0]
            assert len(parts) == 1 and calls == [45]
            alone = torch.cat([blk(x[i : i + 1])[0] for i in range(6)])
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(kernels, "available", lambda name: name != "combine")  # no C compiler: torch ops
                plain = InPlaceMoEBlock.from_plain(blk)(x)[0]  # decided when it is swapped in
            assert len(parts) == 8 and calls == [45] + [1] * 6
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(plain, got, rtol=tol, atol=tol)
    if bf16:  # combine.c sums the bf16 rows in float32, the torch ops in bf16
        assert (got - ref).abs().max() <= (plain - ref).abs().max()
    blk.experts.row_multiple = 1  # no padding (as benchmarks/moe.py's unpadded variant)
    with torch.inference_mode(), amp:
        unpadded = blk(x)[0]
    assert len(parts) == 9 and len(calls) == 8
    torch.testing.assert_close(unpadded, got, rtol=tol, atol=tol)
    # padding rows never reach a real row (the matmul kernels round by their row count: 5e-7 apart, as before)
    torch.testing.assert_close(alone, got[:6], rtol=0, atol=1e-6)


def test_padded_dispatch_gathers_each_copy_into_its_slice():
    torch.manual_seed(7)
    blk = MoEBlock(block_config("gelu", True, num_experts=4, top_k=2))
    x = torch.randn(13, 32)
    experts = blk.route(x).experts
    counts = torch.bincount(experts.flatten(), minlength=4)
    plain, padded = blk.dispatch(x, experts, counts), InPlaceMoEBlock.from_plain(blk).dispatch_padded(x, experts, counts, 8)
    assert padded.sizes == [-(-int(c) // 8) * 8 for c in plain.counts] and padded.tokens.shape[0] == sum(padded.sizes)
    assert torch.equal(padded.tokens[padded.at], plain.tokens)  # every copy where `at` says, in sorted order
    starts = [sum(padded.sizes[:e]) for e in range(4)]
    ends = [s + int(c) for s, c in zip(starts, plain.counts)]
    assert all(starts[e] <= int(a) < ends[e] for a, e in zip(padded.at, experts.flatten()[plain.source]))


def test_grouped_dispatch_falls_back_on_unaligned_shapes(monkeypatch):
    # torch._grouped_mm needs 16-byte strides; an intermediate size of 30 floats (120 bytes) takes the loop.
    torch.manual_seed(5)
    model = torch.nn.Sequential(MoEBlock(tiny_config(intermediate_size=30, moe=MoEConfig(num_experts=4, top_k=2))))
    x = torch.randn(25, 32, requires_grad=True)
    ref = use_reference(model)[0](x)[0]
    blk = backends.use_experts(use_blocks(model), "grouped")[0]
    assert grouped_support(torch.device("cpu"), torch.float32).usable  # probed here, before the calls are counted
    grouped, loop = calls_of(monkeypatch, torch, "_grouped_mm"), calls_of(monkeypatch, Experts, "forward")
    torch.testing.assert_close(blk(x)[0], ref, rtol=1e-5, atol=1e-6)
    assert isinstance(blk.experts, GroupedExperts) and not grouped and len(loop) == 1  # the loop ran


def test_routing_of_a_sequence_does_not_depend_on_padding(make_tiny):
    emb = make_tiny("bert", moe=MoEConfig(num_experts=4, top_k=2, every=1, offset=0))
    alone = emb.tokenizer(["sparse experts route tokens"])
    batch = emb.tokenizer(["sparse experts route tokens", "a much longer second text that forces padding on the first"])
    n = int(alone.attention_mask.sum())
    assert batch.attention_mask.shape[1] > n  # the first sequence is padded in the batch
    with torch.no_grad():
        a = emb.encoder(alone.input_ids, alone.attention_mask)
        b = emb.encoder(batch.input_ids, batch.attention_mask)
    for la, lb in zip(a.router_logits, b.router_logits):
        assert lb.shape[0] == int(batch.attention_mask.sum())  # only real tokens are routed
        torch.testing.assert_close(la, lb[:n], rtol=1e-5, atol=1e-6)
        assert torch.equal(la.topk(2).indices, lb[:n].topk(2).indices)


def test_capacity_factor_drops_overflow_and_equals_dropless_when_large():
    torch.manual_seed(3)
    cfg = block_config("gelu", True, num_experts=4, top_k=2)
    dropless = MoEBlock(cfg)
    big = MoEBlock(block_config("gelu", True, num_experts=4, top_k=2, capacity_factor=2.0))  # C = N: never full
    big.load_state_dict(dropless.state_dict())
    x = torch.randn(50, 32)
    torch.testing.assert_close(big(x)[0], dropless(x)[0], rtol=1e-5, atol=1e-6)

    small = MoEBlock(block_config("gelu", True, num_experts=4, top_k=1, capacity_factor=0.25))
    with torch.no_grad():
        small.router.weight.zero_()
        small.router.weight[0, 0] = 10.0  # tokens with x[:, 0] > 0 all pick expert 0
    x = torch.randn(40, 32)
    y, _, counts = small(x)
    C = small.capacity(40)
    assert C == math.ceil(0.25 * 40 / 4)
    chosen = (x[:, 0] > 0).nonzero().squeeze(1)
    assert counts[0] == len(chosen) > C  # counts report routing demand, before dropping
    kept, dropped = chosen[:C], chosen[C:]  # earlier tokens win the capacity
    assert torch.all(y[dropped] == 0) and torch.all(y[kept].abs().sum(1) > 0)


def test_capacity_factor_never_drops_at_inference(make_tiny):
    """A text's embedding must not depend on its batch: capacity (shared by the batch) applies in training only."""
    moe = MoEConfig(num_experts=4, top_k=2, every=1, offset=0, capacity_factor=0.5)  # C = N/4: half the assignments
    emb = make_tiny("bert", moe=moe, hidden_dropout=0.0, attention_dropout=0.0)
    dropless = make_tiny("bert", moe=moe.model_copy(update={"capacity_factor": None}))
    dropless.encoder.load_state_dict(emb.encoder.state_dict())
    short = "sparse experts route tokens"
    alone = emb.tokenizer([short])
    batch = emb.tokenizer(real_texts(12) + [short])  # the short text last: batch-mates come first in token order
    n = int(alone.attention_mask.sum())

    def hidden(model, b, row):
        return model.encoder(b.input_ids, b.attention_mask).last_hidden_state[row, :n]

    with torch.no_grad():
        ref = hidden(dropless, alone, 0)
        torch.testing.assert_close(hidden(emb, alone, 0), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden(emb, batch, -1), ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(emb.encode([short]), emb.encode(real_texts(12) + [short])[-1:], atol=1e-5)
        emb.train()  # training keeps the capacity: the batch-mates take the short text's slots
        assert (hidden(emb, batch, -1) - hidden(dropless, batch, -1)).abs().max() > 1e-2
    emb.eval()


def test_router_jitter_only_in_training():
    blk = MoEBlock(block_config("gelu", True, router_jitter=0.5)).eval()
    x = torch.randn(20, 32)
    torch.testing.assert_close(blk(x)[1], blk(x)[1])
    blk.train()
    assert not torch.allclose(blk(x)[1], blk(x)[1])


# ---- auxiliary losses ------------------------------------------------------------------------------------------


def test_load_balancing_loss_hand_computed():
    # 3 tokens, 2 experts, top-1. probs: [.8,.2], [.3,.7], [.6,.4] → picks 0, 1, 0 → r = [2/3, 1/3]
    probs = torch.tensor([[0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    logits = probs.log()
    p = torch.tensor([1.7 / 3, 1.3 / 3])
    expected = 0.5 * 2 * (2 / 3 * p[0] + 1 / 3 * p[1])
    torch.testing.assert_close(load_balancing_loss(logits, top_k=1, alpha=0.5), expected)
    # top-2 over 2 experts: every expert gets half of the assignments → L = α·E·Σ ½ p_i = α
    torch.testing.assert_close(load_balancing_loss(logits, top_k=2), torch.tensor(1.0))
    # averaged over layers
    torch.testing.assert_close(load_balancing_loss([logits, logits], top_k=1, alpha=0.5), expected)


def test_aux_losses_ignore_padding():
    torch.manual_seed(4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    padded = torch.randn(2, 4, 3)
    other = padded.clone()
    other[~mask] = torch.randn(int((~mask).sum()), 3) * 50  # garbage at padding must not matter
    packed = padded[mask]  # (5, 3)
    for fn in (lambda l, m: load_balancing_loss(l, 2, m), router_z_loss, router_entropy):
        ref = fn(packed, None)
        torch.testing.assert_close(fn(padded, mask), ref)
        torch.testing.assert_close(fn(other, mask), ref)
    assert not torch.allclose(router_z_loss(other.reshape(-1, 3)), router_z_loss(packed))


def test_router_z_loss_hand_computed():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    torch.testing.assert_close(router_z_loss(logits), torch.tensor(expected))


def test_aux_loss_gradient_reaches_router():
    blk = MoEBlock(block_config("gelu", True))
    _, logits, _ = blk(torch.randn(30, 32))
    load_balancing_loss(logits, top_k=2).backward()
    assert blk.router.weight.grad is not None and blk.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("top_k", [1, 2])
def test_load_balancing_loss_with_the_blocks_counts_as_fractions_is_unchanged(top_k):
    # The blocks' expert_counts are per-layer routing assignments (N·k of them): as `fractions` they give the
    # default loss and gradient bit for bit. Other fractions are really used: uniform ones give L = α exactly.
    torch.manual_seed(5)
    blocks = [MoEBlock(block_config(top_k=top_k)) for _ in range(2)]  # two MoE "layers"
    outs = [blk(torch.randn(40, 32)) for blk in blocks]
    logits = [o[1].detach().requires_grad_() for o in outs]  # (N, E) per layer
    counts = [o[2] for o in outs]  # (E,) per layer
    assert all(int(c.sum()) == 40 * top_k for c in counts)

    def loss_and_grads(**kw):
        for z in logits:
            z.grad = None
        loss = load_balancing_loss(logits, top_k, alpha=0.5, **kw)
        loss.backward()
        return loss.detach(), [z.grad.clone() for z in logits]

    default, default_grads = loss_and_grads()
    given, given_grads = loss_and_grads(fractions=routing_fractions(counts))
    assert torch.equal(given, default) and all(map(torch.equal, given_grads, default_grads))
    uniform, _ = loss_and_grads(fractions=[torch.full((4,), 0.25)] * 2)
    torch.testing.assert_close(uniform, torch.tensor(0.5))
    assert abs(float(default) - 0.5) > 1e-3  # the blocks' own routing is not uniform
    with pytest.raises(ValueError, match="fractions"):
        load_balancing_loss(logits, top_k, fractions=routing_fractions(counts[:1]))


def test_global_fractions_weighted_by_token_share_give_the_whole_batch_loss():
    # Two "ranks" of 10 and 30 tokens that route differently (rank 0 prefers expert 0, rank 1 expert 3).
    # With r counted over both and each rank's loss weighted by its token share N_ρ/N, the sum is the loss of the
    # concatenated batch, value and gradient (the equality in load_balancing_loss's docstring). The plain mean
    # of the rank losses is not (unequal counts), nor are per-rank fractions; with equal counts the mean is.
    torch.manual_seed(6)
    bias = torch.tensor([[3.0, 0.0, 0.0, 0.0]] * 10 + [[0.0, 0.0, 0.0, 3.0]] * 30)
    logits = (torch.randn(40, 4) + bias).requires_grad_()  # (N, E)
    whole = load_balancing_loss(logits, top_k=2)
    (whole_grad,) = torch.autograd.grad(whole, logits)

    def combined(sizes, weights, global_r=True):
        parts = logits.split(sizes)  # (N_ρ, E) per rank
        counts = sum(torch.bincount(z.topk(2, dim=-1).indices.flatten(), minlength=4) for z in parts)  # (E,)
        r = routing_fractions([counts]) if global_r else None
        loss = sum(w * load_balancing_loss(z, top_k=2, fractions=r) for w, z in zip(weights, parts))
        return loss, torch.autograd.grad(loss, logits)[0]

    loss, grad = combined([10, 30], [10 / 40, 30 / 40])  # Σ_ρ (N_ρ/N)·L_ρ
    torch.testing.assert_close(loss, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, whole_grad, rtol=0, atol=1e-6)
    mean, mean_grad = combined([10, 30], [0.5, 0.5])  # the plain mean over ranks
    assert abs(mean - whole) > 1e-3 and (mean_grad - whole_grad).abs().max() > 1e-3
    per_rank, per_rank_grad = combined([10, 30], [10 / 40, 30 / 40], global_r=False)
    assert abs(per_rank - whole) > 1e-3 and (per_rank_grad - whole_grad).abs().max() > 1e-3
    equal, equal_grad = combined([20, 20], [0.5, 0.5])  # equal counts: the plain mean is the global loss
    torch.testing.assert_close(equal, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(equal_grad, whole_grad, rtol=0, atol=1e-6)


# ---- upcycling -------------------------------------------------------------------------------------------------


@pytest.mark.real
def test_upcycled_minilm_reproduces_dense_embeddings(minilm):
    texts = real_texts(24)
    dense = minilm.encode(texts)
    for k in (2, 1):
        moe = upcycle(minilm, num_experts=8, top_k=k, every=2)
        assert moe.config.moe_layers() == [1, 3, 5]
        cos = (moe.encode(texts) * dense).sum(1)  # both L2-normalised
        assert cos.min() >= 0.99999, cos.min()
    noisy = upcycle(minilm, num_experts=8, top_k=2, every=2, noise=0.05, seed=1)
    experts = noisy.encoder.layers[1].mlp.experts.fc1_weight
    assert not torch.equal(experts[0], experts[1])
    assert 0.99 < (noisy.encode(texts) * dense).sum(1).min() < 0.99999


@pytest.mark.parametrize("family", ["bert", "nomic"])
def test_upcycle_sets_every_weight_and_draws_only_its_routers(make_tiny, monkeypatch, family):
    # Built without random initial values (Encoder.for_weights), the upcycled encoder must end up with the same bits
    # as one built with them: every weight is copied or drawn from the upcycle's own seeded generator.
    from moembed.model.encoder import Encoder

    dense = make_tiny(family, num_layers=4)
    state = torch.random.get_rng_state()
    fast = upcycle(dense, num_experts=4, top_k=2, every=2, noise=0.1, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)  # nothing drawn from the global generator
    monkeypatch.setattr(Encoder, "for_weights", classmethod(lambda cls, config: cls(config)))
    drawn = upcycle(dense, num_experts=4, top_k=2, every=2, noise=0.1, seed=5)
    a, b = fast.encoder.state_dict(), drawn.encoder.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_upcycle_copies_weights_and_without_renormalisation_differs(make_tiny):
    dense = make_tiny("nomic", num_layers=4)
    moe = upcycle(dense, num_experts=3, top_k=2, every=2, offset=0)
    assert moe.config.moe_layers() == [0, 2] and moe.config.mlp == "swiglu"
    w = dense.encoder.layers[2].mlp.fc1.weight
    assert torch.equal(moe.encoder.layers[2].mlp.experts.fc1_weight, w.expand(3, *w.shape))
    assert torch.equal(moe.encoder.layers[1].mlp.fc1.weight, dense.encoder.layers[1].mlp.fc1.weight)
    texts = ["one text", "and another, longer text"]
    assert (moe.encode(texts) * dense.encode(texts)).sum(1).min() >= 0.99999
    raw = upcycle(dense, num_experts=3, top_k=2, every=2, offset=0, renormalize=False)
    x = torch.randn(9, 32)
    with torch.no_grad():  # without renormalisation the block is the dense MLP scaled by the top-2 mass (< 1)
        y, logits, _ = raw.encoder.layers[0].mlp(x)
        mass = logits.softmax(-1).topk(2).values.sum(-1, keepdim=True)
        assert mass.max() < 1
        torch.testing.assert_close(y, dense.encoder.layers[0].mlp(x) * mass, rtol=1e-5, atol=1e-7)
    with pytest.raises(MoembedError, match="already has MoE"):
        upcycle(moe, 3, 2, 2)
    with pytest.raises(MoembedError, match="top_k"):
        upcycle(dense, num_experts=2, top_k=3, every=2)


def test_moe_model_save_load_round_trip(make_tiny, tmp_path):
    from moembed.model.embedder import Embedder

    moe = upcycle(make_tiny("bert"), num_experts=4, top_k=2, every=1, offset=0, noise=0.1)
    moe.save(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["encoder"]["moe"]["num_experts"] == 4 and cfg["encoder"]["moe"]["top_k"] == 2
    back = Embedder.load(tmp_path / "m")
    assert back.config == moe.config
    texts = ["mixture of experts", "routing tokens to experts in a sparse layer"]
    np.testing.assert_allclose(back.encode(texts), moe.encode(texts), rtol=1e-5, atol=1e-6)
    for k, v in moe.encoder.state_dict().items():
        assert torch.equal(back.encoder.state_dict()[k], v), k


# ---- utilisation and parameter counts -------------------------------------------------------------------------


def test_utilisation_report_sums(make_tiny):
    emb = make_tiny("bert", moe=MoEConfig(num_experts=4, top_k=2, every=1, offset=0))
    texts = real_texts(10)
    batch = emb.tokenizer(texts)
    with torch.no_grad():
        out = emb.encoder(batch.input_ids, batch.attention_mask)
    rows = from_output(out, emb.config.moe_layers())
    n = int(batch.attention_mask.sum())
    assert [r.layer for r in rows] == [0, 1]
    for r in rows:
        assert r.tokens == n and sum(r.counts) == 2 * n
        assert abs(sum(r.fractions) - 1) < 1e-9 and 0 <= r.entropy <= math.log(4) + 1e-6
    merged = probe(emb, texts, batch_size=3)  # several batches accumulate to the same counts
    for a, b in zip(merged, rows):
        assert a.counts == b.counts and a.tokens == b.tokens
        assert abs(a.entropy - b.entropy) < 1e-4
    assert len(format_report(rows)) == 2 and "router entropy" in format_report(rows)[0]


def test_count_parameters_of_nomic_v2_moe_shape():
    from moembed.cli.models import count_parameters

    # Nomic Embed v2 MoE (§4.3: 475M total, 305M active) has GELU MLPs with biases, as the XLM-R it comes from.
    cfg = nomic_v2_moe_base()
    with torch.device("meta"):
        enc = Encoder(cfg)
    total, active = count_parameters(types.SimpleNamespace(encoder=enc, config=cfg))
    assert abs(total - 475e6) < 1e6 and abs(active - 305e6) < 1e6, (total, active)
    # analytic check of the expert share: 6 MoE layers x 8 experts x (2·d·i + i + d), 2 of 8 active
    d, i = cfg.hidden_size, cfg.intermediate_size
    expert = 6 * 8 * (2 * d * i + i + d)
    assert total - active == expert - expert * 2 // 8


# ---- sentence-transformers export and CLI ----------------------------------------------------------------------


def test_sentence_transformers_export_of_moe_model(make_tiny, tmp_path):
    from sentence_transformers import SentenceTransformer

    from moembed.model.io import export_sentence_transformers

    emb = make_tiny("nomic", moe=MoEConfig(num_experts=4, top_k=2, every=1, offset=0))
    export_sentence_transformers(emb, tmp_path / "st")
    st = SentenceTransformer(str(tmp_path / "st"), trust_remote_code=True, device="cpu")
    texts = real_texts(8)
    a, b = st.encode(texts), emb.encode(texts)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() >= 0.99999
    q = st.encode(texts[:2], prompt_name="search_query")
    np.testing.assert_allclose(q, emb.encode(texts[:2], prompt_name="search_query"), rtol=1e-4, atol=1e-5)


def test_cli_upcycle_and_info_probe(make_tiny, tmp_path):
    from typer.testing import CliRunner

    from moembed.cli.main import app

    make_tiny("bert", num_layers=4).save(tmp_path / "dense")
    runner = CliRunner()
    res = runner.invoke(app, ["upcycle", str(tmp_path / "dense"), "--experts", "4", "--top-k", "2", "--every", "2",
                              "--out", str(tmp_path / "moe"), "--noise", "0.01"])
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "moe" / "config.json").read_text())["encoder"]["moe"]
    assert (cfg["num_experts"], cfg["top_k"], cfg["every"], cfg["offset"]) == (4, 2, 2, 1)
    probe_file = tmp_path / "probe.jsonl"
    probe_file.write_text("".join(json.dumps(t) + "\n" for t in real_texts(6)))
    res = runner.invoke(app, ["info", str(tmp_path / "moe"), "--probe", str(probe_file)])
    assert res.exit_code == 0, res.output
    assert "active per token" in res.output and "4 experts, top-2, layers [2, 4]" in res.output
    assert "layer 2:" in res.output and "layer 4:" in res.output and "router entropy" in res.output
    res = runner.invoke(app, ["upcycle", str(tmp_path / "moe"), "--out", str(tmp_path / "again")])
    assert isinstance(res.exception, MoembedError) and "already has MoE" in str(res.exception)
    res = runner.invoke(app, ["info", str(tmp_path / "dense"), "--probe", str(probe_file)])
    assert isinstance(res.exception, MoembedError) and "no MoE layers" in str(res.exception)
