"""InfoNCE, false-negative masking and Matryoshka against hand-written references; loss config validation."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from moembed.errors import MoembedError
from moembed.losses.config import LossConfig
from moembed.losses.contrastive import (
    false_negative_mask,
    info_nce,
    matryoshka_info_nce,
    sequence_ids,
    text_ids,
)


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def _reference(q, docs, positive, tau, masked=frozenset()):
    """-1/B Σ_i log softmax_i[positive_i] over the columns not in `masked` (pairs (i, j)), in plain Python."""
    total = 0.0
    for i, qi in enumerate(q):
        logits = {j: _cos(qi, dj) / tau for j, dj in enumerate(docs) if (i, j) not in masked}
        log_z = math.log(sum(math.exp(v) for v in logits.values()))
        total += log_z - logits[positive[i]]
    return total / len(q)


def _tiny(seed=0, B=3, H=2, d=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, d, generator=g, dtype=torch.float64)
    docs = torch.randn(B + B * H, d, generator=g, dtype=torch.float64)  # positives, then negatives query by query
    return q, docs


def test_info_nce_matches_reference_with_hard_negatives():
    q, docs = _tiny()
    tau = 0.05
    got = info_nce(q, docs, torch.arange(3), tau)
    assert got.item() == pytest.approx(_reference(q.tolist(), docs.tolist(), [0, 1, 2], tau), rel=1e-12)
    # scale = 1/τ on cosines: the loss ignores embedding norms
    assert info_nce(3 * q, 0.5 * docs, torch.arange(3), tau).item() == pytest.approx(got.item(), rel=1e-12)


def test_symmetric_adds_document_to_query_term():
    q, docs = _tiny(seed=1, H=1)
    tau = 0.1
    forward = _reference(q.tolist(), docs.tolist(), [0, 1, 2], tau)
    backward = _reference(docs[:3].tolist(), q.tolist(), [0, 1, 2], tau)  # each positive picks out its query
    got = info_nce(q, docs, torch.arange(3), tau, symmetric=True)
    assert got.item() == pytest.approx((forward + backward) / 2, rel=1e-12)


def test_false_negative_mask_from_document_identity():
    # positives of queries 0 and 2 are the same text; the hard negative of query 1 repeats query 1's positive
    texts = ["a cat", "a dog", "a cat", "a bird", "a dog", "a fish"]
    ids = text_ids(texts)
    mask = false_negative_mask(ids, torch.arange(3))
    expected = torch.zeros(3, 6, dtype=torch.bool)
    expected[0, 2] = expected[2, 0] = expected[1, 4] = True
    assert torch.equal(mask, expected)

    q, docs = _tiny(seed=2, H=1)
    tau = 0.05
    masked = {(0, 2), (2, 0), (1, 4)}
    got = info_nce(q, docs, torch.arange(3), tau, false_negative_mask=mask)
    assert got.item() == pytest.approx(_reference(q.tolist(), docs.tolist(), [0, 1, 2], tau, masked), rel=1e-12)
    assert got.item() < info_nce(q, docs, torch.arange(3), tau).item()  # fewer negatives, lower loss


def test_symmetric_term_masks_duplicate_queries_positives():
    q, docs = _tiny(seed=3, H=0)
    ids = torch.tensor([7, 8, 7])  # queries 0 and 2 share their positive document
    mask = false_negative_mask(ids, torch.arange(3))
    tau = 0.1
    masked = {(0, 2), (2, 0)}
    forward = _reference(q.tolist(), docs.tolist(), [0, 1, 2], tau, masked)
    backward = _reference(docs.tolist(), q.tolist(), [0, 1, 2], tau, masked)
    got = info_nce(q, docs, torch.arange(3), tau, symmetric=True, false_negative_mask=mask)
    assert got.item() == pytest.approx((forward + backward) / 2, rel=1e-12)


def test_identities_are_stable_and_ignore_padding():
    assert torch.equal(text_ids(["x", "y", "x"]), text_ids(["x", "y", "x"]))
    a = text_ids(["x", "y", "x"])
    assert a[0] == a[2] and a[0] != a[1]
    ids = torch.tensor([[101, 5, 6, 102, 0], [101, 5, 6, 102, 0], [101, 5, 7, 102, 0]])
    mask = ids != 0
    s = sequence_ids(ids, mask)
    s_trimmed = sequence_ids(ids[:, :4], mask[:, :4])
    assert torch.equal(s, s_trimmed)
    assert s[0] == s[1] and s[0] != s[2]


def test_matryoshka_is_weighted_sum_of_renormalised_prefixes():
    q, docs = _tiny(seed=4, d=8)
    tau = 0.05
    total, per_dim = matryoshka_info_nce(q, docs, torch.arange(3), tau, dims=[8, 2], weights=[1.0, 0.5])
    ref8 = _reference(q.tolist(), docs.tolist(), [0, 1, 2], tau)
    ref2 = _reference(q[:, :2].tolist(), docs[:, :2].tolist(), [0, 1, 2], tau)
    assert per_dim[8].item() == pytest.approx(ref8, rel=1e-12)
    assert per_dim[2].item() == pytest.approx(ref2, rel=1e-12)
    assert total.item() == pytest.approx(ref8 + 0.5 * ref2, rel=1e-12)
    only_full, _ = matryoshka_info_nce(q, docs, torch.arange(3), tau)
    assert only_full.item() == pytest.approx(ref8, rel=1e-12)
    with pytest.raises(MoembedError, match="matryoshka_dims"):
        matryoshka_info_nce(q, docs, torch.arange(3), tau, dims=[16])


def test_matryoshka_gradients_reach_only_the_prefix_through_small_dims():
    q, docs = _tiny(seed=5, d=8)
    q.requires_grad_()
    total, _ = matryoshka_info_nce(q, docs, torch.arange(3), 0.05, dims=[2])
    total.backward()
    assert q.grad[:, 2:].abs().max() == 0 and q.grad[:, :2].abs().max() > 0


def test_bf16_embeddings_are_scored_in_float32():
    q, docs = _tiny(seed=6)
    loss = info_nce(q.bfloat16(), docs.bfloat16(), torch.arange(3), 0.02)
    assert loss.dtype == torch.float32


def test_loss_config_validation_names_the_key():
    cfg = LossConfig(matryoshka_dims=[768, 256])
    assert cfg.dims_and_weights(768) == ([768, 256], [1.0, 1.0])
    assert LossConfig().dims_and_weights(384) == ([384], [1.0])
    with pytest.raises(ValidationError, match="matryoshka_weights"):
        LossConfig(matryoshka_dims=[768, 256], matryoshka_weights=[1.0])
    with pytest.raises(ValidationError, match="temperature"):
        LossConfig(temperature=0.0)
    with pytest.raises(ValidationError, match="num_hard_negatives"):
        LossConfig(num_hard_negatives=-1)
    with pytest.raises(ValidationError, match="scale"):
        LossConfig(scale=20.0)
    with pytest.raises(ValidationError, match="matryoshka_dims"):
        LossConfig(matryoshka_dims=[0])
