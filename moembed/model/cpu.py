"""What this CPU and this torch build offer the inference paths: each probe made on first use, then cached.

    cpu.flags()          {"avx512_bf16": True, "amx_bf16": False, ...} as torch detects them ({} if unknown)
    cpu.packing_pays()   oneDNN-packed float32 weights beat the plain matmul (AVX-512 kernels)
    cpu.bf16_native()    bf16 matmuls run natively (AVX-512 BF16, AMX)
    cpu.vnni()           int8 dot products into 32-bit sums (AVX-512 VNNI, AVX-VNNI, AMX)

Nothing here changes with the model or the user's wishes: which of these a model uses is `settings.Settings`'
choice, made once when the model is built or loaded. Tests replace a probe with `monkeypatch.setattr(cpu, name, ...)`.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def flags() -> dict:
    """This CPU's features as torch detects them ({} where this torch cannot tell)."""
    return dict(torch._C._cpu._get_cpu_capability()) if hasattr(torch._C, "_cpu") else {}


@functools.cache
def capability() -> str:
    """The kernel level torch dispatches to on this CPU ("AVX2", "AVX512", ...)."""
    return torch.backends.cpu.get_cpu_capability()


def packing_pays(level: str | None = None) -> bool:
    """Whether oneDNN-packed float32 weights beat the plain `F.linear` on a CPU whose torch kernel level is `level`
    (this one's by default): where torch runs AVX-512 kernels (AMX CPUs included), not on AVX2 only. The compiled
    attention loop (16-wide register tiles) pays on the same CPUs."""
    return (level or capability()).startswith("AVX512")


@functools.cache
def has_packed() -> bool:
    """Whether this torch build has oneDNN's packed linear kernels."""
    return hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()


@functools.cache
def bf16_native() -> bool:
    """Whether bfloat16 matmuls run natively on this CPU: AVX-512 BF16 or AMX on x86, oneDNN's bf16 support elsewhere."""
    f = flags()
    if f.get("architecture", "x86_64") in ("x86_64", "x86"):
        return bool(f.get("avx512_bf16") or f.get("amx_bf16"))
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_is_fast(device: torch.device | str = "cpu") -> bool:
    """Whether bfloat16 matmuls run natively on `device`: a CUDA GPU with bf16 support, or a CPU with AVX-512 BF16 or
    AMX (x86), or oneDNN's bf16 support elsewhere. Other x86 CPUs (AVX2 only) emulate them, several times slower
    than float32, so bf16 autocast there costs time instead of saving it."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return True  # mps and others: bf16 is native where torch offers it
    return bf16_native()


def amx_bf16() -> bool:
    """AMX tiles, which run bf16 attention natively (so training keeps bf16 there)."""
    return bool(flags().get("amx_bf16", False))


def has_vnni(f: dict) -> bool:
    """Whether a CPU with features `f` has int8 dot products into 32-bit sums."""
    return any(f.get(name) for name in ("avx512_vnni", "avx_vnni", "amx_int8"))


@functools.cache
def vnni() -> bool:
    """This CPU's `has_vnni`."""
    return has_vnni(flags())


@functools.cache
def int8_available() -> bool:
    """Whether this torch build has the x86 dynamic-quantisation kernels the int8 layers use."""
    engines = torch.backends.quantized.supported_engines
    return hasattr(torch.ops.quantized, "linear_dynamic") and ("x86" in engines or "fbgemm" in engines)


@functools.cache
def onednn_int8() -> bool:
    """Whether this torch build has oneDNN's quantised linear (u8 activations x s8 weights) and its prepack."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")
            and hasattr(torch.ops.onednn, "qlinear_prepack"))
