"""The model cards `moembed train` and `moembed upcycle` write carry their recipe and data, parsed back with
huggingface_hub.ModelCard."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from huggingface_hub import ModelCard

from moembed.model.card import split_sections
from train_helpers import chatterbot_pairs, write_pairs

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny"


def card_of(path: Path) -> tuple[ModelCard, dict[str, str]]:
    card = ModelCard.load(path / "README.md")
    return card, split_sections(card.text)


def rows(markdown: str) -> dict[str, list[str]]:
    """A markdown table's rows, first cell → the other cells."""
    out = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and not set(cells[0]) <= {"-"}:
            out[cells[0]] = cells[1:]
    return out


def test_train_card_carries_the_recipe_and_the_data(tmp_path, minilm_path):
    from moembed.train.config import load_config
    from moembed.train.loop import train

    pairs = chatterbot_pairs()
    a = write_pairs(tmp_path / "qa.jsonl", pairs[:40], negatives=3)
    b = write_pairs(tmp_path / "more.jsonl", pairs[40:65], negatives=3, seed=1)
    cfg = load_config(TINY / "finetune.yaml", [f"tokenizer={minilm_path}", f"data.0.path={a}", f"data.1.path={b}",
                                               f"output_dir={tmp_path / 'run'}", "steps=2", "optim.lr=3e-4"])
    card, sections = card_of(train(cfg, progress=False))
    assert card.data.library_name == "moembed" and card.data.datasets == ["a", "b"]
    recipe = rows(sections["Training"])
    assert recipe["stage"] == ["`finetune`"] and recipe["initial model"] == ["`tiny`"] and recipe["steps"] == ["2"]
    assert recipe["batch size"] == ["8 (GradCache chunks of 4)"]
    assert recipe["learning rate"][0].startswith("0.0003, wsd schedule, 0 warm-up steps")
    assert recipe["loss"][0].startswith("InfoNCE, temperature 0.05, 2 hard negatives per query, symmetric")
    assert recipe["MoE losses"] == ["load balancing α 0.01, router z-loss 0"]
    config = yaml.safe_load(sections["Training"].split("```yaml")[1].split("```")[0])
    assert config["model_config_overrides"]["moe"] == {"num_experts": 2, "top_k": 1, "layers": [1]}
    data = rows(sections["Data"])
    assert data["a"][:2] == ["`qa.jsonl`", "40"] and data["b"][:2] == ["`more.jsonl`", "25"]
    assert int(data["a"][2]) + int(data["b"][2]) > 0  # records the two steps read


def test_train_card_of_a_finetuned_model_names_its_base(tmp_path, minilm_path):
    from moembed.train.config import load_config
    from moembed.train.loop import train

    a = write_pairs(tmp_path / "qa.jsonl", chatterbot_pairs()[:16])
    cfg = load_config(TINY / "contrastive.yaml", [f"model={minilm_path}", f"data.0.path={a}",
                                                  f"output_dir={tmp_path / 'run'}", "steps=1", "batch_size=4",
                                                  "model_config_overrides={}"])
    card, sections = card_of(train(cfg, progress=False))
    assert card.data.base_model == "all-MiniLM-L6-v2" and card.data.language == ["en"]
    assert rows(sections["Training"])["initial model"] == [f"`{minilm_path}`"]
    assert rows(sections["Data"])[cfg.data[0].label][:2] == ["`qa.jsonl`", "16"]


def test_upcycle_card_carries_every_option_and_the_kmeans_texts(tmp_path, tiny_dir):
    from typer.testing import CliRunner

    from moembed.cli.main import app

    texts = tmp_path / "kmeans.jsonl"
    texts.write_text("".join(json.dumps(q) + "\n" for q, _ in chatterbot_pairs()[:30]))
    res = CliRunner().invoke(app, ["upcycle", str(tiny_dir), "--out", str(tmp_path / "moe"), "--experts", "4",
                                   "--top-k", "2", "--every", "1", "--offset", "0", "--noise", "0.01",
                                   "--router-init", "kmeans", "--kmeans-texts", str(texts), "--seed", "7"])
    assert res.exit_code == 0, res.output
    card, sections = card_of(tmp_path / "moe")
    assert "mixture-of-experts" in card.data.tags
    recipe = rows(sections["Training"])
    assert recipe["dense model"] == [f"`{tiny_dir}`"]
    assert {k: v[0] for k, v in recipe.items() if k.startswith("`--")} == {
        "`--experts`": "4", "`--top-k`": "2", "`--every`": "1", "`--offset`": "0", "`--noise`": "0.01",
        "`--renormalize`": "True", "`--seed`": "7", "`--granularity`": "1", "`--reinit`": "0.0",
        "`--router-init`": "kmeans", "`--balance-rate`": "0.0"}
    assert rows(sections["Data"])["`kmeans.jsonl`"] == ["30"]
