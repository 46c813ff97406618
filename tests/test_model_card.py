"""Model cards (moembed/model/card.py) on every model moembed writes, parsed back with huggingface_hub.ModelCard."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from huggingface_hub import ModelCard

from moembed.model.card import CardInfo, build_card, parameter_counts


def load(path) -> ModelCard:
    return ModelCard.load(path / "README.md")


def test_saved_model_card_has_metadata_and_architecture(make_tiny, tmp_path):
    emb = make_tiny()
    emb.save(tmp_path / "m")
    card = load(tmp_path / "m")
    d = card.data
    assert d.library_name == "moembed" and d.pipeline_tag == "sentence-similarity"
    assert {"moembed", "sentence-transformers"} <= set(d.tags) and "mixture-of-experts" not in d.tags
    total, active = parameter_counts(emb.config, dict(emb.encoder.named_parameters()))
    assert total == active == sum(p.numel() for p in emb.encoder.parameters())
    assert f"{total:,} total, {active:,} active per token" in card.text
    assert 'Embedder.load("PATH")' in card.text and d.base_model is None  # built in memory: no base


def test_upcycled_model_names_its_base_and_experts(minilm, tmp_path):
    from moembed.model.convert.upcycle import upcycle

    moe = upcycle(minilm, num_experts=4, top_k=2, every=2)
    moe.save(tmp_path / "moe")
    card = load(tmp_path / "moe")
    total, active = parameter_counts(moe.config, moe.parts().state_dict)
    assert active < total
    assert card.data.base_model == "all-MiniLM-L6-v2"  # the packaged model's card title
    assert card.data.language == ["en"] and "mixture-of-experts" in card.data.tags
    assert "4 experts, top-2, renormalised gates, MoE layers 2, 4, 6 of 6" in card.text
    assert f"{total:,} total, {active:,} active per token" in card.text
    assert 'SentenceTransformer("PATH", trust_remote_code=True)' in str(build_card(moe.parts(), "sentence-transformers"))
    assert 'SentenceTransformer("PATH")' in str(build_card(minilm.parts(), "sentence-transformers"))


def test_exports_inherit_the_source_card(make_tiny, tmp_path):
    """A model finetuned and saved with its recipe keeps base model, languages, datasets and recipe through every
    export; the export's own evaluation becomes model-index results."""
    from moembed.model.io import export_huggingface, export_sentence_transformers, save_parts

    emb = make_tiny()
    info = CardInfo(base_model="org/base", languages=["en", "de"], datasets=["wordnet"], training="steps: 10",
                    data="| dataset | pairs |", results=[
                        {"task_name": "wordnet", "main_score": 0.41234, "dim": 32, "precision": "float32"},
                        {"task_name": "wordnet", "main_score": 0.3, "dim": 16, "precision": "float32"},
                        {"task_name": "news", "main_score": 0.25, "dim": 32, "precision": "float32"}],
                    evaluation="| model | wordnet |")
    save_parts(emb.parts(), tmp_path / "m", info)
    card = load(tmp_path / "m")
    assert [(r.dataset_name, r.metric_type, r.metric_value) for r in card.data.eval_results] == [
        ("wordnet", "ndcg_at_10", 0.41234), ("news", "ndcg_at_10", 0.25)]  # the full dimension only
    assert "model-index" in (tmp_path / "m" / "README.md").read_text()
    from moembed.model.embedder import Embedder

    saved = Embedder.load(tmp_path / "m")
    export_sentence_transformers(saved, tmp_path / "st")
    export_huggingface(saved, tmp_path / "hf")
    for name, library in (("st", "sentence-transformers"), ("hf", "transformers")):
        c = load(tmp_path / name)
        assert c.data.library_name == library and c.data.base_model == "org/base"
        assert c.data.language == ["en", "de"] and c.data.datasets == ["wordnet"]
        assert "## Training\n\nsteps: 10" in c.text and "## Data" in c.text


def test_cli_export_writes_a_card_in_every_format(tiny_dir, tmp_path):
    for fmt in ("sentence-transformers", "huggingface", "moembed"):
        r = subprocess.run([sys.executable, "-m", "moembed.cli.main", "export", str(tiny_dir), "--format", fmt,
                            "--out", str(tmp_path / fmt)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        card = load(tmp_path / fmt)
        assert card.data.pipeline_tag == "sentence-similarity" and card.data.model_name == "moembed-model"
        assert card.data.library_name == {"huggingface": "transformers"}.get(fmt, fmt)


def test_a_readme_moembed_did_not_write_is_kept(make_tiny, tmp_path, caplog):
    out = tmp_path / "m"
    out.mkdir()
    (out / "README.md").write_text("my notes\n")
    with caplog.at_level(logging.WARNING, logger="moembed"):
        make_tiny().save(out)
    assert (out / "README.orig.md").read_text() == "my notes\n"
    assert load(out).data.library_name == "moembed"
    assert "README.md was not written by moembed; kept as README.orig.md" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moembed"):
        make_tiny().save(out)  # moembed's own card is replaced without a word; the kept README stays
    assert caplog.text == "" and (out / "README.orig.md").read_text() == "my notes\n"


def test_quickstart_card_carries_recipe_and_evaluation(tmp_path, make_tiny, monkeypatch):
    from types import SimpleNamespace

    from moembed.model.io import save_parts
    from moembed.recipes import report_text
    from moembed.recipes.report import quickstart_card

    monkeypatch.setattr(report_text, "settings", lambda qs: "the settings")  # they read a whole quickstart config
    monkeypatch.setattr(report_text, "_decision_lines", lambda d: "the decisions")
    qs = SimpleNamespace(cfg=SimpleNamespace(base=None, user_data=None), matryoshka_dims=[32, 16])
    stages = {"data": {"datasets": {"wordnet": {"train": 10, "test": {"queries": 3, "documents": 9}}},
                       "test_sets": {"de-en": {"query_lang": "de", "doc_lang": "en", "path": "x"}}}}
    results = [{"task_name": "wordnet", "main_score": 0.5, "dim": 32, "precision": "float32"}]
    info = quickstart_card(qs, "moe", results, "| table |", "verdict", stages, ["layer 2: even"], {})
    save_parts(make_tiny().parts(), tmp_path / "m", info)
    card = load(tmp_path / "m")
    assert card.data.base_model == "all-MiniLM-L6-v2" and card.data.language == ["de", "en"]
    assert card.data.datasets == ["wordnet"] and card.data.eval_results[0].metric_value == 0.5
    assert "the settings\nthe decisions" in card.text and "| wordnet | 10 | 3 / 9 |" in card.text
    assert "## Expert load (test documents)" in card.text and "| table |" in card.text


def test_onnx_card_names_the_backend(make_tiny):
    card = build_card(make_tiny().parts(), "onnx")
    assert "onnx" in card.data.tags and 'backend="onnx"' in card.text
