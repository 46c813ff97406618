"""Dynamic int8 inference for a whole model: `quantize_int8(model)` switches every `Linear` and every MoE block's
`Experts` to int8 weights with per-row quantised activations (`moembed.model.linear.int8_linear`).

    quantize_int8(emb)                 # what Embedder.load(path, dtype="int8") and --dtype int8 do
    quantize_int8(emb, enabled=False)  # back to float32

Weights are quantised per output channel (symmetric); a few outlier input channels per layer stay in float32, as
LLM.int8()'s mixed-precision decomposition does (Dettmers et al. 2022): `activation_ranges` finds them on one pass
of random tokens, since outlier channels are a property of the trained weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from moembed.model import cpu
from moembed.model.experts import Experts
from moembed.model.linear import Int8Setup, Linear
from moembed.model.moe import MoEBlock


def int8_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of `model` that `quantize_int8` switches: every `Linear` and every MoE block's `Experts`."""
    return [m for m in model.modules() if isinstance(m, (Linear, Experts))]


def is_int8(model: nn.Module) -> bool:
    """Whether `quantize_int8` switched `model`'s layers to int8."""
    return any(m.int8 is not None for m in int8_layers(model))


@torch.no_grad()
def activation_ranges(model: nn.Module, sequences: int = 32, length: int = 64, seed: int = 0) -> dict:
    """{layer: its amax (`Int8Setup.amax`)} for every int8-capable layer (`int8_layers`): the largest |input| per
    channel over a plain float32 pass of seeded random token sequences. Outlier channels are a property of the
    trained weights (they show on any input), so no text is needed, and the result depends on the model alone."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = torch.randint(1, config.vocab_size, (sequences, length), generator=g).to(device)  # (S, T)
    ids[ids == config.pad_token_id] = 1
    layers = int8_layers(model)
    found: dict = {}

    def record(module: nn.Module, args) -> None:
        found[module] = _max_abs(args[0], found.get(module))

    def record_experts(block: nn.Module, args) -> None:
        found[block.experts] = block.experts.input_ranges(args[0], found.get(block.experts))

    hooks = [m.register_forward_pre_hook(record) for m in layers if isinstance(m, Linear)]
    hooks += [m.register_forward_pre_hook(record_experts) for m in model.modules() if isinstance(m, MoEBlock)]
    was_training, setups = model.training, [m.int8 for m in layers]
    model.eval()
    for m in layers:
        m.int8 = None  # the ranges of the float32 layers
    try:
        model(ids, torch.ones_like(ids))
    finally:
        model.train(was_training)
        for m, setup in zip(layers, setups):
            m.int8 = setup
        for h in hooks:
            h.remove()
    return {m: found.get(m) for m in layers}


def _max_abs(x: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    a = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()  # (k,)
    return a if old is None else torch.maximum(a, old)


def quantize_int8(model: nn.Module, enabled: bool = True, kernel: str | None = None) -> nn.Module:
    """Switch every linear layer and MoE expert of an encoder (or Embedder) to int8 at inference (or back,
    `enabled=False`), on `kernel` ("onednn" | "fbgemm"; the layers' `Settings.int8_kernel` by default). Returns
    `model`.

    Weights: int8 with one scale per output row, made on first use and remade after any weight update; the
    float32 weights stay, and training and gradient passes use them. Activations: quantised per row at each call
    (`int8_linear`), apart from the few outlier channels `activation_ranges` finds. Raises RuntimeError when this
    torch has no x86 quantised kernels, or `kernel` is "onednn" without oneDNN's kernel or a VNNI/AMX CPU;
    ValueError for an unknown kernel.
    """
    if kernel not in (None, "onednn", "fbgemm"):
        raise ValueError(f"int8 kernel: expected 'onednn' or 'fbgemm', got {kernel!r}")
    layers = int8_layers(model)
    if not enabled:
        for m in layers:
            m.int8 = None
        return model
    if not cpu.int8_available():
        raise RuntimeError("int8: this torch build has no x86 quantised linear kernels (fbgemm)")
    if kernel == "onednn" and not (cpu.onednn_int8() and cpu.vnni()):
        raise RuntimeError("int8: oneDNN's kernel needs a torch build with it and a CPU with VNNI or AMX "
                           "(elsewhere its 16-bit pair sums would overflow on the full 8-bit grid)")
    ranges = activation_ranges(model)
    for m in layers:
        m.int8 = Int8Setup(kernel or m.settings.int8_kernel(), ranges[m])
    return model


