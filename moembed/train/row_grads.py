"""Embedding-table gradients built from the rows a step looked up, once, after its backward pass.

A contrastive step encodes queries, documents and hard negatives in separate forward passes (train/step.py), and
autograd's embedding backward gives each pass a dense (vocabulary, width) gradient, summed before it reaches the
table's .grad. For multilingual-e5-small's XLM-R table (250,037 × 384 float32) that is 384 MB per pass, made while
the other passes' activations are still alive: with AdamW's state, the peak of the multilingual quickstart's MoE
steps on short texts (BENCHMARKS.md, "Multilingual quickstart: memory per stage"). A step looks up a few
thousand distinct rows, so each pass here keeps only its per-row sums of output gradients (rows looked up ×
width), and `flush` adds them into one dense .grad after the backward pass, when the activations are freed.

The result is bitwise autograd's: each pass's sums run over its tokens in order, as the dense kernel's do, and
the passes are added in the order autograd would have added them (the order their backward nodes ran), starting
from the zeros of a gradient that did not exist yet (0 + x = x). Every parameter still gets a dense .grad, so
clipping, the optimizer and checkpoints see exactly what they saw before; only the table's gradient exists for a
shorter time. Tables whose weight is tied to another module (an MLM decoder) keep autograd's path, since the
order of their two sources could differ; so does training over several processes, whose gradient sync waits for
every parameter's own accumulation (`moembed.distributed.GradientSync`).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn


class _Lookup(torch.autograd.Function):
    """`F.embedding(ids, weight, padding_idx)` whose backward hands its per-row gradient sums to a `_Rows`."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, rows: _Rows):
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.rows = padding_idx, rows
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        ids = ids.reshape(-1)  # (N,)
        grad = grad.reshape(ids.numel(), -1)  # (N, d)
        if ctx.padding_idx is not None:  # the padding row gets no gradient (as F.embedding's backward)
            keep = ids != ctx.padding_idx
            ids, grad = ids[keep], grad[keep]
        looked_up, where = torch.unique(ids, return_inverse=True)  # (R,), (N,)
        sums = grad.new_zeros(len(looked_up), grad.shape[1]).index_add_(0, where, grad)  # (R, d), tokens in order
        ctx.rows.parts.append((looked_up, sums))
        return None, None, None, None


class _Rows:
    """One table's per-pass row sums, waiting for `flush`."""

    def __init__(self, module: nn.Embedding):
        # A weak reference: the module holds this object (its forward), and a cycle would keep the model and its
        # gradients alive after training until the garbage collector ran.
        self.ref, self.parts = weakref.ref(module), []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        m = self.ref()
        if not (torch.is_grad_enabled() and m.weight.requires_grad):
            return nn.Embedding.forward(m, ids)
        return _Lookup.apply(ids, m.weight, m.padding_idx, self)

    def flush(self) -> None:
        if not self.parts:
            return
        w = self.ref().weight
        grad = w.grad if w.grad is not None else torch.zeros_like(w)  # (V, d)
        for looked_up, sums in self.parts:
            grad.index_add_(0, looked_up, sums.to(grad.dtype))
        self.parts.clear()
        w.grad = grad


def _plain(m: nn.Module) -> bool:
    """An nn.Embedding whose backward is a plain sum of output gradients per row."""
    return (type(m) is nn.Embedding and m.max_norm is None and not m.scale_grad_by_freq and not m.sparse
            and m.weight.requires_grad)


class RowGradients:
    """While installed, every plain, untied nn.Embedding of `module` gathers its gradient from the rows looked up;
    `flush()` after the backward pass(es) of a step writes the tables' .grad, `discard()` drops a step's sums
    (a step that failed), `remove()` restores the modules."""

    def __init__(self, module: nn.Module):
        uses: dict[int, int] = {}
        for _, p in module.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        self.tables = [_Rows(m) for m in module.modules() if _plain(m) and uses[id(m.weight)] == 1]
        for t in self.tables:
            t.ref().forward = t.forward

    def flush(self) -> None:
        for t in self.tables:
            t.flush()

    def discard(self) -> None:
        for t in self.tables:
            t.parts.clear()

    def remove(self) -> None:
        for t in self.tables:
            t.parts.clear()
            m = t.ref()
            if m is not None:
                del m.forward  # the class's forward again
        self.tables = []
