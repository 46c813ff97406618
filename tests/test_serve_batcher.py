"""The dynamic batcher without HTTP: batch planning by token budget, splitting and reassembly, failures."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from moembed.serve.batcher import Batcher, plan_batches


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
