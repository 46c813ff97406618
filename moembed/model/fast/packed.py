"""`PackedLinear`: a `Linear` whose CPU inference runs on a copy of its weight re-laid out once for oneDNN.

At CPU inference `F.linear` hands the weight to the BLAS in its stored layout on every call. oneDNN can instead
take a weight re-laid out once for its kernels ("packed"): faster at the matrix shapes of small encoders where
torch runs AVX-512 kernels, slower on AVX2-only CPUs (`Settings.packing`; BENCHMARKS.md). Under bf16 autocast on a
CPU with native bf16 matmuls (AVX-512 BF16, AMX), autocast would cast every weight to bf16 on every call; the packed
bf16 copy is cast once, and the bias added in float32 inside the kernel (`Settings.bf16_packing`). The packed copy
is made on first use and cached per weight version; training passes (the no-grad pass of GradCache included) take
the plain forward and never pay for packing.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from moembed.model.fast import swapped
from moembed.model.linear import Linear
from moembed.model.updates import optimizer_steps


def inference_pass(module: nn.Module, x: torch.Tensor) -> bool:
    """A CPU float32 inference call: no gradient, no autocast, module in eval mode."""
    return (
        x.device.type == "cpu" and x.dtype == torch.float32 and not module.training
        and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    )


def bf16_inference_pass(module: nn.Module, x: torch.Tensor) -> bool:
    """A CPU inference call under bfloat16 autocast: no gradient, module in eval mode."""
    return (
        x.device.type == "cpu" and not module.training and not torch.is_grad_enabled()
        and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    )


def pass_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """The dtype packed weights would serve this call in: float32 for a CPU float32 inference pass, bfloat16 for one
    under bf16 autocast; None for any other call (training, a gradient, another device or precision)."""
    if inference_pass(module, x):
        return torch.float32
    return torch.bfloat16 if bf16_inference_pass(module, x) else None


def pack(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight (n, k) cast to `dtype` and re-laid out for oneDNN's linear kernels."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype))


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False) -> torch.Tensor:
    """x (..., k) @ Wᵀ + b on a `pack`ed weight, in the weight's dtype (x is cast to it); with `gelu`, exact GELU as
    the kernel's post-op, applied to each output block while it is in cache instead of in a pass of its own."""
    post = ("gelu", [], "none") if gelu else ("none", [], "")  # oneDNN's attr, scalars, algorithm ("none": erf)
    return torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, bias, *post)


class WeightCache(dict):
    """Weights derived from a module's parameters (packed, cast, quantised), by name: {name: (key, value)}.

    Rebuilt from the parameters on demand, so it is neither deep-copied nor pickled (oneDNN's packed tensors cannot
    be): a copied or unpickled module starts with an empty cache.
    """

    def __deepcopy__(self, memo) -> "WeightCache":
        return WeightCache()

    def __reduce__(self):
        return (WeightCache, ())


def cached(store: WeightCache, name: str, key: tuple, make):
    """`make()`, kept in `store` (a layer's `weight_cache`) under `name` until `key` changes or an optimizer steps.
    Keys hold (data_ptr, _version) of the weights used, so `load_state_dict` or any in-place update rebuilds it;
    an optimizer's step does too, fused or not (`moembed.model.updates`)."""
    key = (optimizer_steps(), key)
    hit = store.get(name)
    if hit is None or hit[0] != key:
        hit = store[name] = (key, make())
    return hit[1]


class PackedLinear(Linear):
    """`Linear` on oneDNN-packed copies of its float32 weight at CPU inference, for the passes of `dtypes`
    (float32 and/or bfloat16, `pass_dtype`: a model loaded in float32 may still be asked for a bf16 encode)."""

    dtypes: tuple[torch.dtype, ...] = (torch.float32,)

    @classmethod
    def from_plain(cls, linear: Linear, *dtypes: torch.dtype) -> PackedLinear:
        return swapped(linear, cls, dtypes=dtypes or (torch.float32,), weight_cache=WeightCache())

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        dtype = pass_dtype(self, x) if self.weight.dtype == torch.float32 else None
        if dtype not in self.dtypes:
            return super().forward(x, gelu=gelu)
        key = (self.weight.data_ptr(), self.weight._version)
        w = cached(self.weight_cache, f"packed-{dtype}", key, lambda: pack(self.weight, dtype))
        return packed_linear(x, w, self.bias, gelu)
