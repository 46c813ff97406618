"""Sparse upcycling of a dense encoder into an MoE encoder (Komatsuzaki et al. 2023; nomic-embed-v2 §4.3).

The MLP of each chosen layer becomes an MoE block whose E experts all start as copies of that dense MLP
(optionally perturbed by a little Gaussian noise), with a freshly initialised router. Every other weight is
copied unchanged. With renormalised gates and identical experts, y = Σ_j g_j · MLP(x) = MLP(x) because the
gates sum to 1, so before any training the upcycled model reproduces the dense model's embeddings.

    >>> moe = upcycle(Embedder.load("all-MiniLM-L6-v2"), num_experts=8, top_k=2, every=2)   # layers 2, 4, 6
"""

from __future__ import annotations

import torch

from moembed.errors import MoembedError, config_error
from moembed.model.config import MoEConfig
from moembed.model.embedder import Embedder
from moembed.model.encoder import Encoder


def _expert_copy(dense: torch.Tensor, num_experts: int, noise: float, gen: torch.Generator) -> torch.Tensor:
    """(…) dense weight → (E, …) copies; noise is a standard deviation relative to the weight's own."""
    w = dense.detach().unsqueeze(0).repeat(num_experts, *([1] * dense.dim()))  # (E, ...)
    if noise > 0:
        std = dense.detach().float().std().item() if dense.numel() > 1 else 1.0
        w = w + noise * std * torch.randn(w.shape, generator=gen, dtype=torch.float32).to(w.dtype)
    return w


def upcycle(
    embedder: Embedder,
    num_experts: int,
    top_k: int,
    every: int,
    offset: int = 1,
    renormalize: bool = True,
    noise: float = 0.0,
    seed: int = 0,
) -> Embedder:
    """A new Embedder whose MLPs on layers i with i % every == offset (0-based) are MoE blocks upcycled from
    the dense MLPs. Defaults follow Nomic v2: every second layer starting from the second.

    num_experts, top_k, renormalize: routing (see `MoEConfig`); noise: std of Gaussian noise added to each
    expert copy, relative to the std of the dense weight (0: exact copies); seed: router init and noise.
    Raises MoembedError on invalid settings or an encoder that already has MoE layers.
    """
    from pydantic import ValidationError

    src = embedder.config
    if src.moe is not None:
        raise MoembedError(f"upcycle: {embedder.name} already has MoE layers {[i + 1 for i in src.moe_layers()]}")
    if noise < 0:
        raise MoembedError(f"upcycle: noise must be >= 0, got {noise}")
    try:
        moe = MoEConfig(num_experts=num_experts, top_k=top_k, every=every, offset=offset, renormalize=renormalize)
        config = src.model_copy(update={"moe": moe})
        config = type(src)(**config.model_dump())  # re-validate the whole config
    except ValidationError as e:
        raise config_error(e, "upcycle") from None
    if not config.moe_layers():
        raise MoembedError(f"upcycle: every={every}, offset={offset} selects no layer of {src.num_layers}")

    gen = torch.Generator().manual_seed(seed)
    encoder = Encoder.for_weights(config)  # every weight is set below: routers drawn, the rest copied
    with torch.no_grad():
        for layer in encoder.layers:  # fresh router: N(0, 0.02) as the encoder's other linears, seeded
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.weight.copy_(torch.randn(layer.mlp.router.weight.shape, generator=gen) * 0.02)
    state = encoder.state_dict()
    for name, value in embedder.encoder.state_dict().items():
        layer_idx = int(name.split(".")[1]) if name.startswith("layers.") else None
        if layer_idx in config.moe_layers() and ".mlp." in name:
            # layers.{i}.mlp.fc1.weight → layers.{i}.mlp.experts.fc1_weight (E, ...)
            prefix, rest = name.split(".mlp.")
            target = f"{prefix}.mlp.experts.{rest.replace('.', '_')}"
            state[target] = _expert_copy(value, num_experts, noise, gen)
        else:
            state[name] = value
    encoder.load_state_dict(state)
    encoder.to(next(embedder.encoder.parameters()).device)

    # Renormalised exact copies reproduce the dense model (see above), so its int8 calibration still holds.
    calibration = embedder.calibration if noise == 0 and renormalize else None
    return embedder.derive(encoder, name=f"{embedder.name}-moe{num_experts}x{top_k}", calibration=calibration)
