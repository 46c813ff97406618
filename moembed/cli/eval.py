"""`moembed eval`: score a model on task directories (and sweeps); `moembed compare`: results side by side."""

from __future__ import annotations

from pathlib import Path

import typer

from moembed.cli import options as o


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
    app.command("compare")(compare_cmd)


def _ints(value: str | None, option: str) -> list[int]:
    from moembed.errors import MoembedError

    if not value:
        return []
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise MoembedError(f"{option}: expected comma-separated integers, got {value!r}") from None


def _precisions(value: str) -> list[str]:
    from moembed.errors import MoembedError
    from moembed.model.pooling import PRECISIONS

    out = [p.strip() for p in value.split(",") if p.strip()]
    for p in out:
        if p not in PRECISIONS:
            raise MoembedError(f"--precisions: unknown {p!r}; choose from {', '.join(PRECISIONS)}")
    return out or ["float32"]


def _load_model(path: Path, moee_sum: float | None, device: str = "auto", dtype: str = "float32",
                pooling: str | None = None, backend: str = "auto"):
    """The model and the hash of its weights file (model.safetensors when present), for the results."""
    from moembed.errors import MoembedError
    from moembed.eval.encoding import file_hash

    if moee_sum is not None:
        if dtype != "float32":
            raise MoembedError(f"--dtype: {dtype!r} with --moee-sum; MoEE runs its language model as loaded")
        if pooling is not None:
            raise MoembedError("--pooling: not with --moee-sum; MoEE pools its language model's states itself")
        if backend != "auto":
            raise MoembedError(f"--backend: {backend!r} with --moee-sum; MoEE runs its language model as loaded")
        from moembed.moee.combine import load_moee

        # The MoEE model's embeddings differ from its source model's: its key covers mode and settings.
        model = load_moee(path, mode="sum", alpha=moee_sum, device=device)
        return model, model.settings_key()
    from moembed.model.embedder import Embedder

    # the cache key covers a compute other than float32, and the pooling
    model = Embedder.load(path, device=device, dtype=dtype, pooling=pooling, backend=backend)
    st = path / "model.safetensors"
    return model, file_hash(st) if st.exists() else model.settings_key()


def eval_cmd(
    model: Path = typer.Argument(..., help="moembed, Hugging Face BERT or sentence-transformers directory"),
    tasks: list[Path] = typer.Argument(None, metavar="TASK_DIR", help="task directories (any number)"),
    out: Path = o.out_option("result directory: results.json, results.md, plots"),
    suite: o.Suite = typer.Option(None, help="add a built-in suite"),
    suite_dir: Path = typer.Option(None, help="suite location (default: CACHE_DIR/dev-suite or OUT/dev-suite)"),
    dims: str = typer.Option(None, help="Matryoshka dimensions to sweep, e.g. 384,256,128"),
    precisions: str = typer.Option("float32", help="output precisions to sweep: float32,int8,uint8,binary,ubinary"),
    max_lengths: str = typer.Option(None, help="retrieval at these maximum lengths (with and without Dynamic NTK)"),
    batch_size: int = typer.Option(32, help="texts per forward pass"),
    cache_dir: Path = typer.Option(None, help="cache embeddings here, keyed by model hash, texts, prompt, dim"),
    faiss: bool = typer.Option(False, "--faiss", help="search retrieval corpora with a FAISS flat index"),
    moee_sum: float = typer.Option(None, help="score with MoEE(sum): cos(HS) + ALPHA·cos(RW)"),
    name: str = typer.Option(None, help="model name in the results (default: the model's own)"),
    device: str = o.device_option(),
    dtype: o.Compute = typer.Option("float32", help="compute precision: bf16 autocast; int8 dynamic matmuls (CPU)"),
    backend: o.Backend = o.backend_option(),
    quiet: o.Quiet = False,
    pooling: o.Pooling = typer.Option(None, help="how token states become one vector (default: the model's)"),
    old_tasks: list[Path] = o.old_spelling("--tasks"),
) -> None:
    """Evaluate MODEL on task directories; write results.json, results.md and plots into OUT."""
    from tqdm.auto import tqdm

    from moembed.errors import MoembedError
    from moembed.eval import EmbeddingCache, View, load_task
    from moembed.eval.report import markdown_table, write_results
    from moembed.eval.runner import run_task
    from moembed.eval.sweep import long_context_sweep, matryoshka_sweep

    dirs = list(o.renamed(tasks or None, old_tasks or None, "TASK_DIR", "--tasks", required=False) or [])
    if suite is not None:
        from moembed.eval.suite import build_suite

        where = suite_dir or (cache_dir or out) / "dev-suite"
        typer.echo(f"moembed: dev suite in {where}", err=True)
        dirs += build_suite(where)
    if not dirs:
        raise MoembedError("TASK_DIR: give at least one task directory after MODEL (or --suite dev)")
    if batch_size < 1:
        raise MoembedError(f"--batch-size: must be >= 1, got {batch_size}")
    loaded = [load_task(d) for d in dirs]  # every task is validated before any model work
    lengths, dim_list, precs = _ints(max_lengths, "--max-lengths"), _ints(dims, "--dims"), _precisions(precisions)
    emb, model_hash = _load_model(model, moee_sum, device, dtype, pooling, backend)
    cache = EmbeddingCache(cache_dir) if cache_dir else None
    if dim_list or precs != ["float32"]:
        results = matryoshka_sweep(emb, loaded, dim_list, precs, batch_size, cache, faiss, progress=not quiet)
    else:
        view = View(None, "float32", batch_size)
        results = [run_task(emb, t, view, cache, faiss) for t in tqdm(loaded, desc="tasks", unit="task", disable=quiet)]
    if lengths:
        results += long_context_sweep(emb, loaded, lengths, batch_size, cache, progress=not quiet)
    compute = getattr(emb, "compute", "float32")
    label = name or (emb.name if compute == "float32" else f"{emb.name} ({compute})")
    doc = write_results(results, out, label, model_hash)
    typer.echo(markdown_table(doc))
    typer.echo(f"moembed: wrote {len(results)} results to {out}", err=True)


def compare_cmd(
    result_dirs: list[Path] = typer.Argument(..., help="result directories written by `moembed eval`"),
    plot: Path = typer.Option(None, help="also write a bar chart (PNG) of main scores, model against model"),
) -> None:
    """Print main scores of several result directories side by side, with differences vs the first."""
    from moembed.eval.compare import compare_markdown, compare_plot

    typer.echo(compare_markdown(result_dirs))
    if plot is not None:
        compare_plot(result_dirs, plot)
        typer.echo(f"moembed: wrote {plot}", err=True)
