"""`moembed quickstart` end to end on real data (shortened: two datasets, tiny size, a few steps).

The same code path as the full run. The first attempt is interrupted in the dense training stage; the second,
through the CLI, must continue where it stopped and produce the whole report.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TINY = """\
datasets: [wordnet, news]
size: tiny
train: {steps: 3, batch_size: 16, checkpoint_every: 2, matryoshka_dims: [384, 128]}
eval: {dims: [384, 128], precisions: [float32, int8, binary]}
"""


@pytest.mark.slow
@pytest.mark.real
def test_quickstart_interrupted_then_resumed(tmp_path, monkeypatch):
    from moembed.recipes import quickstart as qs

    (tmp_path / "tiny.yaml").write_text(TINY)
    cfg = qs.load_quickstart_config(tmp_path / "tiny.yaml")
    out = tmp_path / "run"
    real_train = qs.Quickstart.train

    def interrupted(self, kind):
        if kind == "dense":
            raise KeyboardInterrupt
        return real_train(self, kind)

    monkeypatch.setattr(qs.Quickstart, "train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        qs.Quickstart(cfg, out, progress=False).run()
    done = sorted(p.stem for p in (out / "stages").glob("*.json"))
    assert done == ["curate", "data", "train-moe", "upcycle"]

    r = subprocess.run([sys.executable, "-m", "moembed.cli.main", "quickstart", "--out", str(out), "--config",
                        str(tmp_path / "tiny.yaml"), "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    for stage in ("data", "curate", "upcycle", "train-moe"):
        assert f"{stage}: done in an earlier run, skipped" in r.stderr
    assert "| MoE, upcycled + finetuned |" in r.stdout and "report:" in r.stdout

    report = out / "report"
    for f in ("README.md", "results.json", "results.md", "training_loss.png", "expert_load.png", "score_vs_dim.png"):
        assert (report / f).stat().st_size > 0, f
    results = json.loads((report / "results.json").read_text())["results"]
    assert set(results) == {"base", "dense", "moe"}
    settings = {(e["task_name"], e["dim"], e["precision"]) for e in results["moe"]}
    assert settings == {(t, d, p) for t in ("wordnet", "news") for d in (384, 128) for p in ("float32", "int8", "binary")}
    card = (report / "models" / "moe" / "README.md").read_text()
    assert "8 experts, top-2" in card and "nDCG@10" in card

    # Both trained models load in both formats and give the same embeddings.
    from sentence_transformers import SentenceTransformer

    from moembed.model.embedder import Embedder

    texts = ["search_document: a dog is a domesticated mammal", "search_query: what is a dog"]
    for kind in ("moe", "dense"):
        emb = Embedder.load(report / "models" / kind)
        # The MoE encoder is a moembed module inside sentence-transformers: loading it runs moembed's code.
        st = SentenceTransformer(str(report / "models" / f"{kind}-st"), device="cpu", trust_remote_code=kind == "moe")
        a, b = emb.encode(texts), st.encode(texts)
        assert (a * b).sum(1).min() >= 0.99999
    assert Embedder.load(report / "models" / "moe").config.moe.num_experts == 8


def test_quickstart_config_errors_name_the_key(tmp_path):
    from moembed.errors import MoembedError
    from moembed.recipes.quickstart import load_quickstart_config

    (tmp_path / "bad.yaml").write_text("train: {steps: zero}\n")
    with pytest.raises(MoembedError, match="bad.yaml: train.steps"):
        load_quickstart_config(tmp_path / "bad.yaml")
    with pytest.raises(MoembedError, match="size"):
        load_quickstart_config(None, size="huge")
    assert load_quickstart_config(None, steps=5).train.steps == 5
    with pytest.raises(MoembedError, match="device"):
        load_quickstart_config(None, device="tpu")
    (tmp_path / "gpu.yaml").write_text("device: cpu\n")
    assert load_quickstart_config(tmp_path / "gpu.yaml").device == "cpu"


def test_an_absent_device_is_refused_before_any_work(tmp_path, monkeypatch):
    import torch

    from moembed.errors import MoembedError
    from moembed.recipes.quickstart import Quickstart, load_quickstart_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MoembedError, match="'cuda' asked for, but CUDA is not available"):
        Quickstart(load_quickstart_config(None, device="cuda"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert load_quickstart_config(None).datasets[0] == "news"


def test_shipped_quickstart_yaml_is_the_default():
    from pathlib import Path

    import yaml

    from moembed.recipes.quickstart import QuickstartConfig, load_quickstart_config

    path = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
    assert load_quickstart_config(path) == QuickstartConfig()
    assert yaml.safe_load(path.read_text()) == QuickstartConfig().model_dump(mode="json")
