"""Backends: how a loaded model runs, chosen once at load and readable afterwards (`Embedder.backend`).

    emb = Embedder.load(path, backend="auto")    # "auto" | "torch" | "fast"  (moembed encode|eval|serve --backend)
    emb.backend.name, emb.backend.path("linear"), emb.backend.why("moe")

A backend is a name for a `Settings` (`settings.BACKENDS`): "torch" runs the plain layers only (the reference),
"fast" every CPU fast path wherever this torch build and a C compiler have it, "auto" each where it was measured
faster on this CPU (and MOEMBED_NO_FASTPATH, read once here, overrides: 0 as "fast", 1 as "torch"). `use` gives
the settings to every layer, decides per layer kind the path its inference takes on this device and precision
(`describe`), swaps the plain layers for the modules of that path (`moembed.model.fast`: `PackedLinear`,
`PackedExperts` combined in place, `GroupedExperts`, `CompiledAttention`) and returns the frozen `Backend` record,
logged once (logger "moembed"). Training passes through a swapped layer take its plain forward; `for_training`
gives a model the grouped expert matmuls wherever torch has a grouped kernel for the training precision.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from moembed.model import cpu, native
from moembed.model.experts import Experts
from moembed.model.fast import plain, swap
from moembed.model.fast.attention import use_compiled
from moembed.model.fast.experts import GroupedExperts, Int8Experts, PackedExperts, grouped_support
from moembed.model.fast.int8 import Int8Linear, int8_path
from moembed.model.fast.moe import InPlaceMoEBlock
from moembed.model.fast.packed import PackedLinear
from moembed.model.linear import Linear
from moembed.model.moe import MoEBlock
from moembed.model.quantize import is_int8
from moembed.model.settings import BACKENDS, Settings, apply

log = logging.getLogger("moembed")


@dataclass(frozen=True)
class LayerPath:
    kind: str  # "linear" | "attention" | "moe"
    path: str  # the path its inference calls take ("packed", "plain", "int8", "compiled", "torch", "grouped", ...)
    why: str  # what decided it


@dataclass(frozen=True)
class Backend:
    """The backend a model was loaded with: its name, its settings and the path of each layer kind."""

    name: str
    settings: Settings
    paths: tuple[LayerPath, ...]

    def path(self, kind: str) -> str:
        return self._get(kind).path

    def why(self, kind: str) -> str:
        return self._get(kind).why

    def _get(self, kind: str) -> LayerPath:
        for p in self.paths:
            if p.kind == kind:
                return p
        raise KeyError(f"backend {self.name!r} has no {kind!r} layers (has {', '.join(p.kind for p in self.paths)})")

    def __str__(self) -> str:
        return f"backend {self.name} ({self.settings.fastpath}): " + "; ".join(
            f"{p.kind} {p.path} ({p.why})" for p in self.paths)


def describe(name: str, settings: Settings, device: torch.device, autocast: torch.dtype | None, int8: bool,
             moe: bool) -> Backend:
    """The `Backend` record of a model on `device` under `autocast` (None: float32), int8 or not, with MoE blocks
    or not: what its inference passes take under `settings`."""
    cpu_device = device.type == "cpu"
    bf16 = autocast == torch.bfloat16
    if not cpu_device:
        linear = LayerPath("linear", "plain", f"{device.type}: torch's own kernels")
    elif int8:
        linear = LayerPath("linear", "int8", int8_path(settings))
    elif bf16 and settings.bf16_packing():
        linear = LayerPath("linear", "packed-bf16", "oneDNN-packed bf16 weights (native bf16 matmuls)")
    elif autocast is None and settings.packing():
        linear = LayerPath("linear", "packed", "oneDNN-packed float32 weights" + _why_switch(settings))
    else:
        linear = LayerPath("linear", "plain", _why_plain(settings, autocast))
    paths = [linear]
    if cpu_device and autocast in (None, torch.bfloat16) and settings.compiled_attention():
        built = native.why_not("attention")
        paths.append(LayerPath("attention", "compiled" if built is None else "torch",
                               "attention.c" + _why_switch(settings) if built is None else f"torch ({built})"))
    else:
        why = ("every fast path off" if settings.off else f"{device.type}, autocast {autocast}" if not cpu_device
               or autocast not in (None, torch.bfloat16) else f"attention.c does not pay where torch runs "
               f"{cpu.capability()} kernels")
        paths.append(LayerPath("attention", "torch", f"torch's scaled_dot_product_attention ({why})"))
    if moe:
        built = native.why_not("combine") if int8 or linear.path in ("packed", "packed-bf16") else None
        if built is None and not settings.compiled_loops():
            built = "fast paths off"
        combine = "combined by combine.c" if built is None else f"combined by torch ops ({built})"
        if int8:
            paths.append(LayerPath("moe", "int8-loop", f"expert loop on int8 weights, {combine}"))
        elif linear.path in ("packed", "packed-bf16"):
            paths.append(LayerPath("moe", f"{linear.path}-loop", f"expert loop on {linear.why}, {combine}"))
        else:
            support = grouped_support(device, autocast or torch.float32)
            if support.usable and support.preferred:
                paths.append(LayerPath("moe", "grouped", f"grouped matmuls, torch._grouped_mm ({support.detail})"))
            else:
                paths.append(LayerPath("moe", "loop", f"expert loop instead of grouped matmuls: {support.detail}"))
    return Backend(name, settings, tuple(paths))


def _why_switch(settings: Settings) -> str:
    return " (every fast path on)" if settings.fastpath == "on" else " (pays on this CPU)"


def _why_plain(settings: Settings, autocast: torch.dtype | None) -> str:
    if settings.off:
        return "every fast path off"
    if autocast is not None:
        return f"autocast {str(autocast).removeprefix('torch.')}" + (
            "" if cpu.bf16_native() else " (bf16 emulated on this CPU: no packed bf16 weights)")
    if not cpu.has_packed():
        return "this torch build has no oneDNN packed kernels"
    return f"packed weights do not pay where torch runs {cpu.capability()} kernels"


def setup(model: nn.Module, name: str, settings: Settings, autocast: torch.dtype | None = None) -> Backend:
    """Swap the layers of `model` (an Encoder or Embedder, its layers given `settings` already) for the modules of
    the paths its inference takes on its device under `autocast` (int8 layers, `quantize.quantize_int8`'s, stay),
    and return the `Backend` record of them; logged once here, where a model is loaded."""
    device = next(model.parameters()).device
    moe = any(isinstance(m, MoEBlock) for m in model.modules())
    backend = describe(name, settings, device, autocast, is_int8(model), moe)
    linear, experts = backend.path("linear"), backend.path("moe") if moe else None
    in_place = experts in ("int8-loop", "packed-loop", "packed-bf16-loop")
    dtype = torch.bfloat16 if (linear == "packed-bf16") else torch.float32

    def choose(m: nn.Module) -> nn.Module | None:
        if isinstance(m, (Int8Linear, Int8Experts)):
            return None
        if isinstance(m, Linear):
            return PackedLinear.from_plain(plain(m), dtype) if linear.startswith("packed") else plain(m)
        if isinstance(m, MoEBlock):
            return InPlaceMoEBlock.from_plain(plain(m)) if in_place else plain(m)
        if isinstance(m, Experts):
            if experts in ("packed-loop", "packed-bf16-loop"):
                return PackedExperts.from_plain(plain(m), dtype)
            return GroupedExperts.from_plain(plain(m)) if experts == "grouped" else plain(m)
        return None

    swap(model, choose)
    use_compiled(model, backend.path("attention") == "compiled")
    log.info("%s", backend)
    return backend


def use(model: nn.Module, name: str = "auto", autocast: torch.dtype | None = None) -> Backend:
    """Give every layer of `model` (an Encoder or Embedder) the settings of backend `name` (`BACKENDS`), swap its
    layers for those of the paths its inference takes on its device under `autocast`, and return (and log) the
    record of them."""
    settings = Settings.for_backend(name)
    apply(model, settings)
    return setup(model, name, settings, autocast)


def for_training(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Give every MoE block of `model` grouped expert matmuls (`GroupedExperts`) where torch prefers them on
    `device` in `dtype` (the training precision); True if it did. The rest of the model keeps its layers (their
    training passes are the plain ones)."""
    support = grouped_support(device, dtype)
    if not support.preferred:
        return False
    swap(model, lambda m: GroupedExperts.from_plain(plain(m)) if isinstance(m, Experts)
         and not isinstance(m, GroupedExperts) else None)
    grouped = any(isinstance(m, GroupedExperts) for m in model.modules())
    if grouped:
        log.info("training: experts as grouped matmuls (%s)", support.detail)
    return grouped


EXPERT_KINDS = ("loop", "grouped")


def use_experts(model: nn.Module, kind: str) -> nn.Module:
    """Run every expert set of `model` as `kind`: "loop" (the plain `Experts`, the reference) or "grouped"
    (`GroupedExperts`, wherever torch has the kernel for a call's device and dtype); returns `model`."""
    if kind not in EXPERT_KINDS:
        raise ValueError(f"experts: expected one of {', '.join(EXPERT_KINDS)}, got {kind!r}")
    make = GroupedExperts.from_plain if kind == "grouped" else (lambda m: m)
    return swap(model, lambda m: make(plain(m)) if isinstance(m, Experts) else None)


__all__ = ["BACKENDS", "Backend", "LayerPath", "describe", "for_training", "setup", "use", "use_experts"]
