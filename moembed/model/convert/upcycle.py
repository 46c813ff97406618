"""Sparse upcycling of a dense encoder into an MoE encoder (Komatsuzaki et al. 2023; nomic-embed-v2 §4.3).

The MLP of each chosen layer becomes an MoE block; every other weight is copied unchanged. Two layouts:

- copies (granularity G = 1): all E experts start as the dense MLP. With renormalised gates,
  y = Σ_j g_j · MLP(x) = MLP(x): the upcycled model reproduces the dense one, but the task loss then gives the
  router exactly no gradient (dy/dg_j is the same for every j and Σ_j g_j = 1), so only noise, the random split
  of tokens and the load-balancing loss make the experts differ.
- virtual groups (G > 1; fine-grained upcycling, He et al. 2024, "Upcycling Large Language Models into Mixture of
  Experts", arXiv 2410.07524): the dense MLP's I hidden units are cut into G slices (fc1 rows and bias, fc2
  columns); expert e = r·G + g holds slice g of copy r with fc2 scaled by G, and the full fc2 bias. The G experts
  of a copy share one router row, so their logits tie and a top-(G·k') choice takes k' whole groups (ties are
  ranked by index, `MoEBlock.route`); with renormalised gates q_A/G per member of group A,
  y = Σ_A q_A · Σ_g (1/G)(G·W2_g·h_g + b2) = MLP(x) exactly, while dy/dlogit_e = ĝ_e (E_e(x) − y) is not zero
  (a slice is not the whole MLP): the router learns from the first step and the tied rows part.
  E = G·R experts of width I/G, top-k = G·k': with k' = 1 the active parameters equal the dense MLP's.

Options, each a control or a remedy for the symmetry above: `noise` (Gaussian noise on the copies), `reinit`
(Drop-Upcycling, Nakamura et al. 2025, arXiv 2502.19261: a ratio r of each expert's hidden units re-drawn from
the dense weight's mean and std), `router_init="kmeans"` (router rows from k-means centroids of the layer's
input token states, `router_init.kmeans_rows`), `router_init="sources"` (rows that send each source's or
language's tokens to its own group of experts from step 0, `router_init.source_rows`), `renormalize=False` (the
released nomic-embed-v2 gates), `top_k=1` (Switch routing, nomic-embed-v2 §7.1), `balance_rate` (auxiliary-loss-free
balancing, `MoEConfig`).

    >>> moe = upcycle(Embedder.load("all-MiniLM-L6-v2"), num_experts=8, top_k=2, every=2)   # layers 2, 4, 6
    >>> fine = upcycle(dense, num_experts=8, top_k=4, every=2, granularity=4)  # 2 groups of 4 quarter-wide experts
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from moembed.errors import MoembedError, config_error
from moembed.model.config import MoEConfig
from moembed.model.embedder import Embedder
from moembed.model.encoder import Encoder

RouterInit = Literal["random", "kmeans", "sources"]


def _slice_rows(w: torch.Tensor, g: int, G: int, swiglu: bool) -> torch.Tensor:
    """Slice g of G of fc1's rows (or bias); SwiGLU keeps the up ([:I]) and gate ([I:]) halves paired."""
    if not swiglu:
        n = w.shape[0] // G
        return w[g * n:(g + 1) * n]
    half = w.shape[0] // 2
    n = half // G
    return torch.cat([w[g * n:(g + 1) * n], w[half + g * n:half + (g + 1) * n]])


