"""The batched inference loop shared by everything that embeds token ids: length-sorted batches, input order.

    (emb,) = run_batches(ids, batch_size, forward, widths=(d,))   # forward(id lists of one batch) -> (B, d)

Texts are sorted by token count, longest first, and cut into batches of `batch_size`, so each batch holds texts
of similar length and needs little padding; each batch's rows are written back to their texts' places, so the
result is in input order. How a batch is padded and run is the caller's `forward` (right padding for moembed's
encoders, left padding for decoder LMs): the loop only orders, collects and reports progress. An embedding does
not depend on its batch as long as `forward` computes each row on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moembed.errors import MoembedError
from moembed.progress import Progress

# One batch of token-id lists → one (B, w) tensor per output (a tensor, or a tuple of them).
BatchForward = Callable[[list[list[int]]], torch.Tensor | tuple[torch.Tensor, ...]]


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices of the texts grouped into batches of at most `batch_size`, longest texts first (stable)."""
    if batch_size < 1:
        raise MoembedError(f"batch_size: must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


def run_batches(ids: list[list[int]], batch_size: int, forward: BatchForward, widths: Sequence[int],
                progress: Progress | None = None) -> tuple[torch.Tensor, ...]:
    """Run `forward` over length-sorted batches of `ids`; one float32 CPU tensor (n, w) per output, in input order.

    widths: the number of columns of each output of `forward`; progress: called with (done, total) after each batch.
    """
    outs = tuple(torch.zeros(len(ids), w) for w in widths)
    done = 0
    for idx in length_sorted_batches([len(x) for x in ids], batch_size):
        result = forward([ids[i] for i in idx])
        result = result if isinstance(result, tuple) else (result,)
        for out, r in zip(outs, result, strict=True):
            out[idx] = r.float().cpu()  # (B, w) rows back to their texts' places
        done += len(idx)
        if progress is not None:
            progress(done, len(ids))
    return outs
