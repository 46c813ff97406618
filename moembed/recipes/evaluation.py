"""The recipe's evaluation: base, dense-finetuned and MoE-finetuned models on the held-out test sets.

    OUT/eval/<model>/         the held-out sets (the user's test split, or the built-in corpora's) at every
                              Matryoshka dim and precision (moembed.eval.sweep)
    OUT/eval-suite/<model>/   with the user's data: the built-in dev suite (moembed.eval.suite) at full dimension
                              in float32, to show what finetuning on the user's data cost or gained elsewhere
"""

from __future__ import annotations

from pathlib import Path

MODELS = ("base", "dense", "moe")


def model_paths(qs) -> dict[str, Path]:
    return {"base": qs.base, "dense": qs.out / "runs" / "dense" / "model", "moe": qs.out / "runs" / "moe" / "model"}


def evaluate(qs) -> dict:
    from moembed.eval.encoding import EmbeddingCache
    from moembed.eval.registry import load_task
    from moembed.eval.report import write_results
    from moembed.eval.runner import View, run_task
    from moembed.eval.suite import build_suite
    from moembed.eval.sweep import matryoshka_sweep
    from moembed.model.embedder import Embedder
    from moembed.recipes.curation import held_out_dirs

    tasks = []
    for name, path in held_out_dirs(qs).items():
        task = load_task(path)
        task.name = name  # the directory is "test" for every dataset
        tasks.append(task)
    e = qs.cfg.eval
    suite = []
    if qs.cfg.user_data and e.suite:
        suite = [load_task(d) for d in build_suite(qs.out / "dev-suite", qs.cfg.seed, e.suite_datasets)]
    dims = e.dims or qs.matryoshka_dims
    for label, path in model_paths(qs).items():
        model = Embedder.load(path, device=qs.cfg.device)
        model.name = label
        # Full-dimension embeddings are cached once; every (dim, precision) point is derived from them.
        cache = EmbeddingCache(qs.out / "work" / "eval-cache")
        res = matryoshka_sweep(model, tasks, dims, e.precisions, e.batch_size, cache, progress=qs.progress)
        write_results(res, qs.out / "eval" / label, label, None)
        if suite:
            view = View(None, "float32", e.batch_size)
            write_results([run_task(model, t, view, cache) for t in suite], qs.out / "eval-suite" / label, label, None)
    return {"models": list(MODELS), "suite_tasks": [t.name for t in suite]}
