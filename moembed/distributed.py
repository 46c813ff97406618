"""Process-group helpers for data-parallel training, launched with `torchrun`.

Every collective is the identity in a single process, so losses and the training step run unchanged without a
process group; the one branch is `if world_size() > 1`. No state is kept here beyond torch.distributed's own.

Launch (2 processes on one machine; CPU uses gloo, CUDA uses nccl):

    torchrun --standalone --nproc-per-node 2 -m moembed.cli.main train CONFIG.yaml
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def local_rank() -> int:
    """This process's index on its machine (torchrun's LOCAL_RANK), 0 without a launcher."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_from_env(backend: str | None = None) -> bool:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    Does nothing when WORLD_SIZE is unset or 1, or when a group already exists. The backend defaults to nccl
    when CUDA is available (and selects this process's GPU by LOCAL_RANK), gloo otherwise.
    Returns whether the process runs distributed.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return is_distributed()
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank())
        dist.init_process_group(backend=backend)
    return is_distributed()


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_gather_object(obj: Any) -> list[Any]:
    """Picklable objects of every rank, in rank order ([obj] in one process)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over ranks (a new tensor; `t` itself in one process). No gradient."""
    if world_size() == 1:
        return t
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of `t` over ranks (a new tensor; `t` itself in one process). No gradient."""
    if world_size() == 1:
        return t
    return all_reduce_sum(t) / world_size()


def all_reduce_gradients(module: torch.nn.Module) -> None:
    """Average `.grad` of every parameter over ranks, in one flat buffer (what DDP does after backward).

    Parameters without a gradient on some rank (e.g. an expert no token reached) take part as zeros so that
    every rank sends the same buffer layout.
    """
    if world_size() == 1:
        return
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # (P,)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size()
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def broadcast_parameters(module: torch.nn.Module, src: int = 0) -> None:
    """Copy rank `src`'s parameters and buffers to every rank (identical start, as DDP does on wrapping)."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src)


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward sums the incoming gradients over ranks and returns this rank's slice.

    Each rank computes the loss of its own queries against the gathered batch; a rank's embeddings then receive
    gradient from every rank's loss term (the all-reduce sum), as in torch.distributed.nn.all_gather.
    """

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        sizes = [torch.zeros((), dtype=torch.long, device=t.device) for _ in range(world_size())]
        dist.all_gather(sizes, torch.tensor(t.shape[0], device=t.device))
        sizes = [int(s) for s in sizes]
        width = max(sizes)
        padded = t.new_zeros((width, *t.shape[1:]))  # (max_n, ...) equal shapes for all_gather
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous())
        ctx.sizes = sizes
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])  # (sum n, ...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = sum(ctx.sizes[: rank()])
        return grad[start : start + ctx.sizes[rank()]]


def all_gather_with_grad(t: torch.Tensor) -> torch.Tensor:
    """Concatenate `t` (n_r, ...) over ranks along dim 0 in rank order; gradients flow back to each rank's slice.

    Ranks may hold different n_r. Identity in one process.
    """
    if world_size() == 1:
        return t
    return _GatherWithGrad.apply(t)


def gather_sizes(n: int) -> list[int]:
    """Every rank's value of `n` (e.g. its local batch size), in rank order."""
    return [int(x) for x in all_gather_object(int(n))]
