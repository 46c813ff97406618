"""`moembed upcycle`: turn a dense encoder into a sparse MoE encoder (Komatsuzaki et al.; nomic-embed-v2 §4.3)."""

from __future__ import annotations

from pathlib import Path

import typer

from moembed.cli import options as o


def register(app: typer.Typer) -> None:
    app.command("upcycle")(upcycle)


def upcycle(
    model: str = typer.Argument(..., help="dense moembed, Hugging Face (bert, roberta, xlm-roberta) or sentence-transformers directory"),
    out: Path = o.out_option("output moembed directory"),
    experts: int = typer.Option(8, "--experts", help="experts per MoE layer"),
    top_k: int = typer.Option(2, "--top-k", help="experts per token (1: Switch routing)"),
    every: int = typer.Option(2, "--every", help="make every N-th layer MoE"),
    offset: int = typer.Option(1, "--offset", help="0-based index of the first MoE layer within each group of --every"),
    noise: float = typer.Option(0.0, "--noise", help="Gaussian noise on expert copies, std relative to the weight's"),
    renormalize: bool = typer.Option(True, "--renormalize/--no-renormalize", help="rescale top-k gates to sum to 1"),
    seed: int = typer.Option(0, "--seed", help="seed of the router initialisation, noise and re-initialisation"),
    granularity: int = typer.Option(1, "--granularity", help="G > 1: virtual groups of G experts, each a 1/G slice "
                                    "of the MLP (fine-grained upcycling; G divides --experts and --top-k)"),
    reinit: float = typer.Option(0.0, "--reinit", help="ratio of each expert's hidden units re-drawn (Drop-Upcycling)"),
    router_init: o.RouterInit = typer.Option("random", "--router-init", help="kmeans: centroids of the layer's "
                                    "input token states over --kmeans-texts; sources: rows that send each source's "
                                    "tokens to its own group of experts (--kmeans-texts with --label)"),
    kmeans_texts: Path = typer.Option(None, "--kmeans-texts", help="texts (one JSON string per line) for --router-init "
                                      "kmeans or sources"),
    label: str = typer.Option(None, "--label", help="--kmeans-texts lines are JSON objects {\"text\": ..., KEY: ...}; "
                              "the source (language) of each text under KEY, which --router-init sources needs"),
    balance_rate: float = typer.Option(0.0, "--balance-rate", help="auxiliary-loss-free balancing: bias step u per "
                                       "optimizer step (0: off)"),
) -> None:
    """Turn each chosen dense MLP into an MoE block (copies, or virtual groups of slices), with a fresh router, and
    save (docs/moe.md, "Upcycling options")."""
    from moembed.cli.models import count_parameters
    from moembed.data.calibration import ensure_calibration
    from moembed.errors import MoembedError
    from moembed.inputs import read_labelled_texts, read_texts
    from moembed.model.convert.upcycle import upcycle as do_upcycle
    from moembed.model.embedder import Embedder

    if label is not None and kmeans_texts is None:
        raise MoembedError("--label: names the source key of --kmeans-texts; give --kmeans-texts too")
    if router_init == "sources" and label is None:
        raise MoembedError("--router-init sources: needs the source of each text; give --label KEY with --kmeans-texts "
                           'lines {"text": ..., KEY: ...}')
    texts, sources = None, None
    if kmeans_texts is not None:
        texts, sources = (read_labelled_texts(kmeans_texts, label, "--label") if label
                          else (read_texts(kmeans_texts), None))
    dense = Embedder.load(model)  # after the arguments and files are known to be good
    moe = do_upcycle(dense, experts, top_k, every, offset=offset, renormalize=renormalize, noise=noise, seed=seed,
                     granularity=granularity, reinit=reinit, router_init=router_init, kmeans_texts=texts,
                     text_sources=sources, balance_rate=balance_rate)
    typer.echo(f"moembed: {ensure_calibration(moe)}", err=True)
    options = {"experts": experts, "top-k": top_k, "every": every, "offset": offset, "noise": noise,
               "renormalize": renormalize, "seed": seed, "granularity": granularity, "reinit": reinit,
               "router-init": router_init, "balance-rate": balance_rate}
    moe.save(out, card=upcycle_card(model, options, kmeans_texts, texts, sources))
    total, active = count_parameters(moe)
    layers = [i + 1 for i in moe.config.moe_layers()]
    typer.echo(
        f"moembed: wrote {out}: {experts} experts top-{top_k}{f' in groups of {granularity}' if granularity > 1 else ''} "
        f"on layers {layers}; "
        f"{total:,} parameters, {active:,} active per token",
        err=True,
    )


def upcycle_card(model: str, options: dict, kmeans_texts: Path | None, texts: list[str] | None,
                 sources: list[str] | None = None):
    """The model card's recipe (the dense model and every upcycling option, as the command line gives them) and
    data (the texts, and with --label their sources, when the router was initialised from them)."""
    from moembed.model.card import CardInfo, table

    rows = [("dense model", f"`{model}`"), *((f"`--{k}`", v) for k, v in options.items())]
    training = ("Upcycled with `moembed upcycle` (docs/moe.md), not trained since.\n\n"
                + table(("setting", "value"), rows))
    data = None
    if kmeans_texts is not None and sources is not None:
        data = ("The router's rows were fitted on these texts and their sources.\n\n"
                + table(("file", "records", "sources"),
                        [(f"`{kmeans_texts.name}`", f"{len(texts):,}", f"{len(set(sources)):,}")]))
    elif kmeans_texts is not None:
        data = ("The router's k-means centroids were fitted on these texts.\n\n"
                + table(("file", "records"), [(f"`{kmeans_texts.name}`", f"{len(texts):,}")]))
    return CardInfo(training=training, data=data)
