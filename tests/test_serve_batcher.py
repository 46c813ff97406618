"""The dynamic batcher without HTTP: batch planning by token budget, splitting and reassembly, failures."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from moembed.serve.batcher import Batcher, ShuttingDown, new_turn, plan_batches, plan_pass


@pytest.mark.parametrize("seed", range(5))
def test_plan_respects_budget_and_covers_every_text_once(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 300))]
    batches = plan_batches(lengths, max_tokens=256, max_size=16)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 16 and len(b) * max(lengths[i] for i in b) <= 256
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat)  # length-sorted: neighbours share a batch, padding stays small


def test_plan_is_greedy():
    # 10 texts of 8 tokens under a 32-token budget: 4 + 4 + 2, not more batches than needed.
    assert [len(b) for b in plan_batches([8] * 10, max_tokens=32, max_size=64)] == [4, 4, 2]
    assert [len(b) for b in plan_batches([8] * 10, max_tokens=10_000, max_size=3)] == [3, 3, 3, 1]
    # a text longer than the budget still gets a batch of its own (the app refuses such budgets upfront)
    assert plan_batches([100, 1], max_tokens=50, max_size=8) == [[1], [0]]


def test_plan_pass_takes_turns_within_budget_size_and_share():
    # round-robin, one text per queue per turn; the first queue stops at its share (2 x 8 = 16 tokens)
    assert plan_pass([[8] * 100, [8]], max_tokens=64, max_size=64, share=16) == [2, 1]
    # the pass budget: a third text of 30 tokens would make 3 x 30 > 64
    assert plan_pass([[30, 30, 30], [30]], max_tokens=64, max_size=64, share=64) == [1, 1]
    assert plan_pass([[1] * 10] * 3, max_tokens=1000, max_size=4, share=1000) == [2, 1, 1]
    # texts longer than a budget still get a pass: the pass's first text, and each queue's first text
    assert plan_pass([[100]], max_tokens=50, max_size=8, share=10) == [1]
    assert plan_pass([[4, 4], [20, 20]], max_tokens=64, max_size=8, share=10) == [2, 1]
    assert plan_pass([[], [3]], max_tokens=64, max_size=8, share=64) == [0, 1]


@pytest.mark.parametrize("seed", range(5))
def test_plan_pass_respects_every_limit(seed):
    rng = random.Random(seed)
    queues = [sorted(rng.randint(1, 64) for _ in range(rng.randint(0, 40))) for _ in range(rng.randint(1, 12))]
    counts = plan_pass(queues, max_tokens=512, max_size=32, share=128)
    taken = [q[:k] for q, k in zip(queues, counts)]
    flat = [x for t in taken for x in t]
    assert flat and len(flat) <= 32 and len(flat) * max(flat) <= 512
    assert all(len(t) <= 1 or len(t) * max(t) <= 128 for t in taken)
    # greedy: no queue could have added its next text
    for q, t in zip(queues, taken):
        if len(t) < len(q):
            nxt = q[len(t)]
            assert (len(flat) + 1 > 32 or (len(flat) + 1) * max(max(flat), nxt) > 512
                    or (t and (len(t) + 1) * max(max(t), nxt) > 128))


class RecordingEmbed:
    """embed(ids) whose row i is (sum of ids, length): checks reassembly; records the batches it saw."""

    def __init__(self):
        self.batches: list[list[list[int]]] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, ids):
        assert self.gate.wait(10)
        self.batches.append(ids)
        return torch.tensor([[float(sum(x)), float(len(x))] for x in ids])


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_requests_share_passes_and_come_back_in_order():
    fn = RecordingEmbed()
    b = Batcher(fn, dim=2, max_batch_tokens=64, max_batch_size=32)
    b.start()
    rng = random.Random(0)
    requests = [[[rng.randint(1, 9) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 9))] for _ in range(20)]

    async def go():
        fn.gate.clear()  # hold the worker on the first pass so the other requests queue up behind it
        first = asyncio.ensure_future(b.embed(requests[0]))
        for _ in range(2000):  # until the worker holds a pass of the first request
            if b.queue_depth and (not b._jobs or b._jobs[0].next):
                break
            await asyncio.sleep(0.005)
        rest = [asyncio.ensure_future(b.embed(r)) for r in requests[1:]]
        await asyncio.sleep(0.05)
        fn.gate.set()
        return await asyncio.gather(first, *rest)

    outs = _run(go())
    b.close(10)
    for ids, out in zip(requests, outs):
        assert out.tolist() == [[float(sum(x)), float(len(x))] for x in ids]
    for batch in fn.batches:
        assert len(batch) <= 32 and len(batch) * max(map(len, batch)) <= 64
    # the 19 requests queued behind the held pass were merged: fewer passes than requests
    assert len(fn.batches) < len(requests)
    assert b.queue_depth == 0


def test_request_larger_than_the_budget_is_split_and_reassembled():
    fn = RecordingEmbed()
    b = Batcher(fn, dim=2, max_batch_tokens=20, max_batch_size=4)
    b.start()
    ids = [[i + 1] * (1 + i % 5) for i in range(30)]
    out = _run(b.embed(ids))
    b.close(10)
    assert len(fn.batches) >= 8  # 30 texts, at most 4 per pass
    assert out.tolist() == [[float(sum(x)), float(len(x))] for x in ids]


def test_a_failed_pass_fails_its_requests_and_the_worker_goes_on():
    calls = []

    def flaky(ids):
        calls.append(ids)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return torch.zeros(len(ids), 2)

    b = Batcher(flaky, dim=2, max_batch_tokens=64, max_batch_size=8)
    b.start()
    with pytest.raises(RuntimeError, match="device lost"):
        _run(b.embed([[1, 2]]))
    assert _run(b.embed([[1, 2], [3]])).shape == (2, 2)
    b.close(10)
    assert b.queue_depth == 0


def test_close_drains_the_queue():
    fn = RecordingEmbed()
    b = Batcher(fn, dim=2, max_batch_tokens=64, max_batch_size=2)
    b.start()

    async def go():
        fn.gate.clear()
        futs = [asyncio.ensure_future(b.embed([[i], [i, i]])) for i in range(1, 6)]
        await asyncio.sleep(0.05)
        closer = asyncio.get_running_loop().run_in_executor(None, b.close, 10)  # closing while work is queued
        await asyncio.sleep(0.05)
        fn.gate.set()
        await closer
        return await asyncio.gather(*futs)

    outs = _run(go())
    assert [o[:, 0].tolist() for o in outs] == [[float(i), float(2 * i)] for i in range(1, 6)]
    assert not b._thread.is_alive()


def test_forward_passes_run_with_the_threads_asked_for():
    """`threads`: the worker thread's own torch thread count (the server keeps its event-loop thread at one)."""
    seen = []

    def fn(ids):
        seen.append(torch.get_num_threads())
        return torch.zeros(len(ids), 2)

    before = torch.get_num_threads()
    b = Batcher(fn, dim=2, max_batch_tokens=64, max_batch_size=8, threads=before + 2)
    b.start()
    try:
        asyncio.run(b.embed([[1, 2, 3]]))
    finally:
        b.close(30)
    assert seen == [before + 2] and torch.get_num_threads() == before  # this thread's count untouched


