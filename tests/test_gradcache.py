"""GradCache parity: cached and plain steps give the same losses and parameter gradients (dense and MoE,
Matryoshka, hard negatives, symmetric loss, auxiliary losses; float64, and float32 with the CPU fast path switched
on), and chunks replay their RNG (dropout, jitter)."""

from __future__ import annotations

import pytest
import torch

from moembed.losses.cached import Encoded, cached_backward, split_batch
from moembed.losses.config import LossConfig
from moembed.losses.contrastive import false_negative_mask, matryoshka_info_nce, sequence_ids
from moembed.losses.moe_aux import load_balancing_loss, router_z_loss
from moembed.model.config import MoEConfig
from moembed.train.step import contrastive_step
from spy import calls_of

QUERIES = [
    "how do cats purr", "boiling point of water", "who wrote hamlet", "largest desert on earth",
    "speed of light in vacuum", "why is the sky blue",
]
DOCUMENTS = [
    "Cats purr by vibrating the muscles of the larynx.", "Water boils at 100 degrees Celsius at sea level.",
    "Hamlet is a tragedy written by William Shakespeare.", "Cats purr by vibrating the muscles of the larynx.",
    "Light travels at about 300,000 kilometres per second.", "Rayleigh scattering makes the sky look blue.",
]
NEGATIVES = [f"unrelated passage number {i} about {w}" for i, w in enumerate(["tea", "rivers", "chess"] * 4)]

LOSS = LossConfig(
    temperature=0.05, num_hard_negatives=2, symmetric=True, matryoshka_dims=[32, 8], matryoshka_weights=[1.0, 0.5],
    aux_loss_coef=1.0, z_loss_coef=0.1,
)


def _batches(model):
    tok = model.tokenizer
    return tok(QUERIES), tok(DOCUMENTS), tok(NEGATIVES)


def _run(model, chunk_size, loss=LOSS):
    model.zero_grad()
    result = contrastive_step(model, *_batches(model), loss, chunk_size=chunk_size)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return result, grads


def _assert_same(a, b, tol=1e-5):
    (ra, ga), (rb, gb) = a, b
    for key in ("loss", "contrastive", "aux", "z"):
        assert getattr(ra, key) == pytest.approx(getattr(rb, key), abs=tol), key
    assert ra.per_dim.keys() == rb.per_dim.keys() == {32, 8}
    for m in ra.per_dim:
        assert ra.per_dim[m] == pytest.approx(rb.per_dim[m], abs=tol)
    assert ga.keys() == gb.keys()
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=tol, rtol=0), name


@pytest.mark.parametrize("moe", [None, MoEConfig(num_experts=4, top_k=2)], ids=["dense", "moe"])
def test_cached_equals_plain(make_tiny, moe):
    model = make_tiny(moe=moe, hidden_dropout=0.0, attention_dropout=0.0).double().train()
    plain = _run(model, None)
    _assert_same(plain, _run(model, 4))  # chunks of 4: a ragged last chunk for the 6 queries and documents
    result, grads = plain
    assert result.num_queries == 6
    assert len(grads) == len(list(model.parameters())) and all(g.abs().max() > 0 for g in grads.values())
    if moe is not None:
        assert result.aux > 0 and result.z > 0
        assert len(result.expert_counts) == 1 and result.expert_counts[0].sum() > 0
        router = [g for n, g in grads.items() if "router" in n]
        assert router and all(g.abs().max() > 0 for g in router)


