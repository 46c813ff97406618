"""The MLP activations, by the name `EncoderConfig.mlp` gives them: what dense MLPs and experts apply to fc1's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020) on fc1's output h (..., 2i): up * silu(gate), rows [:i] of fc1 up, rows [i:] gate."""
    up, gate = h.chunk(2, dim=-1)
    return up * F.silu(gate)


MLP_ACTIVATIONS = {"gelu": F.gelu, "swiglu": swiglu}  # exact GELU: BERT's MLP
# The same, in place, for a buffer the caller owns (int8 inference's matmul outputs: no fresh (N, i) buffer per call;
# int8 encode 0.97-0.98x the CPU time, BENCHMARKS.md "On a Zen 4 EPYC"). Kinds without one apply MLP_ACTIVATIONS.
INPLACE_ACTIVATIONS = {"gelu": torch.ops.aten.gelu_}
