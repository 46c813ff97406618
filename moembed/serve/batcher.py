"""Token-budget dynamic batching: the texts of concurrent requests share forward passes on one worker thread.

Each request puts its (already tokenized) texts on one queue and awaits a future. A single worker thread,
so that the event loop never waits on torch, repeats rounds:

1. take every text queued so far (texts that arrive meanwhile wait for the next round, so no text is
   overtaken indefinitely by later, shorter ones);
2. sort the round by length and cut it into batches whose padded size, batch size × longest text, stays
   within `max_batch_tokens` and whose size stays within `max_batch_size` (as text-embeddings-inference
   budgets a batch by tokens rather than by requests; sorting keeps the padding small);
3. run each batch through `embed` and write every row to its request's output, in the request's order;
   a request whose texts span several batches (larger than the budget) is resolved when its last row lands.

Embeddings never depend on the batch: the encoder removes padding before any token-wise computation and
attention is masked per sequence (model/encoder.py), so a text's vector is the same alone or in a crowd.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moembed.errors import MoembedError


def plan_batches(lengths: list[int], max_tokens: int, max_size: int) -> list[list[int]]:
    """Cut texts (by index) into batches, shortest first, each with len(batch) * max length <= max_tokens
    and len(batch) <= max_size. A single text longer than max_tokens gets a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        # lengths ascend, so the newcomer is the longest of the batch: padded size = (n + 1) * lengths[i]
        if cur and (len(cur) + 1 > max_size or (len(cur) + 1) * max(lengths[i], 1) > max_tokens):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


class _Job:
    """One request's texts: rows land in `out` (n, d) from the worker thread; the future settles on the loop."""

    def __init__(self, n: int, dim: int, loop: asyncio.AbstractEventLoop):
        self.out = torch.empty(n, dim, dtype=torch.float32)
        self.remaining = n
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()

    def put(self, index: int, row: torch.Tensor) -> None:
        self.out[index] = row
        self.remaining -= 1
        if self.remaining == 0:
            self.loop.call_soon_threadsafe(_settle, self.future, self.out, None)

    def fail(self, exc: BaseException) -> None:
        if self.remaining > 0:
            self.remaining = 0
            self.loop.call_soon_threadsafe(_settle, self.future, None, exc)


def _settle(fut: asyncio.Future, result, exc) -> None:
    if fut.done():  # the request was cancelled (shutdown timeout): nobody waits for it any more
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


@dataclass
class _Item:
    job: _Job
    index: int  # position of the text in its request
    ids: list[int]


@dataclass
class BatchStats:
    """What one forward pass held, for metrics: texts, padded tokens (B × T), real tokens, seconds."""

    size: int
    padded_tokens: int
    tokens: int
    seconds: float
    queue_depth: int  # texts still waiting after this pass


class Batcher:
    """Merge texts of concurrent requests into forward passes of `embed` on one worker thread.

    embed(ids: list[list[int]]) → (n, dim) float32 CPU tensor; on_batch(BatchStats) is called after each pass.
    """

    def __init__(
        self,
        embed: Callable[[list[list[int]]], torch.Tensor],
        dim: int,
        max_batch_tokens: int,
        max_batch_size: int,
        on_batch: Callable[[BatchStats], None] | None = None,
        threads: int | None = None,
    ):
        if max_batch_tokens < 1 or max_batch_size < 1:
            raise MoembedError("batcher: max_batch_tokens and max_batch_size must be >= 1")
        self.embed_fn, self.dim = embed, dim
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.on_batch = on_batch
        self.threads = threads  # torch threads of the worker's forward passes; None: the process's setting
        self._queue: list[_Item] = []
        self._waiting = 0  # texts queued or in the current round, not yet embedded
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="moembed-batcher", daemon=True)

    @property
    def queue_depth(self) -> int:
        return self._waiting

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Embed everything already queued, then stop the worker thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)

    async def embed(self, ids: list[list[int]]) -> torch.Tensor:
        """Embeddings (n, dim) of the token-id lists, in order, once every one has been through a forward."""
        if not ids:
            return torch.empty(0, self.dim)
        job = _Job(len(ids), self.dim, asyncio.get_running_loop())
        with self._cond:
            if self._closing:
                raise MoembedError("batcher: shutting down")
            self._queue.extend(_Item(job, i, x) for i, x in enumerate(ids))
            self._waiting += len(ids)
            self._cond.notify()
        return await job.future

    # ---- worker thread -----------------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # this thread's OpenMP team (see `moembed.serve.server.run`)
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:  # closing and drained
                    return
                items, self._queue = self._queue, []
            live = [it for it in items if not it.job.future.done()]  # skip requests cancelled meanwhile
            self._done(len(items) - len(live))
            for batch in plan_batches([len(it.ids) for it in live], self.max_batch_tokens, self.max_batch_size):
                self._forward([live[i] for i in batch])

    def _forward(self, batch: list[_Item]) -> None:
        t0 = time.perf_counter()
        try:
            emb = self.embed_fn([it.ids for it in batch])  # (b, d)
        except Exception as e:  # noqa: BLE001 - the failure goes to the requests, the worker keeps serving
            for it in batch:
                it.job.fail(e)
            self._done(len(batch))
            return
        for k, it in enumerate(batch):
            it.job.put(it.index, emb[k])
        self._done(len(batch))
        if self.on_batch is not None:
            lengths = [max(len(it.ids), 1) for it in batch]
            seconds = time.perf_counter() - t0
            self.on_batch(BatchStats(len(batch), len(batch) * max(lengths), sum(lengths), seconds, self._waiting))

    def _done(self, n: int) -> None:
        with self._cond:
            self._waiting -= n