@pytest.mark.parametrize("moe", [None, MoEConfig(num_experts=4, top_k=2)], ids=["dense", "moe"])
def test_cached_equals_plain_in_float32_with_the_cpu_fast_path(make_tiny, moe, monkeypatch, one_torch_thread):
    """In float32 on CPU with the oneDNN fast path swapped in (the "fast" backend), GradCache's no-grad pass is a
    training pass: it runs the plain kernels (packing weights that the optimizer changes every step would cost more
    than it saves), so the cached and replayed embeddings agree and loss and gradients match the plain step. The same
    model in eval mode under no_grad does take the packed path, so the swap is live in this test."""
    import moembed.model.fast.experts as fast_experts
    import moembed.model.fast.packed as fast_packed
    from moembed.model import backends
    from moembed.model.fast.experts import PackedExperts
    from moembed.model.fast.packed import PackedLinear
    from moembed.model.settings import Settings

    if not Settings("on").packing():
        pytest.skip("this torch build has no oneDNN packed linear")
    model = make_tiny(moe=moe, hidden_dropout=0.0, attention_dropout=0.0).train()
    backend = backends.use(model, "fast")  # packing on, whatever this CPU's default
    assert backend.path("linear") == "packed" and any(isinstance(m, PackedLinear) for m in model.modules())
    assert (moe is None) != any(isinstance(m, PackedExperts) for m in model.modules())
    packed = [calls_of(monkeypatch, owner, name) for owner in (fast_packed, fast_experts)
              for name in ("pack", "packed_linear")]
    assert next(model.parameters()).dtype == torch.float32
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2):  # the second time after an optimizer step
        plain = _run(model, None)
        cached = _run(model, 4)
        assert not any(packed)  # training passes, with or without grad: plain kernels
        _assert_same(plain, cached, tol=2e-5)
        assert all(g.abs().max() > 0 for g in plain[1].values())
        opt.step()
    model.eval()
    model.encode(QUERIES)
    assert all(packed[:2]) and (moe is None or all(packed[2:]))  # inference: the packed fast path ran


def test_aux_gradient_parity_alone(make_tiny):
    """With the contrastive term at zero weight the router gradient comes from the auxiliary losses only."""
    model = make_tiny(moe=MoEConfig(num_experts=4, top_k=2), hidden_dropout=0.0, attention_dropout=0.0).double()
    aux_only = LOSS.model_copy(update=dict(matryoshka_weights=[0.0, 0.0]))
    plain, cached = _run(model, None, aux_only), _run(model, 3, aux_only)
    _assert_same(plain, cached)
    assert plain[0].contrastive == 0.0 and plain[0].aux > 0
    router = [g for n, g in plain[1].items() if "router" in n]
    assert router and all(g.abs().max() > 0 for g in router)


def test_cached_aux_loss_uses_the_whole_batch_fractions(make_tiny, monkeypatch):
    """Under GradCache r_i of Eq. 1 comes from the counts of the no-grad pass over all chunks (no extra forward):
    the aux loss and its gradient equal the unchunked ones, whereas an aux loss computed chunk by chunk (r and p
    of each chunk, averaged) would not."""
    from moembed.train import step

    model = make_tiny(moe=MoEConfig(num_experts=4, top_k=2), hidden_dropout=0.0, attention_dropout=0.0).double()
    aux_only = LOSS.model_copy(update=dict(matryoshka_weights=[0.0, 0.0], z_loss_coef=0.0))
    seen, routed = [], []
    real = step.load_balancing_loss

    def spy(*args, **kwargs):
        seen.append(kwargs["fractions"])
        return real(*args, **kwargs)

    monkeypatch.setattr(step, "load_balancing_loss", spy)
    model.encoder.layers[1].mlp.register_forward_hook(lambda m, i, o: routed.append(o[1].shape[0]))

    plain = _run(model, None, aux_only)
    routed.clear()
    cached = _run(model, 2, aux_only)
    _assert_same(plain, cached, tol=1e-6)
    chunks = [c for b in _batches(model) for c in split_batch(b, 2)]
    assert len(routed) == 2 * len(chunks)  # a no-grad pass and a replay per chunk, nothing more
    assert len(seen) == 2  # one aux loss per step, not per chunk ...
    torch.testing.assert_close(seen[1], seen[0], rtol=0, atol=0)  # ... on the fractions of the whole batch
    assert sum(routed[: len(chunks)]) * 2 == int(cached[0].expert_counts[0].sum())

    # Chunk by chunk, the same tokens give another loss gradient: the test above could fail.
    model.zero_grad()
    per_chunk = [model(c.input_ids, c.attention_mask, c.token_type_ids).encoder.router_logits for c in chunks]
    torch.stack([real(z, 2) for z in per_chunk]).mean().backward()
    router = next(n for n in plain[1] if "router" in n)
    gap = (dict(model.named_parameters())[router].grad - plain[1][router]).abs().max()
    assert gap > 1e-4, gap


