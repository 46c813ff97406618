"""Upcycling that breaks the experts' symmetry, routing by selection bias, and the MoE diagnostics.

Virtual-group (fine-grained) upcycling must reproduce the dense model at step 0 and still give the router a
gradient from the task loss; plain copies give none. Diagnostics are checked against values computed by hand.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from moembed.errors import MoembedError
from moembed.losses.config import LossConfig
from moembed.losses.moe_aux import balance_bias_step
from moembed.model.config import MoEConfig
from moembed.model.convert.upcycle import expert_weights, upcycle
from moembed.model.diagnostics import diagnose, expert_divergence, mutual_information, router_grad_norms
from moembed.model.moe import MoEBlock
from moembed.model.presets import tiny_config
from moembed.train.loop import update_balance_biases
from moembed.train.step import contrastive_step
from test_moe import real_texts

INFONCE_ONLY = LossConfig(aux_loss_coef=0.0, z_loss_coef=0.0, num_hard_negatives=0)


def task_router_gradient(moe, texts: list[str]) -> list[float]:
    """Router gradient norms per MoE layer from InfoNCE alone on pairs (text 2i, text 2i+1), eval mode."""
    moe.eval()
    moe.zero_grad(set_to_none=True)
    contrastive_step(moe, moe.tokenizer(texts[0::2]), moe.tokenizer(texts[1::2]), None, INFONCE_ONLY)
    return router_grad_norms(moe)


# ---- virtual groups keep the dense function -------------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "nomic"])  # GELU with biases; SwiGLU without
def test_virtual_groups_reproduce_the_dense_model(make_tiny, family):
    dense = make_tiny(family, num_layers=2)
    texts = real_texts(12)
    ref = torch.as_tensor(dense.encode(texts, batch_size=5))
    for top_k in (4, 8):  # one group of 4 or both groups (renormalised gates over the groups)
        moe = upcycle(dense, num_experts=8, top_k=top_k, every=1, offset=0, granularity=4, seed=3)
        assert moe.config.moe.expert_size == dense.config.intermediate_size // 4
        assert moe.encoder.layers[0].mlp.experts.fc2_weight.shape[-1] == dense.config.intermediate_size // 4
        got = torch.as_tensor(moe.encode(texts, batch_size=5))
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=0)


def test_expert_weights_slice_and_scale_by_hand():
    # GELU MLP d=1, I=4: fc1 rows 1..4, fc2 columns 10..40; G=2, 4 experts (2 copies)
    mlp = {"fc1.weight": torch.tensor([[1.0], [2.0], [3.0], [4.0]]), "fc1.bias": torch.tensor([0.1, 0.2, 0.3, 0.4]),
           "fc2.weight": torch.tensor([[10.0, 20.0, 30.0, 40.0]]), "fc2.bias": torch.tensor([5.0])}
    w = expert_weights(mlp, 4, 2, swiglu=False)
    assert w["fc1_weight"][:, :, 0].tolist() == [[1, 2], [3, 4], [1, 2], [3, 4]]
    torch.testing.assert_close(w["fc1_bias"], torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.1, 0.2], [0.3, 0.4]]))
    assert w["fc2_weight"][:, 0].tolist() == [[20, 40], [60, 80], [20, 40], [60, 80]]  # ×G
    assert w["fc2_bias"].tolist() == [[5.0]] * 4
    # SwiGLU: fc1 rows [:I] up and [I:] gate are sliced in pairs
    sw = expert_weights({"fc1.weight": torch.arange(8.0)[:, None], "fc2.weight": torch.ones(1, 4)}, 2, 2, swiglu=True)
    assert sw["fc1_weight"][:, :, 0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_active_parameters_of_groups_equal_the_dense_model(make_tiny):
    from moembed.cli.models import count_parameters

    dense = make_tiny(num_layers=2)
    moe = upcycle(dense, num_experts=8, top_k=4, every=1, offset=0, granularity=4)
    d = dense.config.hidden_size
    # each of the 4 active experts holds the whole fc2 bias (d): 3·d more per layer than the dense MLP; router 8·d
    assert count_parameters(moe)[1] == count_parameters(dense)[1] + 2 * (3 * d + 8 * d)
    mlp = sum(p.numel() for n, p in dense.encoder.layers[0].mlp.named_parameters() if n != "fc2.bias")
    # total: two copies of the MLP's weights (and fc1 bias), eight fc2 biases, the router
    assert count_parameters(moe)[0] == count_parameters(dense)[0] + 2 * (mlp + 7 * d + 8 * d)


# ---- the router's gradient from the task loss -----------------------------------------------------------------


def test_task_loss_gives_copies_no_router_gradient_and_groups_noise_raw_gates_one(minilm_path):
    from moembed.model.embedder import Embedder

    dense = Embedder.load(minilm_path)
    texts = real_texts(16)
    copies = task_router_gradient(upcycle(dense, 8, 2, every=2), texts)
    groups = task_router_gradient(upcycle(dense, 8, 4, every=2, granularity=4), texts)
    # y = Σ g_j MLP(x) with Σ g_j = 1: zero analytically; what is left is float32 rounding (~1e-7)
    assert max(copies) < 1e-5
    assert min(groups) > 1e-2 and min(groups) > 1e4 * max(copies)
    # The study's controls copies-noise and copies-raw-gates: each breaks the copies' symmetry its own way
    noisy = upcycle(dense, 8, 2, every=2, noise=0.1, seed=0)
    raw = upcycle(dense, 8, 2, every=2, renormalize=False)
    # noise: the experts differ, so dy/dg_j differs between them; raw gates: Σ g_j < 1 scales the MLP by the router
    assert min(task_router_gradient(noisy, texts)) > 1e3 * max(copies)
    assert min(task_router_gradient(raw, texts)) > 1e3 * max(copies)
    reference = dense.encode(texts)
    assert 0.99 < (noisy.encode(texts) * reference).sum(1).min() < 0.9999  # near the dense function, not on it
    assert (raw.encode(texts) * reference).sum(1).min() < 0.99  # the MLPs scaled by about 2/8: far from it


def test_tied_rows_of_a_group_split_after_one_step(make_tiny):
    dense = make_tiny(num_layers=2)
    moe = upcycle(dense, 8, 4, every=1, offset=0, granularity=4, seed=1)
    router = moe.encoder.layers[0].mlp.router.weight
    assert torch.equal(router[0], router[3]) and not torch.equal(router[0], router[4])
    opt = torch.optim.SGD(moe.parameters(), lr=1.0)
    texts = real_texts(16)
    task_router_gradient(moe, texts)
    opt.step()
    assert (router[0] - router[1]).abs().max() > 0 and (router[4] - router[7]).abs().max() > 0


# ---- routing: ties and the selection bias ---------------------------------------------------------------------


def test_tied_logits_choose_whole_groups_in_index_order():
    torch.manual_seed(0)
    block = MoEBlock(tiny_config(moe=MoEConfig(num_experts=8, top_k=4, every=1, offset=0)))
    with torch.no_grad():
        block.router.weight.copy_(torch.randn(2, block.router.weight.shape[1]).repeat_interleave(4, dim=0))
    x = torch.randn(300, block.router.weight.shape[1])
    r = block.route(x)
    high = (r.logits[:, 4] > r.logits[:, 0]).long()  # (N,) which group has the higher logit
    assert torch.equal(r.experts, 4 * high[:, None] + torch.arange(4))  # the whole group, members in index order
    torch.testing.assert_close(r.gates, torch.full_like(r.gates, 0.25))
    with torch.no_grad():  # all logits tie: experts 0..k-1, every time
        block.router.weight.zero_()
    assert block.route(x).experts.unique(dim=0).tolist() == [[0, 1, 2, 3]]


def test_selection_bias_chooses_but_does_not_weigh():
    torch.manual_seed(0)
    block = MoEBlock(tiny_config(moe=MoEConfig(num_experts=4, top_k=1, every=1, offset=0, renormalize=False,
                                               balance_rate=0.1)))
    x = torch.randn(50, block.router.weight.shape[1])
    with torch.no_grad():
        block.balance_bias.copy_(torch.tensor([0.0, 0.0, 100.0, 0.0]))
    block.train()
    r = block.route(x)
    assert r.experts.eq(2).all()
    torch.testing.assert_close(r.gates[:, 0], r.logits.softmax(-1)[:, 2])  # the probability, without the bias
    assert block.balance_counts.tolist() == [0, 0, 50, 0]
    update_balance_biases([block])  # u · sign(mean load − load): mean 12.5
    assert block.balance_bias.tolist() == pytest.approx([0.1, 0.1, 99.9, 0.1])
    assert balance_bias_step(torch.tensor([3, 1, 2, 2]), 0.5).tolist() == [-0.5, 0.5, 0.0, 0.0]


def test_selection_bias_is_saved_with_the_model(make_tiny, tmp_path):
    from moembed.model.embedder import Embedder

    moe = upcycle(make_tiny(num_layers=2), 4, 2, every=1, offset=0, balance_rate=0.01)
    with torch.no_grad():
        moe.encoder.layers[0].mlp.balance_bias.copy_(torch.tensor([0.5, -0.5, 0.0, 1.0]))
    moe.save(tmp_path / "m")
    back = Embedder.load(tmp_path / "m")
    assert back.encoder.layers[0].mlp.balance_bias.tolist() == [0.5, -0.5, 0.0, 1.0]
    assert back.config.moe.balance_rate == 0.01


# ---- the other options ---------------------------------------------------------------------------------------


def test_reinit_redraws_the_given_ratio_of_hidden_units(make_tiny):
    dense = make_tiny(num_layers=2)
    moe = upcycle(dense, 4, 2, every=1, offset=0, reinit=0.25, seed=2)
    fc2 = moe.encoder.layers[0].mlp.experts.fc2_weight  # (E, d, I)
    ref = dense.encoder.layers[0].mlp.fc2.weight
    changed = (fc2 != ref).any(dim=1).sum(dim=1)  # (E,) hidden units whose fc2 column changed
    assert changed.tolist() == [round(0.25 * ref.shape[1])] * 4
    assert moe.calibration is None or moe.calibration == dense.calibration


def test_kmeans_router_rows_are_centroids_shared_by_a_group(make_tiny):
    dense = make_tiny(num_layers=2)
    texts = real_texts(60)
    moe = upcycle(dense, 8, 4, every=1, offset=0, granularity=4, router_init="kmeans", kmeans_texts=texts)
    router = moe.encoder.layers[0].mlp.router.weight
    assert torch.equal(router[0], router[3]) and not torch.allclose(router[0], router[4])
    # rows scaled so that the sampled tokens' logits have unit spread across the rows
    from moembed.model.convert.router_init import mlp_inputs

    x = mlp_inputs(dense, [0], texts)[0][0]
    logits = x @ router[::4].detach().T  # (N, 2)
    assert (logits - logits.mean(1, keepdim=True)).std().item() == pytest.approx(1.0, rel=1e-3)
    torch.testing.assert_close(torch.as_tensor(moe.encode(texts[:6])), torch.as_tensor(dense.encode(texts[:6])),
                               atol=2e-6, rtol=0)  # still the dense function


def digit_texts(n: int) -> list[str]:
    """Lines of digits: a second source whose tokens differ from English prose."""
    return [" ".join(str((7 * i + 3 * j) % 97) for j in range(4 + i % 9)) for i in range(n)]


def test_probe_is_the_regularised_logistic_regression():
    from moembed.model.convert.router_init import probe

    gen = torch.Generator().manual_seed(0)
    y = torch.arange(300) % 3
    x = torch.randn(300, 8, generator=gen) + 2.0 * torch.eye(3, 8)[y]  # (N, d): three clusters
    w = probe(x, y, torch.zeros(3, 8))
    w_req = w.clone().requires_grad_(True)
    objective = torch.nn.functional.cross_entropy(x @ w_req.T, y) + 1e-4 * w_req.pow(2).sum()
    (grad,) = torch.autograd.grad(objective, w_req)
    assert grad.abs().max() < 1e-4  # a stationary point of the convex objective: its minimum
    torch.testing.assert_close(w.sum(0), torch.zeros(8), atol=1e-5, rtol=0)  # centred over the rows
    torch.testing.assert_close(probe(x, y, torch.randn(3, 8, generator=gen)), w, atol=1e-3, rtol=1e-3)  # unique
    assert ((x @ w.T).argmax(1) == y).float().mean() > 0.8


def test_source_router_rows_route_each_source_to_its_own_group(make_tiny):
    from moembed.model.convert.router_init import mlp_inputs

    dense = make_tiny(num_layers=2)
    texts = [t for pair in zip(real_texts(40), digit_texts(40)) for t in pair]  # interleaved
    sources = ["prose", "digits"] * 40
    moe = upcycle(dense, 8, 4, every=1, offset=0, granularity=4, router_init="sources", kmeans_texts=texts,
                  text_sources=sources)
    states, owner = mlp_inputs(dense, [0, 1], texts)
    ids, _ = dense.token_ids(texts)
    assert torch.bincount(owner).tolist() == [len(x) for x in ids]  # every token owned by its own text
    digits = torch.tensor([s == "digits" for s in sources])[owner].long()  # (N,) per token
    for layer in (0, 1):
        router = moe.encoder.layers[layer].mlp.router.weight.detach()
        assert torch.equal(router[0], router[3]) and torch.equal(router[4], router[7])  # a group's rows tie
        x, r = states[layer].clone(), router[::4]  # one row per group (x out of inference mode)
        logits = x @ r.T  # (N, 2)
        assert (logits - logits.mean(1, keepdim=True)).std().item() == pytest.approx(1.0, rel=1e-3)
        if ((logits.argmax(1) == digits).float().mean() < 0.5):  # two sources, two groups, in k-means' order
            digits = 1 - digits
        # by hand: r is the minimiser of cross-entropy(x W^T, group) + 1e-4 ‖W‖², up to the scale s that gives unit
        # spread; find s along r (the objective is convex in s), then the whole gradient at s·r must vanish
        def gradient(scale):
            w = (scale * r).requires_grad_(True)
            objective = torch.nn.functional.cross_entropy(x @ w.T, digits) + 1e-4 * w.pow(2).sum()
            return torch.autograd.grad(objective, w)[0]

        lo, hi = 1e-3, 1e3
        for _ in range(100):  # bisection (in log scale) on the directional derivative
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if float((gradient(mid) * r).sum()) < 0 else (lo, mid)
        assert gradient(lo).abs().max() < 1e-3 * r.abs().max() * lo
        assert torch.allclose(r.sum(0), torch.zeros_like(r[0]), atol=1e-5)  # centred over the rows
    random_init = upcycle(dense, 8, 4, every=1, offset=0, granularity=4, seed=0)
    by_source = [r.mi_ratio for r in diagnose(moe, texts, sources)]
    by_chance = [r.mi_ratio for r in diagnose(random_init, texts, sources)]
    assert min(by_source) > 10 * max(by_chance), (by_source, by_chance)  # routing starts by source
    torch.testing.assert_close(torch.as_tensor(moe.encode(texts[:6])), torch.as_tensor(dense.encode(texts[:6])),
                               atol=2e-6, rtol=0)  # still the dense function


def test_copies_with_source_routers_route_by_source(make_tiny):
    """`copies-sources` in the study: granularity 1, so each source group is one expert; the copies keep the dense
    function whatever the routing (and give InfoNCE no router gradient: the test with minilm above), so routing
    starts by source and each expert's gradient comes from its sources' tokens."""
    dense = make_tiny(num_layers=2)
    texts = [t for pair in zip(real_texts(40), digit_texts(40)) for t in pair]
    sources = ["prose", "digits"] * 40
    moe = upcycle(dense, 2, 1, every=1, offset=0, router_init="sources", kmeans_texts=texts, text_sources=sources)
    random_init = upcycle(dense, 2, 1, every=1, offset=0, seed=0)
    by_source = [r.mi_ratio for r in diagnose(moe, texts, sources)]
    by_chance = [r.mi_ratio for r in diagnose(random_init, texts, sources)]
    assert min(by_source) > 10 * max(by_chance), (by_source, by_chance)  # routing starts by source
    torch.testing.assert_close(torch.as_tensor(moe.encode(texts[:6])), torch.as_tensor(dense.encode(texts[:6])),
                               atol=2e-6, rtol=0)


def test_source_router_init_is_checked(make_tiny):
    dense = make_tiny(num_layers=2)
    texts = real_texts(20)
    with pytest.raises(MoembedError, match="text_sources"):
        upcycle(dense, 8, 4, every=1, offset=0, granularity=4, router_init="sources", kmeans_texts=texts)
    with pytest.raises(MoembedError, match="19 sources for 20 texts"):
        upcycle(dense, 8, 4, every=1, offset=0, granularity=4, router_init="sources", kmeans_texts=texts,
                text_sources=["a"] * 19)
    with pytest.raises(MoembedError, match=r"tokens of 1 sources \(a\) for 2 router rows"):
        upcycle(dense, 8, 4, every=1, offset=0, granularity=4, router_init="sources", kmeans_texts=texts,
                text_sources=["a"] * 20)


def test_upcycle_options_are_checked(make_tiny):
    dense = make_tiny(num_layers=2)
    with pytest.raises(MoembedError, match="granularity 3"):
        upcycle(dense, 8, 4, every=1, granularity=3)
    with pytest.raises(MoembedError, match="reinit"):
        upcycle(dense, 8, 2, every=1, reinit=1.5)
    with pytest.raises(MoembedError, match="kmeans_texts"):
        upcycle(dense, 8, 2, every=1, router_init="kmeans")
    with pytest.raises(MoembedError, match="router_init 'centroids'; choose random, kmeans, sources"):
        upcycle(dense, 8, 2, every=1, router_init="centroids")


# ---- diagnostics against hand-computed values ----------------------------------------------------------------


def test_mutual_information_by_hand():
    assert mutual_information(torch.tensor([[2, 0], [0, 2]])) == pytest.approx((math.log(2), 1.0))
    assert mutual_information(torch.tensor([[1, 1], [1, 1]])) == pytest.approx((0.0, 0.0))
    # p(l,e) = 3/8, 1/8, 1/8, 3/8 with uniform marginals: 3/4·log(3/2) + 1/4·log(1/2)
    mi, ratio = mutual_information(torch.tensor([[3, 1], [1, 3]]))
    assert mi == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5))
    assert ratio == pytest.approx(mi / math.log(2))


def test_expert_divergence_by_hand():
    # two experts, weights (1, 0 | 2) and (3, 0 | 2): mean (2, 0 | 2), ‖W_e − W̄‖ = 1, ‖W̄‖ = √8
    fc1 = torch.tensor([[[1.0, 0.0]], [[3.0, 0.0]]])  # (E=2, r=1, d=2)
    fc2 = torch.tensor([[[2.0]], [[2.0]]])  # (E=2, d=1, i=1)
    assert expert_divergence(fc1, fc2) == pytest.approx([1 / math.sqrt(8)] * 2)
    assert expert_divergence(fc1[[0, 0]], fc2) == [0.0, 0.0]


def test_diagnose_on_a_tiny_model_by_hand(make_tiny):
    """Router zeroed: every token ties, so experts 0..k-1 take every token (index order); MI 0, divergence 0 for
    copies; the joint counts add up to tokens · k."""
    moe = upcycle(make_tiny(num_layers=2), 4, 2, every=1, offset=0)
    with torch.no_grad():
        for layer in moe.encoder.layers:
            layer.mlp.router.weight.zero_()
    texts = real_texts(10)
    rows = diagnose(moe, texts, labels=["a", "b"] * 5, batch_size=4)
    tokens = sum(len(x) for x in moe.token_ids(texts)[0])
    for r in rows:
        assert r.divergence == 0.0
        assert r.utilisation.counts == [tokens, tokens, 0, 0]
        assert r.utilisation.entropy == pytest.approx(math.log(4))
        assert r.mutual_information == pytest.approx(0.0, abs=1e-12)
    groups = upcycle(make_tiny(num_layers=2), 8, 4, every=1, offset=0, granularity=4)
    assert diagnose(groups, texts[:2])[0].divergence > 0.5  # slices differ from the start


def test_cli_upcycle_groups_and_info_probe_with_labels(tmp_path, tiny_dir):
    from typer.testing import CliRunner

    from moembed.cli.main import app

    runner = CliRunner()
    res = runner.invoke(app, ["upcycle", str(tiny_dir), "--out", str(tmp_path / "moe"), "--experts", "8",
                              "--top-k", "4", "--granularity", "4", "--every", "1", "--offset", "0"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["encoder"]["moe"]["expert_size"] == 16
    probe = tmp_path / "probe.jsonl"
    probe.write_text("".join(json.dumps({"text": t, "lang": "en" if i % 2 else "xx"}) + "\n"
                             for i, t in enumerate(real_texts(8))))
    res = runner.invoke(app, ["info", str(tmp_path / "moe"), "--probe", str(probe), "--label", "lang"])
    assert res.exit_code == 0, res.output
    assert "expert divergence" in res.output and "MI(expert; label)" in res.output
    res = runner.invoke(app, ["upcycle", str(tiny_dir), "--out", str(tmp_path / "bad"), "--granularity", "3"])
    assert isinstance(res.exception, MoembedError) and "granularity 3" in str(res.exception)
    probe.write_text(json.dumps({"text": "no label here"}) + "\n")
    res = runner.invoke(app, ["info", str(tmp_path / "moe"), "--probe", str(probe), "--label", "lang"])
    assert isinstance(res.exception, MoembedError) and f"{probe}:1" in str(res.exception) and "lang" in str(res.exception)


# ---- the quickstart's `upcycling:` keys --------------------------------------------------------------------------


def test_quickstart_upcycling_keys_reach_the_model(tmp_path, tiny_dir):
    from moembed.model.embedder import Embedder
    from moembed.recipes import training
    from moembed.recipes.config import load_quickstart_config
    from moembed.recipes.quickstart import Quickstart
    from moembed.recipes.report_text import upcycling

    (tmp_path / "qs.yaml").write_text("experts: 8\ntop_k: 4\nupcycling: {granularity: 4, balance_rate: 0.01}\n")
    cfg = load_quickstart_config(tmp_path / "qs.yaml")

    # a quickstart whose curate stage is done: the pool the upcycle stage draws its int8 calibration sample from
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "stages").mkdir()
    pairs = [{"query": f"query {i}", "document": f"document number {i}"} for i in range(8)]
    (out / "train" / "src.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (out / "stages" / "curate.json").write_text(json.dumps({"train_sources": ["src"]}))
    qs = Quickstart(cfg.model_copy(update={"base": str(tiny_dir), "device": "cpu"}), out, progress=False)
    training.upcycle(qs.ctx)
    moe = Embedder.load(tmp_path / "out" / "models" / "moe-init").config.moe
    assert (moe.num_experts, moe.top_k, moe.expert_size, moe.balance_rate) == (8, 4, 16, 0.01)
    assert upcycling(cfg) == ("8 experts, top-4, in 2 virtual groups of 4 slices each 1/4 of the MLP (He et al. "
                              "2024), renormalised gates, auxiliary-loss-free balancing, bias step 0.01")
    (tmp_path / "bad.yaml").write_text("upcycling: {granularity: 3}\n")
    with pytest.raises(MoembedError, match=r"upcycling.granularity \(3\) must divide experts \(8\)"):
        load_quickstart_config(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("upcycling: {router: kmeans}\n")
    with pytest.raises(MoembedError, match="upcycling.router"):
        load_quickstart_config(tmp_path / "bad.yaml")


@pytest.mark.parametrize("preset", ["english", "multilingual"])
def test_report_warning_quotes_the_measured_gap_of_its_preset(preset):
    from types import SimpleNamespace

    from moembed.recipes.config import RECIPE_PRESETS, load_quickstart_config
    from moembed.recipes.report_text import MEASURED_GAP, decisions

    assert set(MEASURED_GAP) == set(RECIPE_PRESETS)  # every recipe has its measured gap
    qs = SimpleNamespace(cfg=load_quickstart_config(None, preset))
    curate = {"train_sources": {"news": 1200}}
    if qs.cfg.pretrain:
        curate["pretrain_sources"] = {"news": 1500}
    warning = decisions(qs, {"curate": curate})["warning"]
    assert "1,200 training pairs" in warning and "benchmarks/moe_vs_dense.py" in warning
    # examples seen count both stages (30 × 64 + 60 × 32 in the multilingual recipe), as the study's pairs seen do
    assert {"english": "1,200 training pairs (3,840 examples seen in 120 steps)",
            "multilingual": "1,200 training pairs (1,500 in the pretraining pool; 3,840 examples seen in 30 pretraining "
                            "and 60 finetuning steps)"}[preset] in warning
    assert "1,000,000" not in warning  # no generic scale line: the measured gaps instead
    at, gaps, beyond = MEASURED_GAP[preset]
    assert f"default scale ({at})" in warning and beyond in warning
    for name, gap in gaps.items():
        (m, lo, hi), (dm, dlo, dhi) = gap.test, gap.dev
        quoted = f"{name} {m:+.2f} [{lo:+.2f}, {hi:+.2f}] / {dm:+.2f} [{dlo:+.2f}, {dhi:+.2f}] over {gap.seeds} seeds"
        assert quoted in warning
    other = MEASURED_GAP["multilingual" if preset == "english" else "english"][0]
    assert other not in warning  # the other recipe's scale is not quoted


def test_cli_upcycle_routers_by_source_from_labelled_texts(tmp_path, tiny_dir):
    from typer.testing import CliRunner

    from moembed.cli.main import app
    from moembed.model.embedder import Embedder

    runner = CliRunner()
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t, "lang": lang}) + "\n"
                             for pair in zip(real_texts(20), digit_texts(20)) for t, lang in zip(pair, ("en", "xx"))))
    args = ["upcycle", str(tiny_dir), "--experts", "8", "--top-k", "4", "--granularity", "4", "--every", "1",
            "--offset", "0", "--router-init", "sources", "--kmeans-texts", str(texts)]
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "moe"), "--label", "lang"])
    assert res.exit_code == 0, res.output
    assert "| `texts.jsonl` | 40 | 2 |" in (tmp_path / "moe" / "README.md").read_text()  # file, records, sources
    moe = Embedder.load(tmp_path / "moe")
    lines = [json.loads(x) for x in texts.read_text().splitlines()]
    by_source = diagnose(moe, [r["text"] for r in lines], [r["lang"] for r in lines])
    chance = upcycle(Embedder.load(tiny_dir), 8, 4, every=1, offset=0, granularity=4)
    by_chance = diagnose(chance, [r["text"] for r in lines], [r["lang"] for r in lines])
    assert min(r.mi_ratio for r in by_source) > 10 * max(r.mi_ratio for r in by_chance)
    # without --label the sources are unknown; a line without the key is named
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "bad")])
    assert isinstance(res.exception, MoembedError) and "--label" in str(res.exception)
    texts.write_text(json.dumps({"text": "no language"}) + "\n")
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "bad"), "--label", "lang"])
    assert isinstance(res.exception, MoembedError) and f"{texts}:1" in str(res.exception)
    assert not (tmp_path / "bad").exists()
    res = runner.invoke(app, ["upcycle", str(tiny_dir), "--out", str(tmp_path / "bad"), "--label", "lang"])
    assert isinstance(res.exception, MoembedError) and "--kmeans-texts" in str(res.exception)


def test_quickstart_routers_by_source_reach_the_model(tmp_path, tiny_dir):
    from moembed.model.embedder import Embedder
    from moembed.recipes import training
    from moembed.recipes.config import load_quickstart_config
    from moembed.recipes.quickstart import Quickstart
    from moembed.recipes.report_text import upcycling

    (tmp_path / "qs.yaml").write_text("experts: 8\ntop_k: 4\nupcycling: {granularity: 4, router_init: sources, "
                                      "kmeans_texts: 60}\n")
    cfg = load_quickstart_config(tmp_path / "qs.yaml")
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "stages").mkdir()
    for name, lines in (("prose", real_texts(30)), ("digits", digit_texts(30))):
        (out / "train" / f"{name}.jsonl").write_text(
            "".join(json.dumps({"query": q, "document": d}) + "\n" for q, d in zip(lines[::2], lines[1::2])))
    (out / "stages" / "curate.json").write_text(json.dumps({"train_sources": ["prose", "digits"]}))
    qs = Quickstart(cfg.model_copy(update={"base": str(tiny_dir), "device": "cpu"}), out, progress=False)
    sample = training.kmeans_texts(qs.ctx, 60)
    assert len(sample) == 60 and {s for _, s in sample} == {"prose", "digits"}
    assert all(t.split(": ", 1)[1] in digit_texts(30) for t, s in sample if s == "digits")  # each text's own source
    training.upcycle(qs.ctx)
    moe = Embedder.load(out / "models" / "moe-init")
    by_source = diagnose(moe, [t for t, _ in sample], [s for _, s in sample])
    chance = upcycle(Embedder.load(out / "models" / "dense-init"), 8, 4, every=2, granularity=4)  # the recipe's layers
    by_chance = diagnose(chance, [t for t, _ in sample], [s for _, s in sample])
    assert min(r.mi_ratio for r in by_source) > 10 * max(r.mi_ratio for r in by_chance)  # routing starts by source
    assert "routers that send each training source's tokens to its own group of experts (from 60 training texts)" \
        in upcycling(cfg)
