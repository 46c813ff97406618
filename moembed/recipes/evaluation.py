"""The recipe's evaluation: base, dense-finetuned and MoE-finetuned models on the held-out test sets.

    OUT/eval/<model>/         the held-out sets (the user's test split, or the built-in corpora's) at every
                              Matryoshka dim and precision (moembed.eval.sweep)
    OUT/eval-suite/<model>/   with the user's data: the built-in dev suite (moembed.eval.suite) at full dimension
                              in float32, to show what finetuning on the user's data cost or gained elsewhere
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moembed.recipes.context import RecipeContext

MODELS = ("base", "dense", "moe")


def model_paths(ctx: RecipeContext) -> dict[str, Path]:
    return {"base": ctx.base, "dense": ctx.out / "runs" / "dense" / "model", "moe": ctx.out / "runs" / "moe" / "model"}


def evaluate(ctx: RecipeContext) -> dict:
    from moembed.eval.encoding import EmbeddingCache
    from moembed.eval.registry import load_task
    from moembed.eval.report import write_results
    from moembed.eval.runner import View, run_task
    from moembed.eval.suite import build_suite
    from moembed.eval.sweep import matryoshka_sweep
    from moembed.model.embedder import Embedder
    from moembed.recipes.curation import held_out_dirs

    tasks = []
    for name, path in held_out_dirs(ctx).items():
        task = load_task(path)
        task.name = name  # the directory is "test" for every dataset
        tasks.append(task)
    e = ctx.cfg.eval
    suite = []
    if ctx.cfg.user_data and e.suite:
        suite = [load_task(d) for d in build_suite(ctx.out / "dev-suite", ctx.cfg.seed, e.suite_datasets)]
    dims = e.dims or ctx.matryoshka_dims
    for label, path in model_paths(ctx).items():
        model = Embedder.load(path, device=ctx.cfg.device)
        model.name = label
        # Full-dimension embeddings are cached once; every (dim, precision) point is derived from them.
        cache = EmbeddingCache(ctx.out / "work" / "eval-cache")
        res = matryoshka_sweep(model, tasks, dims, e.precisions, e.batch_size, cache, progress=ctx.progress)
        write_results(res, ctx.out / "eval" / label, label, None)
        if suite:
            view = View(None, "float32", e.batch_size)
            write_results([run_task(model, t, view, cache) for t in suite], ctx.out / "eval-suite" / label, label, None)
    return {"models": list(MODELS), "suite_tasks": [t.name for t in suite]}
