"""The fast paths of CPU inference (and grouped expert matmuls), as modules swapped in for the plain layers once,
when a model is loaded (`moembed.model.backends.use`) or switched to int8 (`moembed.model.quantize`):

    Linear      → PackedLinear (oneDNN-packed float32 / bf16 weights)  fast/packed.py
                → Int8Linear (int8 weights, per-row quantised inputs)  fast/int8.py
    Experts     → GroupedExperts (grouped matmuls), PackedExperts, Int8Experts  fast/experts.py
    MoEBlock    → InPlaceMoEBlock (packed or int8 experts, outputs combined where they are written)  fast/moe.py
    Attention   → CompiledAttention (attention.c)  fast/attention.py

Each is a subclass of its plain layer holding the same Parameter objects (a swap changes no state dict, optimizer
or checkpoint). Its forward takes the fast path on the calls it was made for (CPU inference: no gradient, eval
mode, the precision it was chosen for) and the plain forward otherwise, so a loaded model can still be trained.
What each kind of layer became, and why, is the model's `Backend` record (`Embedder.backend`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn


def swapped(module: nn.Module, cls: type, **fields) -> nn.Module:
    """A `cls` (a subclass of `module`'s plain class) holding `module`'s parameters, buffers, submodules and
    settings — the same objects — with `fields` set on it."""
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    for registry in ("_parameters", "_buffers", "_modules"):  # its own dicts, the same tensors
        new.__dict__[registry] = dict(module.__dict__[registry])
    new.__dict__.update(fields)
    return new


def swap(model: nn.Module, choose: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    """Replace each submodule m of `model` (and `model` itself) by `choose(m)` where that is not None; returns
    `model`, or its replacement."""
    for name, m in list(model.named_modules()):
        new = choose(m)
        if new is None or new is m:
            continue
        if not name:
            model = new
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return model


FIELDS = ("dtype", "setup", "fused", "compiled", "weight_cache")  # what the fast classes add to a plain layer


def is_fast(module: nn.Module) -> bool:
    return type(module).__module__.startswith(__name__ + ".")


def plain(module: nn.Module) -> nn.Module:
    """The plain layer back from a swapped one (each fast class derives directly from its plain layer), holding the
    same parameters, buffers, submodules and settings; a plain module is returned as it is."""
    if not is_fast(module):
        return module
    base = type(module).__mro__[1]
    new = swapped(module, base)
    for name in FIELDS:
        new.__dict__.pop(name, None)
    return new
