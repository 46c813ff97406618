"""`Linear`: nn.Linear with a CPU inference fast path.

At inference on CPU in float32, `F.linear` hands the weight to the BLAS in its stored layout on every call.
oneDNN can instead take a weight re-laid out once for its kernels ("packed"); on AVX-512 machines that is about
twice as fast for the matrix shapes of small encoders, and linear layers are ~75% of encoding time. The packed
copy is made lazily, cached per weight version, and used only when no gradient is needed, so training and
autograd always see the plain `F.linear`. Set MOEMBED_NO_FASTPATH=1 to disable it.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

_HAS_PACKED = hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()


def fastpath_enabled() -> bool:
    return _HAS_PACKED and os.environ.get("MOEMBED_NO_FASTPATH", "") in ("", "0")


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.device.type == "cpu"
            and x.dtype == torch.float32
            and self.weight.dtype == torch.float32
            and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu")
            and fastpath_enabled()
        ):
            return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _packed_weight(self) -> torch.Tensor:
        # Keyed by storage and version counter: any in-place update (optimizer step, load_state_dict) repacks.
        key = (self.weight.data_ptr(), self.weight._version)
        cache = self.__dict__.get("_packed")
        if cache is None or cache[0] != key:
            cache = (key, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach()))
            self.__dict__["_packed"] = cache
        return cache[1]
