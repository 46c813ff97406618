"""Selective activation recomputation: an MLP keeps its pre-activation for backward, not its activation output.

In `fc2(act(fc1(x)))` autograd keeps two (tokens, intermediate) tensors per MLP: h = fc1(x), for act's own
backward, and a = act(h), for fc2's weight gradient. They are the largest activations a BERT-style layer keeps
(intermediate = 4 × hidden; a top-2 MoE layer keeps both for every token twice). `then_recomputed` lets fc2 keep
h instead of a and recomputes a = act(h) when backward reaches fc2: one elementwise pass more, one (N, i) tensor
less per MLP: a lower peak for about the time that faulting in the tensor it replaces would cost
(`benchmarks/recompute.py`; BENCHMARKS.md). The recomputed a is bitwise the a of the forward
pass (the same op on the same h), so gradients are unchanged; Megatron-LM calls the idea selective recomputation
(Korthikanti et al. 2022, which recompute the attention core for the same reason).

The mechanism is autograd's saved-tensor hooks: within fc2, a saved tensor that is `a` itself (same storage,
offset, shape and strides) is packed as a recipe (h, act) instead. Anything else fc2 saves (its weight, a view
of a it made itself) is kept as is, so the result is right whatever fc2 does, only the saving may be missed.

    set_recompute(model, True)    # what `moembed train` does (TrainConfig.recompute_activations)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


def _key(t: torch.Tensor) -> tuple:
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


class _Recipe:
    """How to remake a saved activation in backward: act(h), under the autocast state of the forward pass."""

    __slots__ = ("act", "h", "autocast", "want")

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, want: tuple):
        device = h.device.type
        self.act, self.h, self.want = act, h, want
        self.autocast = device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)

    def remake(self) -> torch.Tensor:
        device, dtype, enabled = self.autocast
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            a = self.act(self.h)
        if (tuple(a.shape), a.stride(), a.dtype) != self.want:  # act is not what the forward pass ran
            raise RuntimeError(f"recomputed activation {tuple(a.shape)} {a.dtype} differs from the saved {self.want}")
        return a


def then_recomputed(act: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
                    consume: Callable[[torch.Tensor], torch.Tensor], enabled: bool = True) -> torch.Tensor:
    """consume(act(h)); when `enabled` and a graph is being recorded, the output of act is not kept for backward
    (consume's saved copy of it is recomputed from h). act must be deterministic and must not change h."""
    a = act(h)
    if not (enabled and torch.is_grad_enabled() and a.requires_grad):
        return consume(a)
    target, want = _key(a), (tuple(a.shape), a.stride(), a.dtype)

    def pack(t: torch.Tensor):
        return _Recipe(act, h, want) if _key(t) == target else t

    def unpack(p):
        return p.remake() if isinstance(p, _Recipe) else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return consume(a)


def set_recompute(module: nn.Module, on: bool) -> None:
    """Turn recomputation of MLP activations on or off in every MLP and expert set inside `module`."""
    for m in module.modules():
        if hasattr(m, "recompute_act"):
            m.recompute_act = on
