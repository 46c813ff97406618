"""`moembed move ...`: MoVE vocabulary pairs, models and inference export (MoVE §3.1)."""

from __future__ import annotations

from pathlib import Path

import typer

from moembed.cli import options as o

move_app = typer.Typer(help="Mixture-of-Vocabulary-Experts: large input vocabularies built from a small one.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(move_app, name="move")


def _read_corpus(files: list[Path], max_texts: int | None) -> list[str]:
    from itertools import islice

    from moembed.data.tokenizers import iter_training_text
    from moembed.errors import MoembedError

    texts = [t for t in islice(iter_training_text([str(f) for f in files]), max_texts) if t.strip()]
    if not texts:
        raise MoembedError(f"{', '.join(map(str, files))}: no texts")
    return texts


@move_app.command("build-vocab")
def build_vocab(
    texts: list[Path] = typer.Argument(..., help="text files: .jsonl (strings, or query/document/text fields) or plain lines"),
    out: Path = o.out_option("output vocabulary directory"),
    base_size: int = typer.Option(5000, help="|V_s|, the base vocabulary"),
    size: int = typer.Option(30000, help="|V_l|, the routing vocabulary the model reads"),
    experts: int = typer.Option(None, help="number of experts K (default: the §4.4.2 heuristic)"),
    routing: o.Routing = typer.Option("hash", help="how tokens are assigned to experts (App. D)"),
    semantic_model: Path = typer.Option(None, help="embedding model whose token vectors cluster semantic routing"),
    max_texts: int = typer.Option(None, help="use only the first N texts"),
    min_frequency: int = typer.Option(2, help="BPE: least pair count for a merge"),
    lowercase: bool = typer.Option(True, help="lowercase and strip accents before BPE (as `moembed tokenizer train`)"),
    quiet: o.Quiet = False,
) -> None:
    """Train a BPE to |V_l| on text files, cut V_s from its first merges, decompose V_l into V_s (φ) and route."""
    from moembed.data.vocab_pair import build_vocab_pair
    from moembed.errors import MoembedError
    from moembed.model.move import expert_mass, move_budget

    corpus = _read_corpus(texts, max_texts)
    if routing == "semantic" and semantic_model is None:
        raise MoembedError("--semantic-model: semantic routing needs an embedding model directory")
    try:
        k, d_e = move_budget(base_size, size, 384, experts)
    except ValueError as e:
        raise MoembedError(f"--base-size/--size/--experts: {e}") from None
    vectors = None
    if routing == "semantic":
        from moembed.model.embedder import Embedder

        teacher = Embedder.load(semantic_model)
        vectors = lambda strings: teacher.embed_tensor(  # noqa: E731
            strings, batch_size=256, show_progress=not quiet, desc="token vectors")
    pair = build_vocab_pair(corpus, base_size, size, k, routing, vectors, min_frequency, lowercase=lowercase)
    pair.save(out)
    vs, vl = pair.sizes
    mass = expert_mass(pair.routing, pair.frequency, k)
    typer.echo(
        f"moembed: wrote V_s={vs} / V_l={vl} pair to {out}: K={k} (d_e={d_e} by the budget heuristic), "
        f"at most {pair.phi.shape[1]} pieces per token, expert mass max/min {float(mass.max() / mass.min().clamp(min=1)):.3f}",
        err=True,
    )


@move_app.command("init")
def init(
    vocab: Path = typer.Argument(..., help="vocabulary directory from `moembed move build-vocab`"),
    out: Path = o.out_option("output model directory"),
    kind: o.VocabKind = typer.Option("move", help="move: MoVE V_s → V_l; base: plain V_s table; "
                                                  "large: plain V_l table"),
    family: o.Family = typer.Option("bert", help="layer style"),
    layers: int = typer.Option(4, help="transformer layers"),
    hidden: int = typer.Option(384, help="hidden size d"),
    heads: int = typer.Option(12, help="attention heads"),
    intermediate: int = typer.Option(1536, help="MLP width"),
    max_length: int = typer.Option(512, help="maximum tokens per text"),
    expert_dim: int = typer.Option(None, help="d_e (default: the §4.4.2 budget heuristic)"),
    routing: o.Routing = typer.Option(None, help="default: the vocabulary's"),
    residual: bool = typer.Option(False, help="experts add their input to their output"),
    seed: int = typer.Option(0, help="random initialisation seed"),
) -> None:
    """Write a new, randomly initialised model on a vocabulary pair (to be trained by `moembed train`)."""
    import torch
    from pydantic import ValidationError

    from moembed.data.vocab_pair import VocabPair, make_embedder
    from moembed.errors import MoembedError, config_error

    pair = VocabPair.load(vocab)
    torch.manual_seed(seed)
    try:
        emb = make_embedder(
            pair, kind, family, expert_dim=expert_dim, routing=routing, residual=residual, max_length=max_length,
            hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=intermediate,
        )
    except ValidationError as e:
        raise config_error(e, "model config") from None
    emb.save(out)
    n = sum(p.numel() for p in emb.encoder.parameters())
    typer.echo(f"moembed: wrote {kind} model ({n:,} parameters, vocabulary {emb.config.vocab_size}) to {out}", err=True)


@move_app.command("export")
def export(
    model: str = typer.Argument(..., help="moembed model directory with a MoVE embedding layer"),
    out: Path = o.out_option("output model directory (plain lookup embedding)"),
) -> None:
    """Precompute the |V_l| x d MoVE table and save a model whose embedding layer is a plain lookup."""
    from moembed.data.calibration import ensure_calibration
    from moembed.errors import MoembedError
    from moembed.model.convert.lookup import to_lookup
    from moembed.model.embedder import Embedder

    emb = Embedder.load(model)
    if emb.config.move is None:
        raise MoembedError(f"{model}: this model has no MoVE embedding layer (config.json encoder.move is null)")
    lookup = to_lookup(emb)
    typer.echo(f"moembed: {ensure_calibration(lookup)}", err=True)
    lookup.save(out)
    typer.echo(f"moembed: wrote a {emb.config.vocab_size} x {emb.dim} lookup model to {out}", err=True)
