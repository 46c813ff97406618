"""`moembed serve` over real HTTP on a loopback port: outputs equal Embedder.encode, batching, limits, errors,
auth, back-pressure, metrics and graceful shutdown. Tiny random dense and MoE models; MiniLM marked real."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from net_helpers import free_port
from spy import calls_of

from moembed.errors import MoembedError
from moembed.model.cpu import int8_available
from moembed.serve.app import build_app
from moembed.serve.config import ServeConfig
from moembed.serve.engine import EmbedderEngine
from moembed.serve.server import bind_warning, uvicorn_server

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "how do plants make food",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "x",
    "",
    "The committee postponed its decision on the new budget until the spring session, citing the need for "
    "more detailed estimates from each department and a review of last year's spending.",
    "sparse mixture of experts",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "what is the capital of France?",
]
LONG = "word " * 200  # far beyond the tiny models' 64-token maximum
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: thread hand-offs cost more than they save


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, minilm_path):
    """Tiny random models saved to disk: 'dense' (with int8 calibration) and 'moe' (every layer MoE)."""
    from moembed.model.config import MoEConfig
    from moembed.model.embedder import Embedder
    from moembed.model.encoder import Encoder
    from moembed.model.presets import tiny_config
    from moembed.model.tokenizer import TextTokenizer

    out = {}
    for kind, extra in (("dense", {}), ("moe", {"moe": MoEConfig(num_experts=4, top_k=2, every=1, offset=0)})):
        torch.manual_seed(0)
        cfg = tiny_config("bert", vocab_size=30522, **extra)
        emb = Embedder(Encoder(cfg), TextTokenizer.from_dir(minilm_path, 64), name=f"tiny-{kind}").eval()
        if kind == "dense":
            emb.calibrate(TEXTS * 4)
        out[kind] = tmp_path_factory.mktemp("models") / kind
        emb.save(out[kind])
    return out


@pytest.fixture(scope="module")
def engines(model_dirs):
    """Per model: float32 ("dense", "moe") and dynamic int8 ("dense-int8", "moe-int8")."""
    out = {k: EmbedderEngine.load(str(p), device="cpu") for k, p in model_dirs.items()}
    if int8_available():
        out.update({f"{k}-int8": EmbedderEngine.load(str(p), device="cpu", dtype="int8")
                    for k, p in model_dirs.items()})
    return out


@pytest.fixture(scope="module")
def embedders(model_dirs):
    from moembed.model.embedder import Embedder

    return {k: Embedder.load(p) for k, p in model_dirs.items()}


def expected(emb, texts, input_type=None, dim=None, precision="float32"):
    """What Embedder.encode returns for the same request (input types mapped to prompt names)."""
    prompt = {"query": "search_query", "document": "search_document"}.get(input_type)
    return emb.encode(texts, prompt_name=prompt, truncate_dim=dim, precision=precision)


class Spy:
    """An Engine wrapper that records each forward's ids, can hold forwards (gate) and can fail them."""

    def __init__(self, inner):
        self.inner, self.batches, self.fail = inner, [], False
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def embed(self, ids):
        assert self.gate.wait(30)
        if self.fail:
            raise RuntimeError("engine failure (test)")
        self.batches.append([tuple(x) for x in ids])
        return self.inner.embed(ids)


class Served:
    def __init__(self, url, service):
        self.url, self.service = url, service

    def post(self, body=None, content=None, **kw):
        return httpx.post(f"{self.url}/v1/embeddings", json=body, content=content, timeout=30, **kw)


@contextlib.contextmanager
def serving(engine, **flags):
    """The real uvicorn server on a free loopback port, in a background thread; stopped on exit."""
    config = ServeConfig(model="(in memory)", **flags)
    app = build_app(engine, config)
    server = uvicorn_server(app, config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started or not thread.is_alive()) and server.started, "server did not start"
    try:
        yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.service)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive()


