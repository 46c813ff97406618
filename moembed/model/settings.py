"""How a model runs on this machine: one frozen `Settings`, chosen when the model is built or loaded, never after.

    s = Settings.from_env()          # MOEMBED_NO_FASTPATH read here, once: unset "auto", 0 "on", 1 "off"
    s = Settings.for_backend("torch")  # or by name: "auto" (the CPU's defaults), "torch" (plain torch ops), "fast"
    apply(model, s)                  # every layer that has fast paths now consults `s`

The CPU fast paths (oneDNN-packed float32 and bf16 weights, compiled attention, the compiled per-row loops of the
int8 path and the MoE combine, padded expert rows for bf16 grouped matmuls, attention upcast in bf16 training)
each pay on some CPUs only (`moembed.model.cpu`). `fastpath` says how to choose: "auto" takes each where it was
measured faster, "on" takes each wherever this torch build and compiler have it, "off" takes none (plain torch,
the reference). Layers read `self.settings`, set by `apply`; nothing in the process changes with it, so two
models in one process (a server and a test, a training run and its evaluation) may run with different settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from moembed.errors import MoembedError
from moembed.model import cpu

ENV = "MOEMBED_NO_FASTPATH"
Switch = Literal["auto", "on", "off"]
SWITCHES = ("auto", "on", "off")
# --backend / Embedder.load(backend=): a name for each switch; "auto" reads MOEMBED_NO_FASTPATH once.
BACKENDS = {"auto": "auto", "torch": "off", "fast": "on"}


@dataclass(frozen=True)
class Settings:
    fastpath: Switch = "auto"

    def __post_init__(self):
        if self.fastpath not in SWITCHES:
            raise MoembedError(f"fastpath: expected one of {', '.join(SWITCHES)}, got {self.fastpath!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The user's override, MOEMBED_NO_FASTPATH: unset or empty "auto", "0" "on", "1" "off"."""
        value = environ.get(ENV, "")
        switch = {"": "auto", "0": "on", "1": "off"}.get(value)
        if switch is None:
            raise MoembedError(f"{ENV}: expected 0 (every fast path on), 1 (all off) or unset, got {value!r}")
        return cls(switch)

    @classmethod
    def for_backend(cls, name: str, environ: Mapping[str, str] = os.environ) -> Settings:
        """The settings of a backend name (`BACKENDS`); "auto" honours MOEMBED_NO_FASTPATH."""
        if name not in BACKENDS:
            raise MoembedError(f"backend: expected one of {', '.join(BACKENDS)}, got {name!r}")
        return cls.from_env(environ) if name == "auto" else cls(BACKENDS[name])

    @property
    def off(self) -> bool:
        """Every CPU fast path off: plain torch ops only."""
        return self.fastpath == "off"

    def switched_on(self, pays: bool) -> bool:
        """A fast path that pays on some CPUs: "auto" where `pays`, "on" always, "off" never."""
        return self.fastpath == "on" or (self.fastpath == "auto" and pays)

    def packing(self) -> bool:
        """float32 CPU inference on oneDNN-packed weights: where it pays (AVX-512), wherever torch has it with "on"."""
        return cpu.has_packed() and self.switched_on(cpu.packing_pays())

    def bf16_packing(self) -> bool:
        """bf16-autocast CPU inference on packed bf16 weights: where bf16 is native and torch has the kernels."""
        return cpu.has_packed() and cpu.bf16_native() and not self.off

    def compiled_attention(self) -> bool:
        """`attention.c` at CPU inference: where torch runs AVX-512 kernels (its tiles are 16 wide), or "on"."""
        return self.switched_on(cpu.packing_pays())

    def upcast_attention(self) -> bool:
        """bf16 attention computed in float32 in training: on CPUs without AMX (their bf16 kernel is slow)."""
        return not cpu.amx_bf16() and not self.off

    def compiled_loops(self) -> bool:
        """The compiled per-row int8 loops and the MoE combine loop, where a C compiler builds them."""
        return not self.off

    def pad_rows(self) -> bool:
        """Expert rows padded to a multiple of `fast.experts.ROW_MULTIPLE` for oneDNN's per-shape kernels."""
        return not self.off

    def int8_kernel(self, flags: dict | None = None) -> str:
        """The int8 matmul: "onednn" where the CPU (features `flags`, this one's by default) has int8 dot products
        into 32-bit sums and torch has oneDNN's quantised linear, "fbgemm" otherwise (or with every fast path off).
        Without VNNI, oneDNN's 16-bit pair sums would overflow on the full 8-bit grid."""
        has = cpu.vnni() if flags is None else cpu.has_vnni(flags)
        return "onednn" if has and cpu.onednn_int8() and not self.off else "fbgemm"


class UsesSettings:
    """A layer whose forward consults `settings` (set by `apply`; the default until then)."""

    settings: Settings = Settings()


def apply(model, settings: Settings):
    """Give every layer of `model` (an nn.Module) that consults settings this one; returns `model`."""
    for m in model.modules():
        if isinstance(m, UsesSettings):
            m.settings = settings
    return model
