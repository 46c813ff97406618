"""Token-budget dynamic batching with fair shares: the texts of concurrent requests share forward passes on one
worker thread, and a large request is cut into slices interleaved with the others.

Each request puts its (already tokenized) texts on the queue as one job and awaits a future. A single worker
thread, so that the event loop never waits on torch, plans one forward pass at a time (`plan_pass`):

1. candidates: the jobs that have not had a pass yet ("new"), or the jobs already under way (`new_turn`): new
   jobs go first unless the last pass gave the started ones nothing, so a newcomer that arrives during a slice
   of a large request runs in the very next pass, and a stream of newcomers never starves a large request;
2. the pass takes the candidates' texts round-robin, one text per job per turn, each job's texts shortest
   first, while the pass stays within `max_batch_tokens` padded tokens (batch size × longest text, as
   text-embeddings-inference budgets a batch by tokens rather than requests) and `max_batch_size` texts, and
   each job within its `share` of padded tokens: a 2,048-text request goes through in slices of `share`
   tokens, and a one-text request that arrives meanwhile runs in the next pass;
3. the worker runs the pass through `embed` and writes every row to its request's output, in the request's
   order; a request is resolved when its last row lands. Jobs whose request is gone (cancelled, disconnected,
   aborted at shutdown) are dropped before each pass, so their remaining texts cost nothing.

Embeddings never depend on the batch: the encoder removes padding before any token-wise computation and
attention is masked per sequence (model/encoder.py), so a text's vector is the same alone or in a crowd.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moembed.errors import MoembedError


def plan_pass(queues: Sequence[Sequence[int]], max_tokens: int, max_size: int, share: int) -> list[int]:
    """How many texts to take from the front of each queue (token lengths, each queue ascending) for one pass.

    Round-robin, one text per queue per turn, while len(pass) * longest <= max_tokens and len(pass) <= max_size;
    a queue also stops once its own texts would pass `share` padded tokens (its count × its longest). The pass's
    first text and each queue's first text are exempt from `share`, and the pass's first text from
    `max_tokens`, so a text longer than a budget still gets a pass."""
    counts = [0] * len(queues)
    longest = [0] * len(queues)
    n = top = 0
    active = [j for j, q in enumerate(queues) if q]
    while active and n < max_size:
        still = []
        for j in active:
            if n >= max_size:
                break
            k = counts[j]
            length = max(queues[j][k], 1)
            pass_top, job_top = max(top, length), max(longest[j], length)
            # a queue's lengths ascend and the pass's longest only grows: once a text does not fit, none of the
            # queue's later texts will, so the queue leaves this pass
            if n and (n + 1) * pass_top > max_tokens or k and (k + 1) * job_top > share:
                continue
            counts[j], longest[j], top, n = k + 1, job_top, pass_top, n + 1
            if k + 1 < len(queues[j]):
                still.append(j)
        active = still
    return counts


def new_turn(new: bool, started: bool, served: bool) -> bool:
    """Whether the next pass takes the new jobs (those without a pass yet) rather than the started ones; `served`:
    the last pass held texts of a job that is started now. New jobs go first unless the started ones got nothing
    from the last pass: a newcomer waits for the pass running when it arrived (or, when that pass was one of new
    jobs, for one started pass more), and a stream of newcomers still leaves started jobs every other pass. A
    large request's first slice serves it, so a newcomer behind it does not wait for its second slice."""
    return new and (not started or served)


def plan_batches(lengths: list[int], max_tokens: int, max_size: int) -> list[list[int]]:
    """The passes one request gets on an idle server without a share limit: its texts (by index), shortest first,
    cut greedily into batches with len(batch) * max length <= max_tokens and len(batch) <= max_size. A single
    text longer than max_tokens gets a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    while order:
        (k,) = plan_pass([[lengths[i] for i in order[:max_size]]], max_tokens, max_size, max_tokens)
        batches.append(order[:k])
        order = order[k:]
    return batches


class ShuttingDown(MoembedError):
    """The server is stopping: the request's texts will not be embedded."""