def wait_for(condition, timeout: float = 30.0):
    """Poll `condition()` every 10 ms until it is true or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


@contextlib.contextmanager
def held(s: Served, spy: Spy, body: dict | None = None):
    """Hold the worker on one pass: `body` ({"input": ["hold"]}) is posted from a thread and queued behind the
    closed gate; the block gets a list that receives its response. On exit the pass goes on and the post returns."""
    out: list = []
    spy.gate.clear()
    poster = threading.Thread(target=lambda: out.append(s.post(body or {"input": ["hold"]})))
    poster.start()
    try:
        assert wait_for(lambda: s.service.batcher.queue_depth), "the held request was not queued"
        yield out
    finally:
        spy.gate.set()
        poster.join(30)


def rows(resp) -> np.ndarray:
    assert resp.status_code == 200, resp.text
    data = resp.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.array([d["embedding"] for d in data])


# ---- outputs --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_outputs_equal_embedder_encode(kind, engines, embedders):
    emb = embedders[kind]
    with serving(engines[kind]) as s:
        for input_type in (None, "query", "document"):
            got = rows(s.post({"input": TEXTS, "input_type": input_type} if input_type else {"input": TEXTS}))
            np.testing.assert_allclose(got, expected(emb, TEXTS, input_type), rtol=0, atol=1e-6)
        # a single string in, one embedding out
        one = rows(s.post({"input": TEXTS[1], "model": f"tiny-{kind}"}))
        np.testing.assert_allclose(one, expected(emb, TEXTS[1:2]), rtol=0, atol=1e-6)
        # the query prefix changes the embedding (the tiny models carry the search_query/search_document prompts)
        q = rows(s.post({"input": TEXTS[:1], "input_type": "query"}))
        assert np.abs(q - rows(s.post({"input": TEXTS[:1]}))).max() > 1e-3
        ub = rows(s.post({"input": TEXTS, "precision": "ubinary", "dimensions": 24}))
        np.testing.assert_array_equal(ub, expected(emb, TEXTS, dim=24, precision="ubinary"))
        r = s.post({"input": TEXTS})
        assert r.json()["usage"] == {"prompt_tokens": sum(len(x) for x in engines[kind].tokenize(TEXTS)[0]),
                                     "total_tokens": sum(len(x) for x in engines[kind].tokenize(TEXTS)[0])}
        assert r.json()["model"] == f"tiny-{kind}" and r.json()["object"] == "list"


def test_int8_uses_the_stored_calibration(engines, embedders):
    with serving(engines["dense"]) as s:
        got = rows(s.post({"input": TEXTS, "precision": "int8", "dimensions": 16}))
    np.testing.assert_array_equal(got, expected(embedders["dense"], TEXTS, dim=16, precision="int8"))


def test_dimensions_truncate_and_renormalise(engines, embedders):
    full = embedders["dense"].encode(TEXTS, normalize=False)
    with serving(engines["dense"]) as s:
        got = rows(s.post({"input": TEXTS, "dimensions": 8}))
    assert got.shape == (len(TEXTS), 8)
    np.testing.assert_allclose(got, full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


# Bit-for-bit comparisons with `encode` need the request in one pass, as `encode` makes it: a pass of another size
# rounds its sums in another order (within 1e-6, test_embeddings_do_not_depend_on_the_batch).
ONE_PASS = {"max_share_tokens": 4096}


def test_base64_is_little_endian_float32(engines, embedders):
    with serving(engines["moe"], **ONE_PASS) as s:
        data = s.post({"input": TEXTS, "encoding_format": "base64", "dimensions": 16}).json()["data"]
        ub = s.post({"input": TEXTS, "encoding_format": "base64", "precision": "ubinary"}).json()["data"]
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])
    np.testing.assert_array_equal(got, expected(embedders["moe"], TEXTS, dim=16))
    bits = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.uint8) for d in ub])
    np.testing.assert_array_equal(bits, expected(embedders["moe"], TEXTS, precision="ubinary"))


def test_openai_client(engines, embedders):
    from openai import OpenAI

    emb = embedders["dense"]
    with serving(engines["dense"], **ONE_PASS) as s:
        client = OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=30)
        r = client.embeddings.create(model="tiny-dense", input=TEXTS)  # the client asks for base64 and decodes it
        np.testing.assert_array_equal(np.array([d.embedding for d in r.data], dtype=np.float32), expected(emb, TEXTS))
        r = client.embeddings.create(model="tiny-dense", input=TEXTS[:3], dimensions=12, encoding_format="float",
                                     extra_body={"input_type": "document"})
        np.testing.assert_allclose(np.array([d.embedding for d in r.data]),
                                   expected(emb, TEXTS[:3], "document", dim=12), atol=1e-6)
        assert r.usage.prompt_tokens > 0 and [m.id for m in client.models.list().data] == ["tiny-dense"]


# ---- batching ---------------------------------------------------------------------------------------------------


async def _post_all(url, bodies):
    async with httpx.AsyncClient(timeout=60) as c:
        return await asyncio.gather(*(c.post(f"{url}/v1/embeddings", json=b) for b in bodies))


int8_only = pytest.mark.skipif(not int8_available(), reason="this torch build has no x86 quantised kernels")


@pytest.mark.parametrize("kind", ["dense", "moe", pytest.param("dense-int8", marks=int8_only),
                                  pytest.param("moe-int8", marks=int8_only)])
def test_embeddings_do_not_depend_on_the_batch(kind, engines):
    spy = Spy(engines[kind])
    target = TEXTS[4]
    crowd = [{"input": [t + f" variant {i}" for t in TEXTS] + ([target] if i == 5 else [])} for i in range(12)]
    with serving(spy, max_batch_tokens=4096) as s:
        alone = rows(s.post({"input": [target]}))[0]
        out: list = []
        task = threading.Thread(target=lambda: out.extend(asyncio.run(_post_all(s.url, crowd))))
        with held(s, spy):  # the crowd queues up behind the held pass and shares the next passes
            spy.batches.clear()
            task.start()
            queued = 1 + sum(len(b["input"]) for b in crowd)  # every crowd text, plus the held one
            assert wait_for(lambda: s.service.batcher.queue_depth == queued)
        task.join(60)
    together = rows(out[5])[-1]
    ids = tuple(engines[kind].tokenize([target])[0][0])
    batch = next(b for b in spy.batches if ids in b)
    assert len(batch) > len(crowd[5]["input"])  # the target shared its pass with texts of other requests
    np.testing.assert_allclose(together, alone, rtol=0, atol=1e-6)
    for body, r in zip(crowd, out):  # every request got its own texts back, in order
        assert len(rows(r)) == len(body["input"])


@int8_only
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_int8_compute_serves_what_the_int8_embedder_encodes(kind, engines, embedders, model_dirs, monkeypatch):
    """`--dtype int8`: the served rows are `Embedder.load(dtype="int8")`'s, computed on int8 matmuls."""
    import moembed.model.fast.experts as fast_experts
    import moembed.model.fast.int8 as fast_int8
    from moembed.model.embedder import Embedder
    from moembed.model.fast.experts import Int8Experts
    from moembed.model.fast.int8 import Int8Linear, fused_rows, int8_kernel
    from moembed.model.linear import Linear

    engine = engines[f"{kind}-int8"]
    assert engine.compute == f"int8 ({int8_kernel()} kernel)" and engines[kind].compute == "float32"
    linear_calls = calls_of(monkeypatch, fast_int8, "int8_linear")
    expert_calls = calls_of(monkeypatch, fast_experts, "int8_linear")
    with serving(engine) as s:
        got = rows(s.post({"input": TEXTS}))
    assert linear_calls and bool(expert_calls) == (kind == "moe")  # the server's passes ran int8 matmuls
    int8 = Embedder.load(model_dirs[kind], dtype="int8")
    np.testing.assert_allclose(got, int8.encode(TEXTS), rtol=0, atol=1e-6)
    float32 = embedders[kind].encode(TEXTS)
    assert 0 < np.abs(got - float32).max() < 0.2  # int8's rounding, not another model
    assert engine.emb.backend.path("linear") == "int8"
    assert kind == "dense" or engine.emb.backend.path("moe") == "int8-loop"
    layers = [m for m in engine.emb.encoder.modules() if isinstance(m, Linear)]
    assert layers and all(isinstance(m, Int8Linear) and m.fused == fused_rows(m.settings) for m in layers)
    experts = [m for m in engine.emb.encoder.modules() if isinstance(m, Int8Experts)]
    assert len(experts) == (0 if kind == "dense" else len(engine.emb.encoder.layers))


