"""Load balancing over the last W steps (`LossConfig.balance_window`, moembed/train/balance_window.py): the window,
the loss it gives (nomic-embed-v2 Eq. 1 with r counted over the window, p over the step), its effect (a step whose
one-sided routing the window balances gets no gradient from that loss), and its place in checkpoints (an interrupted
run resumes bit for bit)."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from train_helpers import chatterbot_pairs, write_pairs

from moembed.errors import MoembedError
from moembed.losses.config import LossConfig
from moembed.losses.moe_aux import load_balancing_loss, routing_fractions
from moembed.model.config import MoEConfig
from moembed.train.balance_window import RoutingWindow
from moembed.train.config import load_config
from moembed.train.step import contrastive_step
from test_train import TINY, _overrides

QUERIES = ["how do cats purr", "boiling point of water", "who wrote hamlet", "largest desert on earth"]
DOCUMENTS = ["Cats purr by vibrating the larynx.", "Water boils at 100 degrees Celsius.",
             "Hamlet is a tragedy by William Shakespeare.", "The Antarctic is the largest desert."]


def test_the_window_holds_the_last_steps_and_survives_json():
    w = RoutingWindow(3)
    assert w.history() is None
    for i in range(4):
        w.push(torch.full((2, 4), float(i)))
    assert torch.equal(w.history(), torch.full((2, 4), 5.0, dtype=torch.float64))  # steps 2 and 3: W − 1 kept
    w.push(None)  # a dense model routes nothing
    assert len(w.counts) == 2
    again = RoutingWindow(3)
    again.load_state(json.loads(json.dumps(w.state())))
    assert torch.equal(again.history(), w.history())
    one = RoutingWindow(1)  # the per-step loss: nothing kept
    one.push(torch.ones(2, 4))
    assert one.history() is None and one.state() == []
    with pytest.raises(ValidationError, match="balance_window"):
        LossConfig(balance_window=0)
    with pytest.raises(MoembedError, match=r"loss\.balance_window"):
        load_config(TINY / "contrastive.yaml", ["loss.balance_window=0"])
    with pytest.raises(MoembedError, match=r"loss\.balance_window: the mlm stage"):
        load_config(TINY / "mlm.yaml", ["loss.balance_window=4"])


@pytest.fixture
def moe(make_tiny):
    return make_tiny(moe=MoEConfig(num_experts=4, top_k=2))  # eval mode: no dropout, the same routing every pass


def _step(model, history, aux_loss_coef=1.0):
    tok = model.tokenizer
    model.zero_grad()
    loss = LossConfig(temperature=0.05, aux_loss_coef=aux_loss_coef)
    res = contrastive_step(model, tok(QUERIES), tok(DOCUMENTS), None, loss, routing_history=history)
    return res, {n: p.grad.clone() for n, p in model.named_parameters() if "router" in n}


def test_the_loss_takes_r_from_the_window_and_p_from_the_step(moe):
    plain, _ = _step(moe, None)
    counts = plain.global_counts  # (L, E): one MoE layer of 4 experts
    tok = moe.tokenizer
    logits = [torch.cat([moe(b.input_ids, b.attention_mask, b.token_type_ids).encoder.router_logits[0]
                         for b in (tok(QUERIES), tok(DOCUMENTS))])]  # (N, E) over the step's two passes
    assert counts.shape == (1, 4) and counts.sum() == 2 * logits[0].shape[0]  # top-2 of every real token
    history = torch.tensor([[0.0, 0.0, 0.0, 400.0]])  # earlier steps all on expert 3
    windowed, _ = _step(moe, history)
    with torch.no_grad():
        want = load_balancing_loss(logits, 2, fractions=routing_fractions(counts + history))
        alone = load_balancing_loss(logits, 2, fractions=routing_fractions(counts))
    assert windowed.aux == pytest.approx(float(want), rel=1e-5)
    assert plain.aux == pytest.approx(float(alone), rel=1e-5)
    assert abs(windowed.aux - plain.aux) > 0.05  # the window changed what the loss counts
    assert torch.equal(windowed.global_counts, counts)  # the window's next entry: this step's own routing


def test_a_step_whose_imbalance_the_window_evens_out_gets_no_push_to_uniform(moe):
    plain, g_plain = _step(moe, None)
    counts = plain.global_counts
    assert counts.max() > counts.min()  # this step alone is unbalanced
    evens = counts.max(-1, keepdim=True).values - counts  # with it, every expert has the same load over the window
    _, g_window = _step(moe, evens)
    _, g_task = _step(moe, None, aux_loss_coef=0.0)  # InfoNCE alone
    for n in g_task:
        assert torch.allclose(g_window[n], g_task[n], atol=1e-7), n  # the balancing term adds nothing
        assert (g_plain[n] - g_task[n]).norm() > 1e-3 * g_task[n].norm(), n  # per step, it pushes the router


def test_an_interrupted_run_resumes_with_its_window(tmp_path, minilm_path, monkeypatch):
    import moembed.train.step as step_mod
    from moembed.train.loop import train

    pairs = write_pairs(tmp_path / "a.jsonl", chatterbot_pairs()[:300])
    opts = ["steps=6", "loss.balance_window=4", "loss.aux_loss_coef=1.0",
            "model_config_overrides={hidden_dropout: 0.1, attention_dropout: 0.1, moe: {num_experts: 4, top_k: 2}}"]
    train(load_config(TINY / "contrastive.yaml", opts + _overrides(minilm_path, tmp_path / "ref", pairs)),
          progress=False)

    real, calls = step_mod.contrastive_step, []

    def interrupted(*a, **k):
        calls.append(k["routing_history"])
        if len(calls) == 4:
            raise KeyboardInterrupt  # after the checkpoint of step 3
        return real(*a, **k)

    monkeypatch.setattr(step_mod, "contrastive_step", interrupted)
    cfg = load_config(TINY / "contrastive.yaml", opts + _overrides(minilm_path, tmp_path / "cut", pairs))
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False)
    assert calls[0] is None and calls[3].sum() > 0  # the window filled as the run went
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step-00000003" / "state.json").read_text())
    assert len(state["meta"]["stage_state"]["routing_window"]) == 3  # steps 1-3: W − 1
    monkeypatch.setattr(step_mod, "contrastive_step", real)
    train(cfg, progress=False)  # resumes from step 3

    a = load_file(str(tmp_path / "ref" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

    def records(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k not in ("time", "pairs_per_s")} for x in lines]

    ref = records("ref")
    assert records("cut") == ref and len({r["aux"] for r in ref if "aux" in r}) > 1