class _Job:
    """One request's texts, handed to passes shortest first; rows land in `out` (n, d) from the worker thread and
    the future settles on the loop."""

    def __init__(self, ids: list[list[int]], dim: int, loop: asyncio.AbstractEventLoop):
        self.ids = ids
        self.order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        self.next = 0  # texts of `order` already handed to a pass
        self.out = torch.empty(len(ids), dim, dtype=torch.float32)
        self.remaining = len(ids)
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()

    @property
    def undispatched(self) -> int:
        return len(self.order) - self.next

    def lengths(self, k: int) -> list[int]:
        """Lengths of the next k texts to hand out."""
        return [len(self.ids[i]) for i in self.order[self.next:self.next + k]]

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
    if fut.done():  # the request was cancelled (client gone, shutdown): nobody waits for it any more
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


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

    embed(ids: list[list[int]]) → (n, dim) float32 CPU tensor; on_batch(BatchStats) is called after each pass;
    share: padded tokens one request may put into one pass (None: max_batch_tokens, no slicing).
    """

    def __init__(
        self,
        embed: Callable[[list[list[int]]], torch.Tensor],
        dim: int,
        max_batch_tokens: int,
        max_batch_size: int,
        on_batch: Callable[[BatchStats], None] | None = None,
        threads: int | None = None,
        share: int | None = None,
    ):
        if max_batch_tokens < 1 or max_batch_size < 1 or (share is not None and share < 1):
            raise MoembedError("batcher: max_batch_tokens, max_batch_size and share must be >= 1")
        self.embed_fn, self.dim = embed, dim
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.share = min(share or max_batch_tokens, max_batch_tokens)
        self.on_batch = on_batch
        self.threads = threads  # torch threads of the worker's forward passes; None: the process's setting
        self._jobs: list[_Job] = []  # arrival order; a job leaves once all its texts are handed to passes
        self._waiting = 0  # texts queued or in the current pass, not yet embedded
        self._cond = threading.Condition()
        self._closing = False
        self._aborted: BaseException | None = None
        self._last: set[_Job] = set()  # the jobs the last pass held (`new_turn`)
        self._oldest_first = False  # shutdown: finish requests one by one instead of sharing passes fairly
        self._thread = threading.Thread(target=self._run, name="moembed-batcher", daemon=True)

    @property
    def queue_depth(self) -> int:
        return self._waiting

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Embed everything still queued for live requests, then stop the worker thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)

    def abort(self, exc: BaseException) -> int:
        """Fail every queued request with `exc` and refuse new ones (shutdown's deadline); the pass running now
        finishes. Returns the number of requests failed."""
        with self._cond:
            self._aborted = exc
            jobs, self._jobs = self._jobs, []
            for job in jobs:
                self._waiting -= job.undispatched
                job.fail(exc)
        return len(jobs)

    def oldest_first(self) -> None:
        """Shutdown: from now on passes finish the oldest request first, so that as many requests as possible are
        complete when the grace period ends (fair shares would leave every one of them half done)."""
        with self._cond:
            self._oldest_first = True

    def submit(self, ids: list[list[int]]) -> asyncio.Future:
        """Queue the token-id lists; the future gives their embeddings (n, dim), in order. Cancelling the future
        drops the texts not yet embedded."""
        loop = asyncio.get_running_loop()
        if not ids:
            fut = loop.create_future()
            fut.set_result(torch.empty(0, self.dim))
            return fut
        job = _Job(ids, self.dim, loop)
        with self._cond:
            if self._aborted is not None:
                raise self._aborted
            if self._closing:
                raise ShuttingDown("batcher: shutting down")
            self._jobs.append(job)
            self._waiting += len(ids)
            self._cond.notify()
        return job.future

    async def embed(self, ids: list[list[int]]) -> torch.Tensor:
        """Embeddings (n, dim) of the token-id lists, in order, once every one has been through a forward."""
        return await self.submit(ids)

    # ---- worker thread -----------------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # this thread's OpenMP team (see `moembed.serve.server.run`)
        while True:
            with self._cond:
                batch = self._plan()
                while not batch and not self._closing:
                    self._cond.wait()
                    batch = self._plan()
                if not batch:  # closing and drained
                    return
            self._forward(batch)

    def _plan(self) -> list[tuple[_Job, int]]:
        """The next pass as (job, text index) pairs; called with the lock held."""
        live = []
        for job in self._jobs:
            if job.remaining <= 0 or job.future.done():  # failed or cancelled: its other texts are not embedded
                self._waiting -= job.undispatched
            else:
                live.append(job)
        if self._oldest_first:
            group, share = live[:1], self.max_batch_tokens
        else:
            new = [j for j in live if j.next == 0]
            started = [j for j in live if j.next > 0]
            take_new = new_turn(bool(new), bool(started), any(j in self._last for j in started))
            group, share = (new if take_new else started), self.share
        counts = plan_pass([j.lengths(self.max_batch_size) for j in group], self.max_batch_tokens,
                           self.max_batch_size, share)
        batch = []
        for job, k in zip(group, counts):
            batch.extend((job, i) for i in job.order[job.next:job.next + k])
            job.next += k
        self._jobs = [j for j in live if j.undispatched]
        if batch:
            self._last = {job for job, _ in batch}
        return batch

    def _forward(self, batch: list[tuple[_Job, int]]) -> None:
        t0 = time.perf_counter()
        ids = [job.ids[i] for job, i in batch]
        try:
            emb = self.embed_fn(ids)  # (b, d)
        except Exception as e:  # noqa: BLE001 - the failure goes to the requests, the worker keeps serving
            for job, _ in batch:
                job.fail(e)
            self._done(len(batch))
            return
        for k, (job, i) in enumerate(batch):
            job.put(i, emb[k])
        self._done(len(batch))
        if self.on_batch is not None:
            lengths = [max(len(x), 1) for x in ids]
            seconds = time.perf_counter() - t0
            self.on_batch(BatchStats(len(batch), len(batch) * max(lengths), sum(lengths), seconds, self._waiting))

    def _done(self, n: int) -> None:
        with self._cond:
            self._waiting -= n