def _reference_chunked(model, batches, chunk_size, loss):
    """Plain autograd through the same chunks in the same order: what GradCache must reproduce with dropout on."""
    outs = [[model(c.input_ids, c.attention_mask, c.token_type_ids) for c in split_batch(b, chunk_size)] for b in batches]
    q, d, n = (torch.cat([o.embeddings for o in group]) for group in outs)
    flat = [o for group in outs for o in group]
    logits = tuple(torch.cat([o.encoder.router_logits[l] for o in flat]) for l in range(len(flat[0].encoder.router_logits)))
    ids = torch.cat([sequence_ids(b.input_ids, b.attention_mask) for b in batches[1:]])
    mask = false_negative_mask(ids, torch.arange(len(q)))
    contrastive, _ = matryoshka_info_nce(
        q, torch.cat([d, n]), torch.arange(len(q)), loss.temperature, loss.matryoshka_dims, loss.matryoshka_weights,
        loss.symmetric, mask,
    )
    total = contrastive + loss.aux_loss_coef * load_balancing_loss(logits, 2) + loss.z_loss_coef * router_z_loss(logits)
    total.backward()
    return total.item()


def test_dropout_and_router_jitter_are_replayed(make_tiny):
    moe = MoEConfig(num_experts=4, top_k=2, router_jitter=0.1)
    model = make_tiny(moe=moe, hidden_dropout=0.2, attention_dropout=0.2).double().train()
    batches = _batches(model)

    torch.manual_seed(123)
    reference = _reference_chunked(model, batches, 4, LOSS)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    torch.manual_seed(123)
    model.zero_grad()
    cached = contrastive_step(model, *batches, LOSS, chunk_size=4)
    assert cached.loss == pytest.approx(reference, abs=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[name], atol=1e-5, rtol=0), name

    # Dropout is really active: a different seed gives different gradients.
    torch.manual_seed(321)
    model.zero_grad()
    contrastive_step(model, *batches, LOSS, chunk_size=4)
    assert any(not torch.allclose(p.grad, ref_grads[n], atol=1e-5) for n, p in model.named_parameters())


def test_cached_backward_generic_objective():
    """cached_backward on a toy linear 'encoder': gradients equal one big forward/backward."""
    from moembed.model.tokenizer import Batch

    torch.manual_seed(0)
    table = torch.nn.Embedding(50, 6).double()
    ids = torch.randint(1, 50, (7, 5))
    batch = Batch(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros_like(ids), 0)

    def forward(b):
        return table(b.input_ids).mean(1), (), ()

    def objective(enc: Encoded):
        e = enc.embeddings[0]
        return (e @ e.T).logsumexp(-1).mean(), None

    objective(Encoded([forward(batch)[0]], (), ()))[0].backward()
    plain = table.weight.grad.clone()
    table.weight.grad = None
    cached_backward(forward, [batch], objective, 3, torch.device("cpu"))
    assert torch.allclose(table.weight.grad, plain, atol=1e-12)


def test_bad_shapes_name_the_key(make_tiny):
    from moembed.errors import MoembedError

    model = make_tiny()
    q, d, n = _batches(model)
    with pytest.raises(MoembedError, match="num_hard_negatives"):
        contrastive_step(model, q, d, None, LOSS)
    with pytest.raises(MoembedError, match="chunk_size"):
        contrastive_step(model, q, d, n, LOSS, chunk_size=0)
    with pytest.raises(MoembedError, match="doc_ids"):
        contrastive_step(model, q, d, n, LOSS, doc_ids=["only one"])