def expert_weights(mlp: dict[str, torch.Tensor], num_experts: int, G: int, swiglu: bool) -> dict[str, torch.Tensor]:
    """The dense MLP's {fc1.weight, fc1.bias, fc2.weight, fc2.bias} → stacked expert tensors {fc1_weight (E, r, d),
    fc1_bias (E, r), fc2_weight (E, d, I/G), fc2_bias (E, d)}: expert r·G + g holds slice g, fc2 scaled by G."""
    out: dict[str, list[torch.Tensor]] = {}
    for e in range(num_experts):
        g = e % G
        for name, w in mlp.items():
            w = w.detach()
            if name.startswith("fc1"):
                part = _slice_rows(w, g, G, swiglu)
            elif name == "fc2.weight":  # (d, I): columns of slice g, scaled so that the group's mean is the MLP
                n = w.shape[1] // G
                part = w[:, g * n:(g + 1) * n] * G
            else:  # fc2.bias: whole in every expert (the gates of a group sum to 1/G each, G of them)
                part = w
            out.setdefault(name.replace(".", "_"), []).append(part)
    return {k: torch.stack(v) for k, v in out.items()}


def _noise(w: torch.Tensor, noise: float, gen: torch.Generator) -> torch.Tensor:
    """w plus Gaussian noise of std `noise` relative to w's own std (per stacked tensor)."""
    std = w.float().std().item() if w.numel() > 1 else 1.0
    return w + noise * std * torch.randn(w.shape, generator=gen, dtype=torch.float32).to(w.dtype)


def _reinit(weights: dict[str, torch.Tensor], ratio: float, swiglu: bool, gen: torch.Generator) -> None:
    """Drop-Upcycling (arXiv 2502.19261 §3): in each expert, a random `ratio` of its hidden units get fc1 rows (and
    bias entries) and fc2 columns drawn from N(mean, std) of the weight they replace; in place."""
    fc1, fc2 = weights["fc1_weight"], weights["fc2_weight"]  # (E, r, d), (E, d, i)
    E, i = fc2.shape[0], fc2.shape[2]
    n = round(ratio * i)
    if n == 0:
        return
    for e in range(E):
        units = torch.randperm(i, generator=gen)[:n]  # (n,)
        rows = torch.cat([units, units + i]) if swiglu else units
        for w, idx, dim in ((fc1, rows, 0), (fc2, units, 1)):
            part = w[e].index_select(dim, idx)
            fresh = part.mean() + part.std() * torch.randn(part.shape, generator=gen, dtype=torch.float32)
            w[e].index_copy_(dim, idx, fresh.to(w.dtype))
        if "fc1_bias" in weights:
            b = weights["fc1_bias"][e]
            b[rows] = b.mean() + b.std() * torch.randn(rows.shape, generator=gen, dtype=torch.float32).to(b.dtype)


