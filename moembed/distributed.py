"""Process-group helpers for data-parallel training, launched with `torchrun`.

Every collective is the identity in a single process, so losses and the training step run unchanged without a
process group; the one branch is `if world_size() > 1`. No state is kept here beyond torch.distributed's own.

Launch (2 processes on one machine; CPU uses gloo, CUDA uses nccl):

    torchrun --standalone --nproc-per-node 2 -m moembed.cli.main train CONFIG.yaml

which is what `launch(["train", "CONFIG.yaml"], 2)` runs for the commands' `--nproc N`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import weakref
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
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


class GradientSync:
    """Averages a module's gradients over ranks with bucketed asynchronous all-reduces, as DDP does.

    Parameters are grouped in buckets of about `bucket_mb` MiB, in reverse parameter order (the order in which
    backward produces gradients; the first bucket is small so that communication starts early). Each step:
    - `prepare()` (after the optimizer's zero_grad) starts with no bucket memory at all;
    - when backward produces a parameter's gradient, a hook moves it into its bucket, a flat buffer allocated with
      the bucket's first gradient, and makes `.grad` a view of it; later backward passes (GradCache's replays)
      accumulate into that view in place. No gradient exists twice for long, and no flat copy of all gradients is
      made: the flat buffers are the gradients;
    - during the pass wrapped in `overlap()` — the last backward of the step, after which the gradients are final —
      a bucket whose parameters are all done is all-reduced asynchronously while backward goes on with the earlier
      layers. Buckets are launched strictly in index order, so every rank issues the same collectives in the same
      order even when a parameter gets no gradient on one rank (its bucket, and those after it, go at `finish()`);
    - `finish()` launches the rest, waits, divides by the number of ranks, and lets go of the buffers (the `.grad`
      views keep them alive until the next zero_grad).
    Before a bucket is sent, the 2-norm of this rank's own part is taken: `local_norm` (after `finish()`) is the
    norm of this rank's gradients before averaging, which says on which rank a non-finite gradient arose (after the
    all-reduce every rank holds it).
    """

    def __init__(self, params: list[torch.nn.Parameter], bucket_mb: float = 25.0, first_bucket_mb: float = 1.0):
        self.params = params
        self.buckets: list[list[torch.nn.Parameter]] = []
        limit, size = first_bucket_mb * 2**20, 0.0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if not self.buckets or size + nbytes > limit or self._key(self.buckets[-1][0]) != self._key(p):
                if self.buckets:
                    limit = bucket_mb * 2**20
                self.buckets.append([])
                size = 0.0
            self.buckets[-1].append(p)
            size += nbytes
        self.bucket_of, self.offset = {}, {}
        for i, bucket in enumerate(self.buckets):
            start = 0
            for p in bucket:
                self.bucket_of[id(p)], self.offset[id(p)] = i, start
                start += p.numel()
        self.sizes = [sum(p.numel() for p in b) for b in self.buckets]
        self.flat: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._armed, self._ready, self._seen, self._work = False, [0] * len(self.buckets), set(), []
        self._norms: list[torch.Tensor] = []
        self.local_norm: torch.Tensor | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    @staticmethod
    def _key(p: torch.Tensor) -> tuple:
        return (p.dtype, p.device)

    def _view(self, p: torch.Tensor) -> torch.Tensor:
        """p's slice of its bucket (allocated, zeroed, on first use in the step)."""
        i, start = self.bucket_of[id(p)], self.offset[id(p)]
        if self.flat[i] is None:
            self.flat[i] = torch.zeros(self.sizes[i], dtype=p.dtype, device=p.device)
        return self.flat[i][start : start + p.numel()].view_as(p)

    def _adopt(self, p: torch.Tensor) -> None:
        """Make p.grad the view of its bucket, moving the gradient there if autograd allocated it elsewhere."""
        view = self._view(p)
        if p.grad is None:
            p.grad = view
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def prepare(self) -> None:
        """Start a step: gradients already present (not zeroed by the caller) move into their buckets."""
        self.flat = [None] * len(self.buckets)
        self._ready, self._seen, self._work = [0] * len(self.buckets), set(), []
        self._norms, self.local_norm = [], None
        for p in self.params:
            if p.grad is not None:
                self._adopt(p)

    @contextmanager
    def overlap(self):
        """Wrap the last backward pass of the step: complete buckets start their all-reduce during it."""
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def _on_grad(self, p: torch.Tensor) -> None:
        self._adopt(p)
        if not self._armed or id(p) in self._seen:
            return
        self._seen.add(id(p))
        i = self.bucket_of[id(p)]
        self._ready[i] += 1
        while len(self._work) < len(self.buckets) and self._ready[len(self._work)] == len(self.buckets[len(self._work)]):
            self._launch(len(self._work))

    def _launch(self, i: int) -> None:
        for p in self.buckets[i]:  # parameters without any gradient this step take part as zeros
            self._adopt(p)
        # Queued before the all-reduce (same stream on CUDA, synchronously on CPU): it reads this rank's values.
        flat = self.flat[i]  # (bucket size,)
        self._norms.append(torch.linalg.vector_norm(flat, dtype=torch.promote_types(flat.dtype, torch.float32)))
        self._work.append(dist.all_reduce(self.flat[i], op=dist.ReduceOp.SUM, async_op=True))

    def finish(self) -> None:
        """Launch the buckets not yet sent, wait for all, and divide by the number of ranks."""
        for i in range(len(self._work), len(self.buckets)):
            self._launch(i)
        for work, flat in zip(self._work, self.flat):
            work.wait()
            flat /= world_size()
        self.flat = [None] * len(self.buckets)
        if self._norms:
            device = self._norms[0].device
            self.local_norm = torch.linalg.vector_norm(torch.stack([n.to(device, torch.float32) for n in self._norms]))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


