"""Atomic checkpoints: full state round trip (weights, optimizer, scheduler, RNGs, data position), pruning."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from moembed.errors import MoembedError
from moembed.train.checkpoint import CheckpointManager, rng_state, set_rng_state
from moembed.train.config import OptimConfig
from moembed.train.optim import build_optimizer


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _train(model, opt, sched, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()


def test_rng_state_round_trip():
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    state = rng_state()
    first = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]


def test_save_restore_continues_identically(tmp_path):
    cfg = OptimConfig(lr=1e-2, schedule="cosine", warmup_steps=2)
    m1 = _model(0)
    o1, s1 = build_optimizer(m1, cfg, 20)
    _train(m1, o1, s1, 5)
    mgr = CheckpointManager(tmp_path / "ck", keep_last=2)
    data = {"sampler": {"x": 2**100}, "sources": {"a": {"offset": 17}}}
    path = mgr.save(5, m1, o1, s1, data)
    _train(m1, o1, s1, 4)  # the uninterrupted continuation (consumes the global RNG)

    m2 = _model(99)  # different weights, fresh optimizer: everything must come from the checkpoint
    o2, s2 = build_optimizer(m2, cfg, 20)
    r = mgr.load(path, m2, o2, s2)
    assert r.step == 5 and r.data_state == data
    assert s2.get_last_lr() == pytest.approx([g["lr"] for g in o2.param_groups])
    _train(m2, o2, s2, 4)
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)


def test_files_load_with_weights_only(tmp_path):
    m = _model(0)
    o, s = build_optimizer(m, OptimConfig(), 10)
    _train(m, o, s, 1)
    path = CheckpointManager(tmp_path).save(1, m, o, s, {})
    for f in ("optimizer.pt", "rng.pt"):
        torch.load(path / f, weights_only=True)
    assert sorted(p.name for p in path.iterdir()) == ["model.safetensors", "optimizer.pt", "rng.pt", "state.json"]


def test_keep_last_and_temporary_dirs_ignored(tmp_path):
    m = _model(0)
    o, s = build_optimizer(m, OptimConfig(), 10)
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, m, o, s, {})
    (tmp_path / ".step-00000004.abc.tmp").mkdir()  # what a kill during a save leaves behind
    assert [p.name for p in mgr.all()] == ["step-00000002", "step-00000003"]
    assert mgr.latest().name == "step-00000003"


def test_mismatched_checkpoint_is_refused(tmp_path):
    m = _model(0)
    o, s = build_optimizer(m, OptimConfig(), 10)
    path = CheckpointManager(tmp_path).save(1, m, o, s, {})
    other = nn.Sequential(nn.Linear(4, 8))
    o2, s2 = build_optimizer(other, OptimConfig(), 10)
    with pytest.raises(MoembedError, match="model.safetensors: does not match"):
        CheckpointManager(tmp_path).load(path, other, o2, s2)


def test_optimizer_is_fused_adamw_with_the_default_update():
    # The trainer's AdamW uses torch's fused kernel where it applies; its update must be the one the default
    # implementation computes (decay on matrices only), step after step.
    m_fused, m_ref = _model(3), _model(3)
    cfg = OptimConfig(weight_decay=0.1)
    opt, _ = build_optimizer(m_fused, cfg, 10)
    assert all(g["fused"] for g in opt.param_groups)
    ref = torch.optim.AdamW(
        [{"params": [p for p in m_ref.parameters() if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in m_ref.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=False,
    )
    for _ in range(5):
        x = torch.randn(3, 4)
        for m, o in ((m_fused, opt), (m_ref, ref)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for a, b in zip(m_fused.parameters(), m_ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not torch.equal(m_fused[0].weight, _model(3)[0].weight)  # the steps moved the weights


def _group_names(model: nn.Module) -> tuple[set[str], set[str]]:
    from moembed.train.optim import param_groups

    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    name = {id(p): n for n, p in model.named_parameters()}
    return {name[id(p)] for p in decay["params"]}, {name[id(p)] for p in no_decay["params"]}


def test_stacked_expert_and_move_biases_are_not_decayed():
    # The (E, r) / (E, d) expert biases and MoVE's (K, ·) b1 / b2 are 2-d but are biases, exempt like the dense
    # biases they came from; the stacked weight matrices are decayed.
    from moembed.model.config import MoEConfig, MoVEConfig
    from moembed.model.encoder import Encoder
    from moembed.model.presets import tiny_config

    moe = Encoder(tiny_config(moe=MoEConfig(num_experts=4, top_k=2)))
    decay, no_decay = _group_names(moe)
    assert {"layers.1.mlp.experts.fc1_bias", "layers.1.mlp.experts.fc2_bias", "layers.1.qkv.bias",
            "layers.1.norm1.weight", "layers.1.norm1.bias"} <= no_decay
    assert {"layers.1.mlp.experts.fc1_weight", "layers.1.mlp.experts.fc2_weight", "layers.1.mlp.router.weight",
            "layers.0.qkv.weight", "embeddings.word.weight"} <= decay
    assert all(moe.get_parameter(n).dim() >= 2 for n in decay)
    assert all("bias" in n or "norm" in n for n in no_decay)

    move = Encoder(tiny_config(vocab_size=50, move=MoVEConfig(base_vocab_size=20, num_experts=2, expert_dim=4,
                                                              max_pieces=3)))
    decay, no_decay = _group_names(move)
    assert {"embeddings.word.experts.b1", "embeddings.word.experts.b2"} <= no_decay
    assert {"embeddings.word.experts.w1", "embeddings.word.experts.w2", "embeddings.word.base.weight"} <= decay
    assert not {n for n in decay if n.endswith("bias")}


def test_routers_train_at_their_own_learning_rate():
    # router_lr_scale puts every MoE router (and no other weight) in a third group whose peak is lr · scale, on the
    # same schedule; AdamW's first step moves each weight with a gradient by its group's lr (|m̂ / √v̂| = 1).
    from moembed.model.config import MoEConfig
    from moembed.model.encoder import Encoder
    from moembed.model.presets import tiny_config

    torch.manual_seed(0)
    moe = Encoder(tiny_config(moe=MoEConfig(num_experts=4, top_k=2))).double()
    assert len(build_optimizer(moe, OptimConfig(), 10)[0].param_groups) == 2  # scale 1: the layout without it
    assert len(build_optimizer(_model(3), OptimConfig(router_lr_scale=20.0), 10)[0].param_groups) == 2  # no router
    cfg = OptimConfig(lr=1e-3, router_lr_scale=20.0, weight_decay=0.0, schedule="linear", warmup_steps=4)
    opt, sched = build_optimizer(moe, cfg, 10)
    name = {id(p): n for n, p in moe.named_parameters()}
    routers = {name[id(p)] for p in opt.param_groups[2]["params"]}
    assert routers == {n for n in name.values() if n.endswith("mlp.router.weight")} and routers
    assert not routers & {name[id(p)] for g in opt.param_groups[:2] for p in g["params"]}
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2.5e-4, 2.5e-4, 5e-3])  # warmup 1 of 4

    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    ids = torch.randint(5, 100, (4, 12))
    hidden = moe(ids, torch.ones_like(ids)).last_hidden_state  # layer-normed: a fixed projection, not its norm
    (hidden * torch.randn_like(hidden)).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    opt.step()
    sched.step()
    for n, p in moe.named_parameters():
        if n.endswith("router.weight") or n.endswith("experts.fc1_weight"):
            moved = (p.detach() - before[n])[grads[n].abs() > 1e-4].abs()  # |g| ≫ eps: a step of exactly lr
            assert moved.numel() > 0
            torch.testing.assert_close(moved, torch.full_like(moved, 5e-3 if n in routers else 2.5e-4), rtol=1e-3, atol=0)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 5e-4, 1e-2])  # warmup 2 of 4
    with pytest.raises(ValueError, match="router_lr_scale"):
        OptimConfig(router_lr_scale=0)