def upcycle(
    embedder: Embedder,
    num_experts: int,
    top_k: int,
    every: int,
    offset: int = 1,
    renormalize: bool = True,
    noise: float = 0.0,
    seed: int = 0,
    *,
    granularity: int = 1,
    reinit: float = 0.0,
    router_init: RouterInit = "random",
    kmeans_texts: list[str] | None = None,
    text_sources: list[str] | None = None,
    balance_rate: float = 0.0,
) -> Embedder:
    """A new Embedder whose MLPs on layers i with i % every == offset (0-based) are MoE blocks upcycled from
    the dense MLPs. Defaults follow Nomic v2: every second layer starting from the second.

    num_experts, top_k, renormalize, balance_rate: routing (see `MoEConfig`); granularity G: virtual groups of G
    experts of width I/G (num_experts, top_k and I divisible by G; 1: whole copies); noise: std of Gaussian noise
    added to each expert, relative to the std of the dense weight (0: none); reinit: ratio of each expert's hidden
    units re-drawn (Drop-Upcycling; 0: none); router_init: "random" (N(0, 0.02)), "kmeans" (centroids of the
    layer's input token states over `kmeans_texts`) or "sources" (rows that route by `text_sources`, the source
    or language of each of `kmeans_texts`; `router_init.source_rows`); seed: router init, noise and
    re-initialisation.
    Raises MoembedError on invalid settings or an encoder that already has MoE layers.
    """
    from pydantic import ValidationError

    src = embedder.config
    G = granularity
    if src.moe is not None:
        raise MoembedError(f"upcycle: {embedder.name} already has MoE layers {[i + 1 for i in src.moe_layers()]}")
    if noise < 0:
        raise MoembedError(f"upcycle: noise must be >= 0, got {noise}")
    if not 0 <= reinit <= 1:
        raise MoembedError(f"upcycle: reinit must be a ratio in [0, 1], got {reinit}")
    if G < 1 or num_experts % G or top_k % G or src.intermediate_size % G:
        raise MoembedError(f"upcycle: granularity {G} must divide num_experts ({num_experts}), top_k ({top_k}) and "
                           f"the MLP's hidden size ({src.intermediate_size})")
    if router_init not in get_args(RouterInit):
        raise MoembedError(f"upcycle: router_init {router_init!r}; choose {', '.join(get_args(RouterInit))}")
    if router_init != "random" and not kmeans_texts:
        raise MoembedError(f"upcycle: router_init {router_init!r} needs texts (kmeans_texts) to cluster the token "
                           "states of")
    if router_init == "sources" and text_sources is None:
        raise MoembedError("upcycle: router_init 'sources' needs the source of each text (text_sources)")
    try:
        moe = MoEConfig(num_experts=num_experts, top_k=top_k, every=every, offset=offset, renormalize=renormalize,
                        expert_size=src.intermediate_size // G if G > 1 else None, balance_rate=balance_rate)
        config = src.model_copy(update={"moe": moe})
        config = type(src)(**config.model_dump())  # re-validate the whole config
    except ValidationError as e:
        raise config_error(e, "upcycle") from None
    if not config.moe_layers():
        raise MoembedError(f"upcycle: every={every}, offset={offset} selects no layer of {src.num_layers}")

    gen = torch.Generator().manual_seed(seed)
    rows = num_experts // G  # distinct router rows: one per copy (virtual group)
    if router_init == "kmeans":
        from moembed.model.convert.router_init import kmeans_rows

        routers = kmeans_rows(embedder, config.moe_layers(), rows, kmeans_texts, seed)  # layer → (R, d)
    elif router_init == "sources":
        from moembed.model.convert.router_init import source_rows

        routers = source_rows(embedder, config.moe_layers(), rows, kmeans_texts, text_sources, seed)
    encoder = Encoder.for_weights(config)  # every weight is set below: routers drawn, the rest copied
    with torch.no_grad():
        for i, layer in enumerate(encoder.layers):  # router rows, seeded; a virtual group's G rows are equal
            if hasattr(layer.mlp, "router"):
                w = routers[i] if router_init != "random" else torch.randn(rows, src.hidden_size, generator=gen) * 0.02
                layer.mlp.router.weight.copy_(w.repeat_interleave(G, dim=0))
    state = encoder.state_dict()
    mlps: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in embedder.encoder.state_dict().items():
        layer_idx = int(name.split(".")[1]) if name.startswith("layers.") else None
        if layer_idx in config.moe_layers() and ".mlp." in name:
            prefix, rest = name.split(".mlp.")  # layers.{i}.mlp.fc1.weight → layers.{i}.mlp.experts.fc1_weight
            mlps.setdefault(prefix, {})[rest] = value
        else:
            state[name] = value
    for prefix, mlp in mlps.items():
        weights = expert_weights(mlp, num_experts, G, src.mlp == "swiglu")
        if reinit > 0:
            _reinit(weights, reinit, src.mlp == "swiglu", gen)
        for key, w in weights.items():
            state[f"{prefix}.mlp.experts.{key}"] = _noise(w, noise, gen) if noise > 0 else w
    encoder.load_state_dict(state)
    encoder.to(next(embedder.encoder.parameters()).device)

    # Renormalised groups reproduce the dense model (see above), so its int8 calibration still holds.
    same = noise == 0 and reinit == 0 and renormalize
    name = f"{embedder.name}-moe{num_experts}x{top_k}" + (f"-g{G}" if G > 1 else "")
    return embedder.derive(encoder, name=name, calibration=embedder.calibration if same else None)