def _held(b: Batcher, fn: RecordingEmbed):
    """Wait (on the loop) until the worker holds its first pass at the gate."""

    async def wait():
        for _ in range(2000):
            if fn.waiting:
                return
            await asyncio.sleep(0.005)
        raise AssertionError("the worker never reached the gate")

    return wait()


class GatedEmbed(RecordingEmbed):
    """RecordingEmbed that says when a pass waits at the gate."""

    def __init__(self):
        super().__init__()
        self.waiting = False

    def __call__(self, ids):
        self.waiting = True
        try:
            return super().__call__(ids)
        finally:
            self.waiting = False


def test_a_newcomer_runs_in_the_next_pass_and_large_requests_go_in_slices():
    """A 200-text request runs in slices of `share` tokens; one-text requests that arrive while it runs are
    merged into the very next pass, and the large request's next slice follows them."""
    fn = GatedEmbed()
    b = Batcher(fn, dim=2, max_batch_tokens=64, max_batch_size=64, share=16)
    b.start()
    big = [[7] * 8 for _ in range(200)]
    small = [[[i + 1] * 5] for i in range(3)]

    async def go():
        fn.gate.clear()
        first = b.submit(big)
        await _held(b, fn)
        later = [b.submit(s) for s in small]
        fn.gate.set()
        return await asyncio.gather(first, *later)

    outs = _run(go())
    b.close(10)
    assert fn.batches[0] == big[:2]  # the first slice: 2 texts x 8 tokens = the share
    assert sorted(fn.batches[1]) == sorted(s[0] for s in small)  # all three newcomers, in one pass, right away
    assert fn.batches[2] == big[:2]  # then the large request goes on
    assert all(len(x) <= 2 for x in fn.batches if x[0][0] == 7)
    assert outs[0].tolist() == [[56.0, 8.0]] * 200
    assert [o.tolist() for o in outs[1:]] == [[[5.0 * (i + 1), 5.0]] for i in range(3)]


