"""Dynamic int8 inference for a whole model: `quantize_int8(model)` swaps every `Linear` for an `Int8Linear` and every
MoE block's `Experts` for `Int8Experts` (combined in place, `InPlaceMoEBlock`), with per-row quantised activations
(`moembed.model.fast.int8.int8_linear`).

    quantize_int8(emb)                 # what Embedder.load(path, dtype="int8") and --dtype int8 do
    quantize_int8(emb, enabled=False)  # back to the plain float32 layers

Weights are quantised per output channel (symmetric); a few outlier input channels per layer stay in float32, as
LLM.int8()'s mixed-precision decomposition does (Dettmers et al. 2022): `activation_ranges` finds them on one pass
of random tokens, since outlier channels are a property of the trained weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moembed.model import cpu
from moembed.model.experts import Experts
from moembed.model.fast import plain, swap
from moembed.model.fast.experts import Int8Experts
from moembed.model.fast.int8 import Int8Linear, Int8Setup
from moembed.model.fast.moe import InPlaceMoEBlock
from moembed.model.linear import Linear
from moembed.model.moe import MoEBlock


def int8_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of `model` that `quantize_int8` switches: every `Linear` and every MoE block's `Experts`."""
    return [m for m in model.modules() if isinstance(m, (Linear, Experts))]


def is_int8(model: nn.Module) -> bool:
    """Whether `quantize_int8` switched `model`'s layers to int8."""
    return any(isinstance(m, (Int8Linear, Int8Experts)) for m in model.modules())


def expert_ranges(experts: Experts, x: torch.Tensor, old: tuple | None = None) -> tuple:
    """Largest |input| per channel of every expert's two matmuls, over all tokens x (N, d) of a calibration pass
    (each expert sees every token, so that each gets ranges), merged with `old`: (fc1's (d,), [fc2's (i,)])
    (`Int8Setup.amax` of experts)."""
    old = old or (None, [None] * experts.num_experts)
    fc1 = x.abs().amax(0).float() if old[0] is None else torch.maximum(x.abs().amax(0).float(), old[0])
    fc2 = []
    for e in range(experts.num_experts):
        a = experts.act(F.linear(x, experts.fc1_weight[e], experts.biases(e)[0])).abs().amax(0).float()
        fc2.append(a if old[1][e] is None else torch.maximum(a, old[1][e]))
    return fc1, fc2


@torch.no_grad()
def activation_ranges(model: nn.Module, sequences: int = 32, length: int = 64, seed: int = 0) -> dict:
    """{layer: its amax (`Int8Setup.amax`)} for every int8-capable layer (`int8_layers`) of a float32 model: the
    largest |input| per channel over a float32 pass of seeded random token sequences. Outlier channels are a
    property of the trained weights (they show on any input), so no text is needed, and the result depends on the
    model alone."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = torch.randint(1, config.vocab_size, (sequences, length), generator=g).to(device)  # (S, T)
    ids[ids == config.pad_token_id] = 1
    found: dict = {}

    def record(module: nn.Module, args) -> None:
        a = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()  # (k,)
        found[module] = a if module not in found else torch.maximum(a, found[module])

    def record_experts(block: nn.Module, args) -> None:
        found[block.experts] = expert_ranges(block.experts, args[0], found.get(block.experts))

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, Linear)]
    hooks += [m.register_forward_pre_hook(record_experts) for m in model.modules() if isinstance(m, MoEBlock)]
    was_training = model.training
    model.eval()
    try:
        model(ids, torch.ones_like(ids))
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return {m: found.get(m) for m in int8_layers(model)}


def quantize_int8(model: nn.Module, enabled: bool = True, kernel: str | None = None) -> nn.Module:
    """Swap every linear layer and MoE expert set of an encoder (or Embedder) for int8 ones at inference (or back
    to the plain layers, `enabled=False`), on `kernel` ("onednn" | "fbgemm"; the layers' `Settings.int8_kernel` by
    default). Returns `model`.

    Weights: int8 with one scale per output row, made on first use and remade after any weight update; the
    float32 weights stay, and training and gradient passes use them. Activations: quantised per row at each call
    (`int8_linear`), apart from the few outlier channels `activation_ranges` finds. Raises RuntimeError when this
    torch has no x86 quantised kernels, or `kernel` is "onednn" without oneDNN's kernel or a VNNI/AMX CPU;
    ValueError for an unknown kernel.
    """
    if kernel not in (None, "onednn", "fbgemm"):
        raise ValueError(f"int8 kernel: expected 'onednn' or 'fbgemm', got {kernel!r}")
    model = swap(model, lambda m: plain(m) if isinstance(m, (Linear, Experts, MoEBlock)) else None)
    if not enabled:
        return model
    if not cpu.int8_available():
        raise RuntimeError("int8: this torch build has no x86 quantised linear kernels (fbgemm)")
    if kernel == "onednn" and not (cpu.onednn_int8() and cpu.vnni()):
        raise RuntimeError("int8: oneDNN's kernel needs a torch build with it and a CPU with VNNI or AMX "
                           "(elsewhere its 16-bit pair sums would overflow on the full 8-bit grid)")
    ranges = activation_ranges(model)

    def to_int8(m: nn.Module) -> nn.Module | None:
        if isinstance(m, MoEBlock):
            return InPlaceMoEBlock.from_plain(m)
        if isinstance(m, (Linear, Experts)):
            cls = Int8Linear if isinstance(m, Linear) else Int8Experts
            return cls.from_plain(m, Int8Setup(kernel or m.settings.int8_kernel(), ranges[m]))
        return None

    return swap(model, to_int8)
