"""`Linear`: nn.Linear that can fuse exact GELU into its call, and whose settings the backends read.

The plain layer of training and of reference inference. Its fast inference paths — oneDNN-packed float32 and bf16
weights (`moembed.model.fast.packed.PackedLinear`), int8 weights (`moembed.model.fast.int8.Int8Linear`) — are
subclasses swapped in once, when a model is loaded (`moembed.model.backends`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moembed.model.settings import UsesSettings


class Linear(UsesSettings, nn.Linear):
    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """x Wᵀ + b, or with `gelu` (a keyword, so that hooks see the same input) exact GELU of it (a backend may
        fuse it into the matmul)."""
        y = F.linear(x, self.weight, self.bias)
        return F.gelu(y) if gelu else y
