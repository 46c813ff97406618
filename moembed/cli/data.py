"""`moembed data build|list|multilingual`, `moembed filter`, `moembed mine`, `moembed tokenizer train`: data curation jobs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from moembed.cli import options as o

# Options shared by `filter` and `mine` (both run moembed.data.curate).
Data = Annotated[Path, typer.Argument(help='JSONL of {"query", "document", ...} pairs')]
Teacher = Annotated[str, typer.Option(help="model directory (moembed, HF BERT or sentence-transformers)")]
WorkDir = Annotated[Path, typer.Option(help="per-shard results for resuming (default: OUT.work, removed at the end)")]
SkipBad = Annotated[bool, typer.Option(help="skip malformed lines (counted) instead of failing")]
BatchSize = Annotated[int, typer.Option(help="texts per teacher forward pass")]
Backend = Annotated[o.SearchBackend, typer.Option(help="search backend (auto: faiss when installed)")]
Bf16 = Annotated[bool, typer.Option(help="bfloat16 autocast for the teacher")]
CacheEmbeddings = Annotated[bool, typer.Option(help="keep shard embeddings in --work-dir for later runs")]
Device = Annotated[str, typer.Option(metavar=o.DEVICE_METAVAR,
                                      help="where the teacher runs (auto: the accelerator when there is one)")]
MaxLength = Annotated[int | None, typer.Option(help="cut texts to N tokens, as training will (default: the teacher's limit)")]

data_app = typer.Typer(help="Build training pairs and BEIR evaluation sets from installed real corpora.", no_args_is_help=True)
tokenizer_app = typer.Typer(help="Train tokenizers with the `tokenizers` library.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
    app.add_typer(tokenizer_app, name="tokenizer")
    app.command("filter")(filter_cmd)
    app.command("mine")(mine_cmd)


@data_app.command("list")
def list_cmd() -> None:
    """Names `moembed data build` accepts (chatterbot-LANGUAGE also builds one language)."""
    from moembed.data.corpora import describe

    for name, desc in describe().items():
        typer.echo(f"{name:20s} {desc}")


@data_app.command("build")
def build_cmd(
    name: str = typer.Argument(..., help="dataset name, see `moembed data list`"),
    out: Path = o.out_option("output directory (replaced atomically)"),
    max_pairs: int = typer.Option(5000, help="training pairs kept (0: all)"),
    eval_queries: int = typer.Option(300, help="queries in each of dev and test"),
    eval_docs: int = typer.Option(1000, help="documents in each evaluation corpus, distractors included"),
    seed: int = typer.Option(0, help="shuffling seed: same seed, same dataset"),
) -> None:
    """Write OUT/train.jsonl, OUT/dev/, OUT/test/ (BEIR) and OUT/meta.json from a real corpus."""
    from moembed.data.corpora import build_dataset

    meta = build_dataset(name, out, seed=seed, max_pairs=max_pairs or None, eval_queries=eval_queries, eval_docs=eval_docs)
    typer.echo(
        f"moembed: {name}: {meta['train']} training pairs, dev {meta['dev']['queries']} queries / "
        f"{meta['dev']['corpus']} docs, test {meta['test']['queries']} queries / {meta['test']['corpus']} docs "
        f"({meta['dropped_empty']} empty and {meta['dropped_duplicate']} duplicate pairs dropped) → {out}",
        err=True,
    )


@data_app.command("multilingual")
def multilingual_cmd(
    out: Path = o.out_option("output directory (replaced atomically)"),
    size: o.DataSize = typer.Option("small", help="pairs per source, test sizes"),
    seed: int = typer.Option(0, help="shuffling seed: same seed, same files"),
) -> None:
    """Write the multilingual suite: OUT/train/<source>.jsonl per language or language pair, OUT/test/<source>/
    (BEIR, per language and cross-lingual) and OUT/meta.json (see docs/data.md)."""
    from moembed.data.multilingual import multilingual_suite

    sources, tests = multilingual_suite(out, size=size, seed=seed)
    pairs = sum(s.size or 0 for s in sources)
    cross = sum(t.cross_lingual for t in tests.values())
    typer.echo(f"moembed: {len(sources)} training sources, {pairs} pairs; {len(tests)} test sets "
               f"({cross} cross-lingual) → {out}", err=True)


def filter_cmd(
    ctx: typer.Context,
    data: Data,
    teacher: Teacher,
    out: Path = o.out_option("kept pairs, JSONL"),
    shard_size: int = typer.Option(1_000_000, help="pairs per shard (documents compete within a shard)"),
    top_k: int = typer.Option(2, help="keep a pair when its document ranks in the top K (2: Nomic, 20: Arctic)"),
    work_dir: WorkDir = None,
    skip_bad: SkipBad = False,
    batch_size: BatchSize = 32,
    backend: Backend = "auto",
    bf16: Bf16 = False,
    cache_embeddings: CacheEmbeddings = False,
    device: Device = "auto",
    max_length: MaxLength = None,
    nproc: o.Nproc = None,
    quiet: o.Quiet = False,
) -> None:
    """Consistency filtering (nomic-embed-v1 §4.2.1): drop pairs whose document is not in its query's top K."""
    from moembed.data.curate import CurateConfig, curate
    from moembed.distributed import init_from_env

    cfg = CurateConfig(shard_size=shard_size, top_k=top_k, batch_size=batch_size, backend=backend, bf16=bf16,
                       cache_embeddings=cache_embeddings, device=device, max_length=max_length)
    if (nproc := o.processes(nproc)) > 1:
        return o.run_in_processes(ctx, nproc)
    init_from_env()  # under torchrun: join the process group, embedding is split across ranks
    report = curate(data, out, teacher, cfg, work_dir=work_dir, skip_bad=skip_bad, show_progress=not quiet)
    _print_report(report)