_SYNCS: "weakref.WeakKeyDictionary[torch.nn.Module, GradientSync]" = weakref.WeakKeyDictionary()


@contextmanager
def synchronised_gradients(module: torch.nn.Module):
    """Gradients of `module` averaged over ranks when the block ends; yields `overlap`, a context manager to put
    around the block's last backward pass so that communication overlaps it (see `GradientSync`).

        with dist.synchronised_gradients(model) as last_backward:
            with last_backward():
                loss.backward()

    One process: nothing happens (`overlap` is a no-op). The bucket layout and hooks are made once per module and
    reused; gradients already present when the block starts are kept (and averaged with the rest).
    """
    if world_size() == 1:
        yield nullcontext
        return
    params = [p for p in module.parameters() if p.requires_grad]
    sync = _SYNCS.get(module)
    if sync is None or [id(p) for p in sync.params] != [id(p) for p in params]:
        if sync is not None:
            sync.remove()
        sync = _SYNCS[module] = GradientSync(params)
    sync.prepare()
    yield sync.overlap
    sync.finish()


def local_gradient_norm(module: torch.nn.Module) -> torch.Tensor | None:
    """The 2-norm (a float32 tensor on the gradients' device) of this rank's own gradients of `module` in the last
    `synchronised_gradients` block, taken before they were averaged over ranks; None in one process (where the
    gradients are this rank's own: take their norm directly) or before any synchronised step."""
    if world_size() == 1:
        return None
    sync = _SYNCS.get(module)
    return None if sync is None else sync.local_norm


def all_reduce_gradients(module: torch.nn.Module) -> None:
    """Average `.grad` of every parameter over ranks now (parameters without a gradient take part as zeros)."""
    with synchronised_gradients(module):
        pass


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
    gradient from every rank's loss term (the reduce-scatter sum), as in torch.distributed.nn.all_gather.
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
        # Rank r needs only the sum over ranks of its own slice: a reduce-scatter (half an all-reduce's traffic).
        sizes, width = ctx.sizes, max(ctx.sizes)
        if all(n == width for n in sizes):
            stacked = grad.contiguous()  # (W·n, ...) already one equal slice per rank
        else:
            stacked = grad.new_zeros((len(sizes) * width, *grad.shape[1:]))  # (W·max_n, ...) padded slices
            start = 0
            for r, n in enumerate(sizes):
                stacked[r * width : r * width + n] = grad[start : start + n]
                start += n
        out = grad.new_empty((width, *grad.shape[1:]))
        _reduce_scatter(out, stacked)
        return out[: sizes[rank()]]


def _reduce_scatter(out: torch.Tensor, stacked: torch.Tensor) -> None:
    """out (n, ...) = rank r's slice [r·n, (r+1)·n) of `stacked` (W·n, ...) summed over ranks."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in recent torch
    fn(out, stacked, op=dist.ReduceOp.SUM)


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


def torchrun_command(args: Sequence[str], nproc: int) -> list[str]:
    """The command line that runs `moembed ARGS` as `nproc` processes on this machine (torchrun, standalone)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "moembed.cli.main", *map(str, args)]


def launch(args: Sequence[str], nproc: int) -> int:
    """Run `moembed ARGS` as `nproc` processes (every command's `--nproc N`) and wait; the exit status.

    The children import this very moembed: the directory holding the package goes first on their path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return subprocess.run(torchrun_command(args, nproc), env=env).returncode