class SteppedEmbed(RecordingEmbed):
    """RecordingEmbed whose passes wait at the gate one by one: `step()` lets one pass through, and `reached(k)`
    waits (on the loop) until k passes have arrived at the gate, so a test knows which pass runs while it acts."""

    def __init__(self):
        super().__init__()
        self.tickets = threading.Semaphore(0)
        self.arrived = 0

    def __call__(self, ids):
        self.arrived += 1
        assert self.tickets.acquire(timeout=10)
        return super().__call__(ids)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.tickets.release()

    async def reached(self, k: int) -> None:
        for _ in range(2000):
            if self.arrived >= k:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"the worker never reached pass {k}")


def test_every_newcomer_runs_right_after_the_pass_running_when_it_came():
    """A one-text request that arrives during a slice of a large request runs in the next pass, the second one
    too (it used to wait for a further slice, as every other one did); one that arrives during a newcomer's pass
    waits for one slice, so newcomers never starve the large request."""
    fn = SteppedEmbed()
    b = Batcher(fn, dim=2, max_batch_tokens=64, max_batch_size=64, share=16)
    b.start()
    big = [[7] * 8 for _ in range(20)]

    async def go():
        first = b.submit(big)
        await fn.reached(1)  # pass 1: a slice of the large request
        one = b.submit([[1] * 5])
        fn.step()
        await fn.reached(2)  # pass 2: the newcomer
        fn.step()
        await fn.reached(3)  # pass 3: the large request again
        two = b.submit([[2] * 5])
        fn.step()
        await fn.reached(4)  # pass 4: the second newcomer
        three = b.submit([[3] * 5])  # arrives during a newcomer's pass: the large request goes first
        fn.step(100)
        return await asyncio.gather(first, one, two, three)

    outs = _run(go())
    b.close(10)
    kinds = ["big" if x[0][0] == 7 else x[0][0] for x in fn.batches]
    assert kinds[:6] == ["big", 1, "big", 2, "big", 3]
    assert outs[0].tolist() == [[56.0, 8.0]] * 20 and outs[2].tolist() == [[10.0, 5.0]]


@pytest.mark.parametrize("served", [False, True])
def test_new_turn_goes_to_newcomers_unless_started_jobs_were_left_out(served):
    assert new_turn(True, False, served) and not new_turn(False, True, served)  # one kind waits: it goes
    assert new_turn(True, True, served) is served  # both wait: newcomers, unless the last pass left started ones out
    assert not new_turn(False, False, served)


def test_texts_of_a_cancelled_request_are_dropped():
    fn = GatedEmbed()
    b = Batcher(fn, dim=2, max_batch_tokens=64, max_batch_size=64, share=16)
    b.start()

    async def go():
        fn.gate.clear()
        fut = b.submit([[1] * 8 for _ in range(200)])
        await _held(b, fn)
        fut.cancel()  # the client went away
        fn.gate.set()
        return await b.embed([[2, 2]])

    assert _run(go()).tolist() == [[4.0, 2.0]]
    b.close(10)
    assert len(fn.batches) == 2 and b.queue_depth == 0  # the held slice, then the next request: nothing else


def test_abort_fails_what_is_queued_and_refuses_more():
    fn = GatedEmbed()
    b = Batcher(fn, dim=2, max_batch_tokens=64, max_batch_size=64, share=16)
    b.start()

    async def go():
        fn.gate.clear()
        held = b.submit([[1] * 8 for _ in range(10)])
        await _held(b, fn)
        queued = b.submit([[3]])
        assert b.abort(ShuttingDown("stopping")) == 2
        fn.gate.set()
        with pytest.raises(ShuttingDown):
            b.submit([[4]])
        return await asyncio.gather(held, queued, return_exceptions=True)

    outs = _run(go())
    b.close(10)
    assert all(isinstance(o, ShuttingDown) for o in outs)
    assert len(fn.batches) == 1 and b.queue_depth == 0


def test_oldest_first_finishes_requests_one_by_one():
    fn = GatedEmbed()
    b = Batcher(fn, dim=2, max_batch_tokens=64, max_batch_size=64, share=16)
    b.start()

    async def go():
        fn.gate.clear()
        hold = b.submit([[9]])
        await _held(b, fn)
        jobs = [b.submit([[k] * 8 for _ in range(4)]) for k in (1, 2)]
        b.oldest_first()
        fn.gate.set()
        return await asyncio.gather(hold, *jobs)

    _run(go())
    b.close(10)
    assert fn.batches[1:] == [[[1] * 8] * 4, [[2] * 8] * 4]  # whole requests, oldest first, not shares