def test_request_larger_than_the_budget_is_split(engines, embedders):
    spy = Spy(engines["dense"])
    texts = [f"{t} {i}" for i in range(8) for t in TEXTS]  # 64 texts, up to 64 tokens each
    with serving(spy, max_batch_tokens=128, max_batch_size=8) as s:
        spy.batches.clear()
        got = rows(s.post({"input": texts}))
    assert len(spy.batches) >= 8
    assert all(len(b) * max(map(len, b)) <= 128 for b in spy.batches)
    np.testing.assert_allclose(got, expected(embedders["dense"], texts), rtol=0, atol=1e-6)


def test_concurrent_requests(engines, embedders):
    bodies = [{"input": TEXTS[i % len(TEXTS):] or TEXTS[:1], "dimensions": 8 + i} for i in range(16)]
    with serving(engines["dense"]) as s:
        out = asyncio.run(_post_all(s.url, bodies))
    for b, r in zip(bodies, out):
        np.testing.assert_allclose(rows(r), expected(embedders["dense"], b["input"], dim=b["dimensions"]), atol=1e-6)


# ---- limits and bad requests ---------------------------------------------------------------------------------------

BAD = [
    ("malformed JSON", b'{"input": ["a"', 400, None),
    ("not an object", b'["a"]', 400, None),
    ("missing input", b'{"model": "tiny-dense"}', 400, "input"),
    ("non-string input", b'{"input": 5}', 400, "input"),
    ("non-string item", b'{"input": ["a", 3]}', 400, "input"),
    ("token ids", b'{"input": [[101, 102]]}', 400, "input"),
    ("empty list", b'{"input": []}', 400, "input"),
    ("unknown input_type", b'{"input": "a", "input_type": "passage"}', 400, "input_type"),
    ("unknown precision", b'{"input": "a", "precision": "int4"}', 400, "precision"),
    ("unknown encoding", b'{"input": "a", "encoding_format": "hex"}', 400, "encoding_format"),
    ("dimensions 0", b'{"input": "a", "dimensions": 0}', 400, "dimensions"),
    ("dimensions too big", b'{"input": "a", "dimensions": 33}', 400, "dimensions"),
    ("dimensions as text", b'{"input": "a", "dimensions": "8"}', 400, "dimensions"),
    ("unknown field", b'{"input": "a", "dimension": 8}', 400, "dimension"),
    ("unknown model", b'{"input": "a", "model": "text-embedding-3-small"}', 404, "model"),
    ("too many texts", b'{"input": ["a", "b", "c", "d", "e"]}', 413, "input"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(engines):
    with serving(engines["dense"], max_client_batch=4) as s:
        for name, body, status, param in BAD:
            r = s.post(content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (name, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, name
            assert err["type"] == "invalid_request_error" and (param is None or param in err["message"]), name
            assert rows(s.post({"input": ["still serving"]})).shape == (1, 32), name
        assert httpx.get(f"{s.url}/v1/nope").json()["error"]["code"] == "not_found"
        assert httpx.get(f"{s.url}/v1/embeddings").status_code == 405


def test_int8_without_calibration_is_refused(engines):
    with serving(engines["moe"]) as s:
        r = s.post({"input": "a", "precision": "int8"})
    assert r.status_code == 400 and "calibration" in r.json()["error"]["message"]


def test_long_texts_truncated_by_default_or_refused(engines, embedders):
    with serving(engines["dense"]) as s:
        r = s.post({"input": ["short", LONG]})
        np.testing.assert_allclose(rows(r), expected(embedders["dense"], ["short", LONG]), atol=1e-6)
        assert r.json()["usage"]["prompt_tokens"] == 3 + 64
    with serving(engines["dense"], auto_truncate=False) as s:
        r = s.post({"input": ["short", LONG]})
        assert r.status_code == 413 and r.json()["error"]["param"] == "input" and "input[1]" in r.json()["error"]["message"]
        assert rows(s.post({"input": ["short", "word " * 30]})).shape == (2, 32)  # under the maximum: served


def test_overload_answers_429_with_retry_after(engines):
    spy = Spy(engines["dense"])
    with serving(spy, max_concurrent_requests=1) as s:
        with httpx.Client(base_url=s.url, timeout=30) as c:  # one keep-alive connection for both requests
            with held(s, spy) as first:
                assert wait_for(lambda: s.service.in_flight == 1)
                r = c.post("/v1/embeddings", json={"input": ["one too many"] * 100})
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"
            assert first[0].status_code == 200
            assert rows(c.post("/v1/embeddings", json={"input": ["after"]})).shape == (1, 32)
        assert 'moembed_requests_total{endpoint="embeddings",status="429"} 1.0' in httpx.get(f"{s.url}/metrics").text


def test_engine_failure_is_500_and_the_server_recovers(engines):
    spy = Spy(engines["dense"])
    with serving(spy) as s:
        spy.fail = True
        r = s.post({"input": ["a"]})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        spy.fail = False
        assert s.post({"input": ["a"]}).status_code == 200


def test_api_key(engines):
    with serving(engines["dense"], api_key="s3cret") as s:
        assert httpx.get(f"{s.url}/health").status_code == 200  # open: load balancers probe it
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(f"{s.url}{path}").status_code == 401
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"}, {"authorization": "s3cret"}):
            r = s.post({"input": "a"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
            assert r.headers["www-authenticate"] == "Bearer"
        assert s.post({"input": "a"}, headers={"authorization": "Bearer s3cret"}).status_code == 200
        from openai import AuthenticationError, OpenAI

        ok = OpenAI(base_url=f"{s.url}/v1", api_key="s3cret", max_retries=0, timeout=30)
        assert len(ok.embeddings.create(model="tiny-dense", input=["a", "b"]).data) == 2
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{s.url}/v1", api_key="nope", max_retries=0).embeddings.create(model="tiny-dense", input="a")


def test_health_models_and_metrics(engines):
    with serving(engines["moe"], max_batch_tokens=64) as s:
        assert httpx.get(f"{s.url}/health").json() == {"status": "ok", "model": "tiny-moe"}
        m = httpx.get(f"{s.url}/v1/models").json()
        assert m["object"] == "list" and m["data"][0]["id"] == "tiny-moe"
        asyncio.run(_post_all(s.url, [{"input": TEXTS}] * 3))
        text = httpx.get(f"{s.url}/metrics").text
    assert f"moembed_texts_total {3.0 * len(TEXTS)}" in text
    assert 'moembed_requests_total{endpoint="embeddings",status="200"} 3.0' in text
    assert "moembed_queue_depth 0.0" in text and "moembed_requests_in_flight 0.0" in text
    assert "moembed_request_duration_seconds_count 3.0" in text and "moembed_batch_padded_tokens_bucket" in text
    batches = float(next(x for x in text.splitlines() if x.startswith("moembed_batch_size_count")).split()[-1])
    assert batches >= 1 + 3 * len(TEXTS) * 2 / 64  # warm-up pass + the requests under a 64-token budget


def test_config_errors_name_the_flag(engines):
    with pytest.raises(MoembedError, match="--device: unknown device 'tpu'"):
        ServeConfig.from_flags(model="m", device="tpu")
    with pytest.raises(MoembedError, match="--max-batch-size"):
        ServeConfig.from_flags(model="m", max_batch_size=0)
    with pytest.raises(MoembedError, match="--max-batch-tokens: 32 is below the model's maximum"):
        build_app(engines["dense"], ServeConfig(model="m", max_batch_tokens=32))


def test_run_keeps_torch_off_the_event_loop_thread(model_dirs, monkeypatch):
    """`run` loads the model and serves with one torch thread on its own (the event loop's) thread and hands the
    process's thread count to the batcher's worker, so that OpenMP's team is the worker's alone."""
    from moembed.serve import server as server_module

    seen = {}

    class Stub:  # stands in for uvicorn: records instead of serving
        def __init__(self, app):
            self.app = app

        def run(self):
            seen["event loop"] = torch.get_num_threads()
            seen["worker"] = self.app.state.service.batcher.threads

    monkeypatch.setattr(server_module, "uvicorn_server", lambda app, config: Stub(app))
    handler, before = signal.getsignal(signal.SIGTERM), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        server_module.run(ServeConfig(model=str(model_dirs["dense"]), device="cpu"))
    finally:
        torch.set_num_threads(before)
        signal.signal(signal.SIGTERM, handler)
    assert seen == {"event loop": 1, "worker": 2}


def test_large_responses_are_shaped_with_one_torch_thread(engines, monkeypatch):
    """A large response is shaped on a pool thread kept at one torch thread (no second OpenMP team there)."""
    from moembed.serve import app as app_module

    seen = []
    shape = app_module._one_torch_thread

    def spy(fn, *args):
        out = shape(fn, *args)
        seen.append(torch.get_num_threads())
        return out

    monkeypatch.setattr(app_module, "_one_torch_thread", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what a new pool thread would start with
    try:
        with serving(engines["dense"]) as s:
            got = rows(s.post({"input": [TEXTS[4]] * 600}))  # 600 x 32 numbers: over INLINE_FLOATS
    finally:
        torch.set_num_threads(before)
    assert len(got) == 600 and seen == [1]


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.uint8])
def test_response_pieces_join_to_the_whole_body(encoding_format, dtype):
    """The body written piece by piece is byte for byte the one JSON document the OpenAI shape gives."""
    from moembed.serve.protocol import encode_response, response_pieces

    x = (np.random.default_rng(0).standard_normal((7, 5)) * 50).astype(dtype)
    vecs = x.tolist() if encoding_format == "float" else [base64.b64encode(r.tobytes()).decode() for r in x]
    whole = json.dumps({"object": "list", "data": [{"object": "embedding", "index": i, "embedding": v}
                                                   for i, v in enumerate(vecs)],
                        "model": "m", "usage": {"prompt_tokens": 9, "total_tokens": 9}}, separators=(",", ":"))
    for rows in (1, 3, 7, 100):
        pieces = list(response_pieces(x, encoding_format, "m", 9, rows))
        assert b"".join(pieces) == whole.encode() == encode_response(x, encoding_format, "m", 9)
        assert len(pieces) == 2 + -(-7 // rows)  # head, ceil(7 / rows) pieces of embeddings, tail
    assert b"".join(response_pieces(x[:0], encoding_format, "m", 0, 4)) == encode_response(x[:0], encoding_format, "m", 0)


def test_large_responses_are_written_in_pieces(engines, embedders, monkeypatch):
    """A large response's JSON is written PIECE_FLOATS numbers at a time (one `json.dumps` of it all held the
    interpreter lock, and so the event loop and the forward passes, for up to 2 s), and comes out the same."""
    from moembed.serve import app as app_module

    sizes = []
    pieces = app_module.response_pieces

    def spy(x, *args):
        for piece in pieces(x, *args):
            sizes.append(piece.count(b'"embedding":'))
            yield piece

    monkeypatch.setattr(app_module, "response_pieces", spy)
    with serving(engines["dense"]) as s:
        got = rows(s.post({"input": TEXTS * 75}))  # 600 x 32 numbers: over INLINE_FLOATS
    np.testing.assert_allclose(got, np.tile(expected(embedders["dense"], TEXTS), (75, 1)), atol=1e-5)
    per_piece = app_module.PIECE_FLOATS // got.shape[1]
    assert sum(sizes) == 600 and len(sizes) > 3 and max(sizes) == per_piece


def test_open_bind_without_key_warns():
    assert bind_warning(ServeConfig(model="m")) is None
    assert bind_warning(ServeConfig(model="m", host="::1")) is None
    assert "without an API key" in bind_warning(ServeConfig(model="m", host="0.0.0.0"))
    assert bind_warning(ServeConfig(model="m", host="0.0.0.0", api_key="k")) is None


# ---- the command, end to end ---------------------------------------------------------------------------------------


def test_cli_serves_and_sigterm_finishes_the_request_in_flight(model_dirs):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "MOEMBED_API_KEY": "k3y", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "moembed.cli.main", "serve", str(model_dirs["dense"]), "--port", str(port),
           "--device", "cpu", "--max-batch-size", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    auth = {"authorization": "Bearer k3y"}
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key came from MOEMBED_API_KEY
        big = {"input": [f"{TEXTS[4]} {i}" for i in range(512)]}  # 512 passes of one text: a second or more of work
        result: dict = {}

        def send():
            result["r"] = httpx.post(f"{url}/v1/embeddings", json=big, headers=auth, timeout=120)
            result["t"] = time.monotonic()

        t = threading.Thread(target=send)
        t.start()
        for _ in range(600):
            if "moembed_requests_in_flight 1.0" in httpx.get(f"{url}/metrics", headers=auth).text:
                break
            time.sleep(0.01)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    r = result["r"]
    assert r.status_code == 200 and len(r.json()["data"]) == 512
    assert result["t"] > sent  # it was answered after SIGTERM arrived
    assert "Shutting down" in proc.stderr.read()


# ---- real model -----------------------------------------------------------------------------------------------------


@pytest.mark.real
@int8_only
def test_minilm_served_in_int8_is_close_to_float32(minilm_path, minilm):
    engine = EmbedderEngine.load(str(minilm_path), device="cpu", dtype="int8")
    with serving(engine) as s:
        got = rows(s.post({"input": TEXTS + [LONG]}))
    cos = (got * minilm.encode(TEXTS + [LONG])).sum(1)
    assert cos.min() > 0.99, cos


@pytest.mark.real
def test_minilm_through_the_openai_client(minilm_path, minilm):
    from openai import OpenAI

    engine = EmbedderEngine.load(str(minilm_path), device="cpu", name="all-MiniLM-L6-v2")
    texts = TEXTS + [LONG]
    with serving(engine) as s:
        client = OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        full = np.array([d.embedding for d in client.embeddings.create(model="all-MiniLM-L6-v2", input=texts).data])
        cut = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, dimensions=128, encoding_format="float")
        solo = asyncio.run(_post_all(s.url, [{"input": t} for t in texts]))  # concurrent one-text requests
        # MiniLM has no search_query prompt: input_type leaves the texts as they are
        q = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, extra_body={"input_type": "query"})
    np.testing.assert_allclose(full, minilm.encode(texts), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.array([d.embedding for d in cut.data]), minilm.encode(texts, dim=128), atol=1e-6)
    np.testing.assert_allclose(np.concatenate([rows(r) for r in solo]), full, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.array([d.embedding for d in q.data]), full, rtol=0, atol=1e-6)
