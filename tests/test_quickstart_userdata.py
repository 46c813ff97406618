"""`moembed quickstart --data ...` end to end on a small real source that the test builds from registry packages.

The source is none of the quickstart's built-in sets: Spanish → English FreeDict entries (a JSONL file with
other field names and a language field) and GCIDE turned around, definition → headword (a Parquet file with a
source column). The run goes through the CLI with two training processes (torchrun launched by the recipe) and
must: split by document (no document in two splits), write the report with its decisions and the dev suite,
and give finetuned models that beat their base on the held-out split.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """\
size: tiny
filter_top_k: 10
train: {steps: 10, batch_size: 16, lr: 1.0e-4, warmup_steps: 2, checkpoint_every: 5, max_query_length: 16,
        max_doc_length: 32}
eval: {precisions: [float32], suite_datasets: [wordnet]}
"""


def _build_source(d: Path, n: int = 400) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moembed.data import readers

    spa = list(itertools.islice(readers.read_freedict("freedict-spa-eng"), n))
    rows = [{"es": p.query, "en": p.document, "lang": "es-en"} for p in spa]
    rows += rows[:5]  # five exact duplicates, to be counted and dropped
    (d / "spa.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    gcide = list(itertools.islice(readers.read_gcide(), n))
    pq.write_table(pa.table({"es": [p.document for p in gcide], "en": [p.query for p in gcide],
                             "source": ["gcide-reverse"] * len(gcide)}), d / "gcide.parquet", row_group_size=200)
    return [d / "spa.jsonl", d / "gcide.parquet"]


def _texts(path: Path) -> set[str]:
    return {json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()}


@pytest.mark.slow
@pytest.mark.real
def test_quickstart_on_user_data_end_to_end(tmp_path):
    files = _build_source(tmp_path)
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "moembed.cli.main", "quickstart", "--out", str(out), "--config",
           str(tmp_path / "cfg.yaml"), "--fields", "query=es,document=en,language=lang", "--nproc", "2", "--quiet"]
    for f in files:
        cmd += ["--data", str(f)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]

    # The split shares no document: train pairs, dev corpus and test corpus are disjoint in documents.
    user = out / "data" / "user"
    train_docs = {json.loads(line)["document"] for line in (user / "train.jsonl").read_text().splitlines()}
    dev, test = _texts(user / "dev" / "corpus.jsonl"), _texts(user / "test" / "corpus.jsonl")
    assert len(test) >= 50 and dev and train_docs
    assert not (train_docs & test) and not (train_docs & dev) and not (dev & test)
    data = json.loads((out / "stages" / "data.json").read_text())["user"]
    assert data["duplicates"] == 5
    assert set(data["train_sources"]) == {"spa.es-en", "gcide-reverse"}

    # Both training stages ran under torchrun with two processes.
    for kind in ("moe", "dense"):
        assert json.loads((out / "stages" / f"train-{kind}.json").read_text())["processes"] == 2
        assert (out / "runs" / f"{kind}.yaml").exists()

    report = out / "report"
    text = (report / "README.md").read_text()
    for f in ("results.json", "results.md", "training_loss.png", "score_vs_dim.png"):
        assert (report / f).stat().st_size > 0, f
    for kind in ("moe", "dense", "moe-st", "dense-st"):
        assert (report / "models" / kind / "config.json").exists() or (report / "models" / kind / "modules.json").exists()
    assert "## What the recipe decided" in text and "split by document" in text and "learning rate 0.0001" in text
    assert "consistency filtering (top-10) kept: gcide-reverse" in text and "negatives per query" in text
    assert "too small for the MoE" in text and "Warning" in r.stdout
    assert "## Built-in dev suite" in text and "retrieval-wordnet" in text

    # Held-out evidence: the user's test split is the headline; both finetuned models beat the base there.
    results = json.loads((report / "results.json").read_text())
    assert {e["task_name"] for e in results["results"]["base"]} == {"user-data"}
    assert set(results["dev_suite"]) == {"base", "dense", "moe"}

    def score(model):
        return next(e["main_score"] for e in results["results"][model] if e["dim"] == 384 and e["precision"] == "float32")

    assert score("dense") > score("base") and score("moe") > score("base"), \
        {m: score(m) for m in ("base", "dense", "moe")}
