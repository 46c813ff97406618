"""The multilingual preset's memory bound: GradCache chunks (`train.chunk_size`) in both training stages.

The preset trains with chunks of 16 texts so that a step holds the activations of one chunk, not of a whole
batch of long pairs (BENCHMARKS.md, "Multilingual quickstart"). GradCache computes the same loss and gradient as
one pass (Gao et al. 2021): checked here through the recipe's own training config and the trainer, on a tiny MoE
model without dropout (with dropout, the masks drawn for a chunk differ from those drawn for the whole batch; each
chunk's second pass replays its own, tests/test_gradcache.py).
"""

from __future__ import annotations

import json

import pytest

from moembed.errors import MoembedError
from moembed.recipes.config import RECIPE_PRESETS, load_quickstart_config


def _context(tmp_path, cfg, width: int):
    """A recipe context over OUT = tmp_path whose curation has finished with one source, "a", in both pools."""
    from moembed.recipes.context import RecipeContext

    (tmp_path / "stages").mkdir(exist_ok=True)
    (tmp_path / "stages" / "curate.json").write_text(json.dumps({"train_sources": {"a": 64},
                                                                  "pretrain_sources": {"a": 64}}))
    return RecipeContext(cfg=cfg, out=tmp_path, base=tmp_path / "base", base_name="tiny", width=width,
                         teacher=tmp_path / "teacher", device=cfg.torch_device(), progress=False)


def test_the_multilingual_preset_trains_both_stages_in_chunks(tmp_path):
    from moembed.recipes.training import train_config

    assert RECIPE_PRESETS["multilingual"]["train"]["chunk_size"] == 16
    ctx = _context(tmp_path, load_quickstart_config(None, "multilingual", device="cpu"), 384)
    for kind in ("moe", "dense"):
        pretrain, finetune = train_config(ctx, kind, "pretrain"), train_config(ctx, kind, "finetune")
        assert (pretrain.chunk_size, pretrain.batch_size) == (16, 64)
        assert (finetune.chunk_size, finetune.batch_size) == (16, 32)
    # A batch no larger than the chunk is one pass: a smaller --batch-size trains as it would without chunks.
    small = _context(tmp_path, load_quickstart_config(None, "multilingual", device="cpu", batch_size=16), 384)
    assert train_config(small, "moe", "finetune").chunk_size is None
    assert train_config(small, "moe", "pretrain").chunk_size == 16  # pretraining keeps its batch of 64
    english = _context(tmp_path, load_quickstart_config(None, device="cpu"), 384)
    assert train_config(english, "moe").chunk_size is None  # the default recipe: one pass


def test_a_bad_chunk_size_names_the_file_and_the_key(tmp_path):
    (tmp_path / "c.yaml").write_text("train: {chunk_size: 0}\n")
    with pytest.raises(MoembedError, match=r"c\.yaml: train\.chunk_size: Input should be greater than or equal to 1"):
        load_quickstart_config(tmp_path / "c.yaml", "multilingual")
    (tmp_path / "c.yaml").write_text("train: {chunk_size: 8}\n")
    assert load_quickstart_config(tmp_path / "c.yaml", "english").train.chunk_size == 8


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_chunked_training_gives_the_losses_of_one_pass(tmp_path, make_tiny, monkeypatch, stage):
    """Steps 1 and 2 of the recipe's run in chunks of 8 against one pass over the batch of 24: step 1's loss is
    the same forward computation, step 2's follows the same gradient (embedding rows, experts, routers, AdamW)."""
    import moembed.train.step as step_mod
    from moembed.model.config import MoEConfig
    from moembed.recipes.training import train_config
    from moembed.train.loop import train
    from moembed.train.plots import read_metrics

    model = make_tiny(moe=MoEConfig(num_experts=4, top_k=2), hidden_dropout=0.0, attention_dropout=0.0)
    words = ["river", "market", "winter", "engine", "garden", "letter", "violin", "harbour", "planet", "bridge"]
    pairs = [{"query": f"what is a {w} {i}", "document": f"A {w} is thing number {i}, seen near the {v}.",
              "negatives": [f"Nothing about {v} here, only {i}."]}
             for i, (w, v) in enumerate((w, v) for w in words for v in words[:5])]
    (tmp_path / "config.yaml").write_text(
        "pretrain: {steps: 2, batch_size: 24, warmup_steps: 0}\n"
        "train: {steps: 2, batch_size: 24, warmup_steps: 0, chunk_size: 8, bf16: false, max_doc_length: 24}\n")
    cfg = load_quickstart_config(tmp_path / "config.yaml", "multilingual", device="cpu")
    losses = {}
    for chunk in (8, None):
        out = tmp_path / f"chunk-{chunk}"
        model.save(out / "models" / "moe-init")
        model.save(out / "runs" / "moe-pretrain" / "model")  # finetuning's start
        for pool in ("pretrain", "train"):
            (out / pool).mkdir()
            (out / pool / "a.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
        run_cfg = train_config(_context(out, cfg, model.dim), "moe", stage)
        run_cfg.chunk_size = chunk
        calls = []
        real = step_mod.cached_backward
        monkeypatch.setattr(step_mod, "cached_backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        train(run_cfg, progress=False)
        assert len(calls) == (2 if chunk else 0)  # the chunked path ran at both steps, and only there
        recs = read_metrics(out / "runs" / ("moe-pretrain" if stage == "pretrain" else "moe") / "metrics.jsonl")
        losses[chunk] = [(r["loss"], r["aux"]) for r in recs]
    assert len(losses[8]) == 2 and all(loss > 0 and aux > 0 for loss, aux in losses[8])
    flat = {k: [x for rec in v for x in rec] for k, v in losses.items()}  # approx compares numbers, not tuples
    assert flat[8] == pytest.approx(flat[None], rel=1e-5)
