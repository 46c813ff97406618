"""One registry per concept: model presets, model families, task types, training stages. Each test adds an entry
to a registry and checks that everything which depends on the concept follows it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moembed.errors import MoembedError


# ---- presets --------------------------------------------------------------------------------------------------


def test_training_configs_use_the_preset_registry(tmp_path, minilm_path, monkeypatch):
    from moembed.model import presets
    from moembed.train.build import build_model, check_paths
    from moembed.train.config import load_config

    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny" / "contrastive.yaml"
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"query": "q", "document": "d"}) + "\n")
    base = [f"tokenizer={minilm_path}", f"data.0.path={data}", f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(MoembedError, match=r"nor a preset \(" + ", ".join(presets.PRESETS) + r"\)"):
        check_paths(load_config(tiny, base + ["model=wide"]))
    monkeypatch.setitem(presets.PRESETS, "wide", lambda: presets.tiny_config("nomic", hidden_size=48, num_heads=4))
    emb = build_model(load_config(tiny, base + ["model=wide", "model_config_overrides={num_layers: 1}"]))
    cfg = emb.config
    assert (cfg.family, cfg.hidden_size, cfg.num_layers) == ("nomic", 48, 1)
    assert cfg.vocab_size == 30528  # the tokenizer's 30,522 padded to a multiple of 64 for Nomic-style presets
    assert emb.source_dir == minilm_path  # its tokenizer files are copied on save


def test_build_preset_applies_vocabulary_and_overrides():
    from pydantic import ValidationError

    from moembed.model.presets import build_preset, minilm_moe

    assert build_preset("minilm_moe") == minilm_moe()
    assert build_preset("bert", vocab_size=1000).vocab_size == 1000  # BERT-style: not padded
    with pytest.raises(ValidationError, match="num_heads"):
        build_preset("tiny", overrides={"num_heads": 5})
    with pytest.raises(KeyError):
        build_preset("nope")


# ---- model families -------------------------------------------------------------------------------------------


def test_a_registered_family_loads_and_exports(make_tiny, tmp_path, monkeypatch):
    """A new `model_type` is one converter in FAMILIES: loading and export go through it."""
    from moembed.model import families
    from moembed.model.embedder import Embedder
    from moembed.model.families.bert import BertConverter
    from moembed.model.io import export_sentence_transformers

    class Toy(BertConverter):  # BERT's layout under another name
        model_type = "toy"

        def hf_config(self, config):
            return {**super().hf_config(config), "model_type": "toy"}

    emb = make_tiny("bert")
    export_sentence_transformers(emb, tmp_path / "st")
    cfg = json.loads((tmp_path / "st" / "config.json").read_text())
    (tmp_path / "st" / "config.json").write_text(json.dumps({**cfg, "model_type": "toy"}))
    with pytest.raises(MoembedError, match=rf"{tmp_path / 'st' / 'config.json'}: model_type 'toy' is not supported; "
                                           r"supported: bert"):
        Embedder.load(tmp_path / "st")
    monkeypatch.setitem(families.FAMILIES, "toy", Toy())
    monkeypatch.delitem(families.FAMILIES, "bert")  # exports now go through the toy family
    back = Embedder.load(tmp_path / "st")
    np.testing.assert_allclose(back.encode(["a toy text"]), emb.encode(["a toy text"]), atol=1e-6)
    export_sentence_transformers(back, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["model_type"] == "toy"


def test_encoders_no_family_holds_keep_moembeds_format(make_tiny):
    from moembed.model.families import exporter_for

    assert exporter_for(make_tiny("bert").config).model_type == "bert"
    assert exporter_for(make_tiny("nomic").config) is None  # rotary + SwiGLU: moembed's own module
    assert exporter_for(make_tiny("bert", moe={"num_experts": 2, "top_k": 1}).config) is None


# ---- task types -----------------------------------------------------------------------------------------------


def test_a_registered_task_type_is_detected_read_run_and_scored(make_tiny, tmp_path, monkeypatch):
    from moembed.eval import evaluate, load_task
    from moembed.eval import registry
    from moembed.eval.encoding import encode
    from moembed.eval.sweep import calibration_sample
    from moembed.eval.task import TaskType

    class Lengths(TaskType):
        """Toy type: the correlation of embedding norms before normalisation with text lengths."""

        name = "lengths"
        main_score = "agreement"
        query_prompt = document_prompt = "classification"
        detect_keys = frozenset({"text", "chars"})

        def read(self, path, split):
            return {"rows": [json.loads(x) for x in (path / f"{split}.jsonl").read_text().splitlines()]}

        def run(self, model, task, view, cache, options):
            x = encode(model, [r["text"] for r in task.data["rows"]], self.query_prompt, view, cache)
            return {"agreement": float(np.isfinite(x).mean()), "rows": float(len(x))}

        def texts(self, data):
            return [r["text"] for r in data["rows"]]

    d = tmp_path / "lengths"
    d.mkdir()
    (d / "test.jsonl").write_text("".join(json.dumps({"text": t, "chars": len(t)}) + "\n" for t in ["a", "bb", "ccc"]))
    with pytest.raises(MoembedError, match="cannot tell the task type"):
        load_task(d)
    monkeypatch.setitem(registry.TASK_TYPES, "lengths", Lengths())
    task = load_task(d)
    assert task.type == "lengths" and len(task.data["rows"]) == 3
    assert calibration_sample([task]) == [["a", "bb", "ccc"]]
    (res,) = evaluate(make_tiny("bert"), [d])
    assert res.task_type == "lengths" and res.main_score == res.scores["agreement"] == 1.0
    (d / "task.json").write_text(json.dumps({"type": "lenghts"}))
    with pytest.raises(MoembedError, match=r"task\.json: key 'type': .*unknown task type 'lenghts'"):
        load_task(d)


def test_registry_holds_every_type_with_its_main_score_and_prompts():
    from moembed.eval.registry import TASK_TYPES

    assert {n: t.main_score for n, t in TASK_TYPES.items()} == {
        "retrieval": "ndcg_at_10", "sts": "spearman", "pair_classification": "ap", "reranking": "map",
        "classification": "accuracy", "clustering": "v_measure",
    }
    assert (TASK_TYPES["retrieval"].query_prompt, TASK_TYPES["retrieval"].document_prompt) == (
        "search_query", "search_document")
    assert TASK_TYPES["clustering"].detect_keys is None  # never guessed: classification's records look the same


# ---- training stages ------------------------------------------------------------------------------------------


def test_stages_registry_matches_the_config():
    from typing import get_args

    from moembed.train.config import TrainConfig
    from moembed.train.stages import STAGES, ContrastiveStage, MLMStage

    assert set(STAGES) == set(get_args(TrainConfig.model_fields["stage"].annotation))
    assert STAGES["mlm"] is MLMStage and issubclass(STAGES["finetune"], ContrastiveStage)
    assert {s.rate_unit for s in STAGES.values()} == {"tokens_per_s", "pairs_per_s"}
