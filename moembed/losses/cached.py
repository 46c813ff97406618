"""GradCache (Gao et al. 2021): contrastive batches far larger than activation memory allows.

A contrastive loss couples every query with every document, so the batch cannot be split into independent
micro-batches (plain gradient accumulation would shrink the negatives). GradCache splits the *computation*:

1. encode every chunk without gradient, keeping only its outputs and its RNG state;
2. compute the full-batch loss on those cached outputs, made leaves that require grad, and backpropagate it
   as far as the outputs: ∂L/∂e for every embedding e (and ∂L/∂z for every router logit z);
3. re-encode each chunk under grad with its saved RNG state (same dropout masks and router jitter, so the same
   outputs) and backpropagate the cached output gradients into the parameters, one chunk at a time.

Peak activation memory is that of one chunk; the result equals one big forward/backward.

Matryoshka and the MoE auxiliary losses are just parts of the objective computed in step 2. For the auxiliary
losses the router logits of every chunk are cached next to the embeddings (N tokens × E experts per MoE layer,
small next to activations), the losses are computed once on their concatenation, and their gradients ride
along in step 3. The expert counts of step 1, summed over chunks (`Encoded.expert_counts`), give the routing
fractions r_i of the load-balancing loss for the whole batch (the step also sums them over ranks), so they need
no extra forward pass. The plain path computes the same losses on the concatenation of its forward passes' router
logits, so both paths optimise the same total loss with the same gradients (dropless routing; with a capacity
factor, which tokens are dropped depends on the chunk and parity is lost).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from moembed.model.tokenizer import Batch

# A forward pass on one batch: (embeddings (n, d), router logits per MoE layer (N, E), expert counts per layer (E,)).
Forward = Callable[[Batch], tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]


@dataclass
class Encoded:
    """Outputs of encoding several batches (e.g. queries, documents, negatives), in the order given."""

    embeddings: list[torch.Tensor]  # one (n_b, d) per batch
    router_logits: tuple[torch.Tensor, ...]  # per MoE layer: (N, E) over the tokens of all batches, in order
    expert_counts: tuple[torch.Tensor, ...]  # per MoE layer: (E,) routed tokens per expert, summed, no grad


# The objective maps the encoded batches to (scalar loss to backpropagate, anything the caller wants back).
Objective = Callable[[Encoded], tuple[torch.Tensor, Any]]


def split_batch(batch: Batch, size: int) -> list[Batch]:
    """Consecutive chunks of at most `size` rows (the last may be shorter)."""
    n = batch.input_ids.shape[0]
    return [
        Batch(batch.input_ids[i : i + size], batch.attention_mask[i : i + size], batch.token_type_ids[i : i + size], 0)
        for i in range(0, n, size)
    ]


def _merge(outputs: list[tuple[torch.Tensor, tuple, tuple]], groups: list[int]) -> Encoded:
    """Concatenate per-pass outputs; `groups[k]` is how many consecutive passes make up batch k."""
    embeddings, start = [], 0
    for g in groups:
        embeddings.append(torch.cat([o[0] for o in outputs[start : start + g]]))  # (n_b, d)
        start += g
    layers = len(outputs[0][1]) if outputs else 0
    logits = tuple(torch.cat([o[1][l] for o in outputs]) for l in range(layers))  # (N, E) per layer
    counts = tuple(torch.stack([o[2][l].detach() for o in outputs]).sum(0) for l in range(layers))  # (E,)
    return Encoded(embeddings, logits, counts)


def plain_backward(forward: Forward, batches: list[Batch], objective: Objective, last_backward=nullcontext) -> Any:
    """The reference path: encode every batch under grad, compute the objective, backpropagate.

    `last_backward()` is entered around the backward pass (e.g. `distributed.synchronised_gradients`' overlap)."""
    outputs = [forward(b) for b in batches]
    loss, extra = objective(_merge(outputs, [1] * len(batches)))
    with last_backward():
        loss.backward()
    return extra


@dataclass
class _RngState:
    """CPU (and, for a CUDA device, that device's) RNG state, captured before a chunk's first forward pass."""

    device: torch.device
    cpu: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> "_RngState":
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(device, torch.get_rng_state(), cuda)

    @contextmanager
    def replay(self):
        """Run the block from the captured state; the RNG state outside the block is left untouched."""
        with torch.random.fork_rng(devices=[self.device] if self.cuda is not None else []):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def cached_backward(
    forward: Forward, batches: list[Batch], objective: Objective, chunk_size: int, device: torch.device,
    last_backward=nullcontext,
) -> Any:
    """GradCache: same loss and parameter gradients as `plain_backward`, with activations of one chunk at a time.

    Args:
        forward: encodes one batch (see `Forward`); called twice per chunk.
        batches: e.g. [queries, documents, negatives]; each is split into chunks of `chunk_size` rows.
        objective: the loss on the full encoded batches (gathers across ranks, Matryoshka, auxiliary losses...).
        device: where the model runs (its RNG state is saved per chunk).
        last_backward: entered around the backward pass of the last replayed chunk, after which every parameter
            gradient is final (e.g. `distributed.synchronised_gradients`' overlap).
    Returns the objective's extra output.
    """
    chunks = [split_batch(b, chunk_size) for b in batches]
    flat = [c for group in chunks for c in group]
    states, outputs = [], []
    with torch.no_grad():
        for chunk in flat:
            states.append(_RngState.capture(device))
            outputs.append(forward(chunk))
    enc = _merge(outputs, [len(g) for g in chunks])
    leaves = [e.detach().requires_grad_() for e in enc.embeddings]
    router = tuple(z.detach().requires_grad_() for z in enc.router_logits)
    loss, extra = objective(Encoded(leaves, router, enc.expert_counts))
    loss.backward()

    # Where each chunk's rows sit in its batch's embeddings and its tokens in the router logits.
    emb_grads = [_grad(leaf) for leaf in leaves]
    router_grads = [_grad(z) for z in router]
    batch_of = [k for k, group in enumerate(chunks) for _ in group]
    row, token = [0] * len(batches), 0
    for i, (chunk, state, k, cached) in enumerate(zip(flat, states, batch_of, outputs)):
        n = chunk.input_ids.shape[0]  # rows of this chunk
        t = cached[1][0].shape[0] if cached[1] else 0  # tokens routed in this chunk
        with state.replay():
            emb, logits, _ = forward(chunk)
        tensors = [emb] + list(logits)
        grads = [emb_grads[k][row[k] : row[k] + n]] + [g[token : token + t] for g in router_grads]
        pairs = [(x, g) for x, g in zip(tensors, grads) if x.requires_grad]
        with last_backward() if i == len(flat) - 1 else nullcontext():
            if pairs:
                torch.autograd.backward([x for x, _ in pairs], [g for _, g in pairs])
        row[k] += n
        token += t
    return extra


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    """A leaf's gradient; zeros when the objective did not depend on it (e.g. aux losses switched off)."""
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
