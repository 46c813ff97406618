"""Choosing the torch device a job runs on, from a name in a config or on the command line.

    >>> resolve_device("auto")      # cuda when available, then mps, else cpu
    >>> resolve_device("cuda:1")    # the second GPU; an error when there is none

Names: "auto" (or None), "cpu", "cuda", "cuda:N", "mps". A name that is unknown, or that names a device this
machine does not have, raises MoembedError listing the choices.
"""

from __future__ import annotations

import re

import torch

from moembed.errors import MoembedError

DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(name: str | None) -> torch.device:
    """The torch.device for `name` (see the module docstring)."""
    if name is None or name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", name)
    if m:
        if not torch.cuda.is_available():
            raise MoembedError(f"device: {name!r} asked for, but CUDA is not available here; choose one of {', '.join(DEVICES)}")
        if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
            raise MoembedError(f"device: {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return torch.device(name)
    if name == "mps":
        if not _mps_available():
            raise MoembedError(f"device: 'mps' asked for, but MPS is not available here; choose one of {', '.join(DEVICES)}")
        return torch.device("mps")
    raise MoembedError(f"device: unknown {name!r}; choose one of {', '.join(DEVICES)}")


# Autocast dtypes for inference: weights stay float32, matmuls run in the lower precision.
DTYPES = {"float32": None, "fp32": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
# Not an autocast: dynamic int8 linear layers and experts on the CPU (`moembed.model.quantize.quantize_int8`, which
# `Embedder.load(dtype="int8")` applies); no autocast around them.
INT8 = "int8"


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `name` on `device` (None: plain float32, and for "int8", whose int8 layers the model
    switches on itself).

    "auto" (or None): bfloat16 on an accelerator, float32 on the CPU; "float32" | "bfloat16" | "float16" (also
    "fp32", "bf16", "fp16") as named; "int8" on the CPU only. An unknown name, or "int8" on another device, raises
    MoembedError.
    """
    if name is None or name == "auto":
        return None if device.type == "cpu" else torch.bfloat16
    if name == INT8:
        if device.type != "cpu":
            raise MoembedError(f"dtype: 'int8' (dynamic int8) runs on the CPU only; the device is {device}")
        return None
    if name not in DTYPES:
        raise MoembedError(f"dtype: unknown {name!r}; choose one of auto, {', '.join(DTYPES)}, {INT8}")
    return DTYPES[name]