def mine_cmd(
    ctx: typer.Context,
    data: Data,
    teacher: Teacher,
    out: Path = o.out_option("pairs with negatives, JSONL"),
    num_negatives: int = typer.Option(7, help="hard negatives kept per pair (M)"),
    margin: float = typer.Option(0.95, help="drop candidates scoring above pos_score × MARGIN (Eq. 5)"),
    abs_margin: float = typer.Option(None, help="also drop candidates scoring above pos_score − ABS_MARGIN"),
    filter_top_k: int = typer.Option(None, help="also consistency-filter with this top K, on the same embeddings"),
    shard_size: int = typer.Option(1_000_000, help="pairs per shard (negatives come from the shard's documents)"),
    work_dir: WorkDir = None,
    skip_bad: SkipBad = False,
    batch_size: BatchSize = 32,
    backend: Backend = "auto",
    bf16: Bf16 = False,
    cache_embeddings: CacheEmbeddings = False,
    device: Device = "auto",
    max_length: MaxLength = None,
    nproc: o.Nproc = None,
    quiet: o.Quiet = False,
) -> None:
    """Positive-aware hard-negative mining (nomic-embed-v2 Eq. 5); optionally filter in the same pass."""
    from moembed.data.curate import CurateConfig, curate
    from moembed.data.mining import MiningConfig
    from moembed.distributed import init_from_env

    mining = MiningConfig(num_negatives=num_negatives, margin=margin, abs_margin=abs_margin)
    cfg = CurateConfig(
        shard_size=shard_size, top_k=filter_top_k, mining=mining, batch_size=batch_size, backend=backend, bf16=bf16,
        cache_embeddings=cache_embeddings, device=device, max_length=max_length,
    )
    if (nproc := o.processes(nproc)) > 1:
        return o.run_in_processes(ctx, nproc)
    init_from_env()
    report = curate(data, out, teacher, cfg, work_dir=work_dir, skip_bad=skip_bad, show_progress=not quiet)
    _print_report(report)


def _print_report(report: dict) -> None:
    from moembed.distributed import rank

    if rank() != 0:
        return  # only rank 0 searched and wrote
    for source, r in sorted(report["sources"].items()):
        typer.echo(f"moembed: {source}: kept {r['kept']} of {r['pairs']} ({r['kept_fraction']:.1%})", err=True)
    typer.echo(
        f"moembed: {report['kept']} of {report['pairs']} pairs written to {report['out']}; "
        f"{report['dropped_empty']} empty and {report['bad_lines']} malformed lines dropped",
        err=True,
    )
    typer.echo(json.dumps({k: v for k, v in report.items() if k != "sources"}), err=True)


@tokenizer_app.command("train")
def tokenizer_train_cmd(
    files: list[Path] = typer.Argument(..., help="training text: plain lines, or JSONL pairs / strings"),
    kind: o.TokenizerKind = typer.Option(..., help="tokenizer model"),
    vocab_size: int = typer.Option(..., help="target vocabulary size (padded up to a multiple of --multiple)"),
    out: Path = o.out_option("output directory: tokenizer.json (+ tokenizer_config.json)"),
    multiple: int = typer.Option(64, help="pad the vocabulary to a multiple of this (nomic-embed-v1 §4.1.2)"),
    lowercase: bool = typer.Option(True, help="lowercase and strip accents before tokenizing"),
    min_frequency: int = typer.Option(2, help="BPE / WordPiece: minimum pair frequency for a merge"),
) -> None:
    """Train a tokenizer on text files and save a tokenizer.json that moembed models load."""
    from moembed.data.tokenizers import TokenizerConfig, train_tokenizer

    cfg = TokenizerConfig(kind=kind, vocab_size=vocab_size, multiple=multiple, lowercase=lowercase, min_frequency=min_frequency)
    size = train_tokenizer([str(f) for f in files], cfg, out)
    typer.echo(f"moembed: {kind} tokenizer with {size} tokens written to {out}", err=True)
