"""The ASGI app (Starlette): POST /v1/embeddings, GET /v1/models, GET /health, GET /metrics.

A request's path: admission (at most `max_concurrent_requests` at once, else 429 + Retry-After) → JSON
validation (400 naming the field) → limits (413: too many texts, or a text too long with truncation off) →
tokenization → the batcher (shared forward passes on the worker thread) → truncation, normalisation and
precision → JSON. Tokenizing and serialising large requests run in a thread pool, so the event loop keeps
accepting requests while they work.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from anyio import to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from moembed.errors import MoembedError
from moembed.serve.auth import BearerAuth
from moembed.serve.batcher import Batcher
from moembed.serve.config import ServeConfig
from moembed.serve.engine import Engine, TooLong
from moembed.serve.metrics import CONTENT_TYPE, Metrics
from moembed.serve.protocol import ApiError, EmbeddingRequest, encode_response, parse_request

log = logging.getLogger("moembed")

# Work below these sizes runs inline on the event loop: a thread hand-off would cost more than it saves.
INLINE_CHARS = 4096  # characters to tokenize
INLINE_FLOATS = 16384  # output numbers to serialise


def _error(e: ApiError) -> Response:
    return Response(e.body(), status_code=e.status, media_type="application/json", headers=e.headers)


def _one_torch_thread(fn, *args):
    """`fn(*args)` on a pool thread kept at one torch thread. Shaping a large request's output (normalising
    thousands of rows) would otherwise run a parallel region there and start an OpenMP team of its own, after which
    the batcher's team sleeps between regions (`moembed.serve.server.run`): single-text latency went from 7.0 to
    11.2 ms after one 2,048-text request (Zen 4, 2 threads)."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    return fn(*args)


class EmbeddingService:
    """The routes and the state they share: engine, batcher, metrics and the admission count."""

    def __init__(self, engine: Engine, config: ServeConfig, metrics: Metrics | None = None,
                 threads: int | None = None):
        self.engine, self.config = engine, config
        self.metrics = metrics or Metrics()
        budget = config.batch_tokens(engine.device_type)
        if budget < engine.max_length:
            raise MoembedError(f"--max-batch-tokens: {budget} is below the model's maximum text length "
                               f"({engine.max_length} tokens); one long text must fit in a forward pass")
        self.batcher = Batcher(engine.embed, engine.dim, budget, config.max_batch_size, self.metrics.on_batch, threads)
        self.metrics.watch_queue(lambda: self.batcher.queue_depth)
        self.in_flight = 0
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.batcher.start()
        ids, _ = self.engine.tokenize(["warm-up"])
        await self.batcher.embed(ids)  # the first pass pays one-off costs (allocations, kernel selection)
        log.info("serving %s (dim %d, max length %d) on %s, computing in %s", self.engine.name, self.engine.dim,
                 self.engine.max_length, self.engine.device_type, self.engine.compute)
        yield
        # uvicorn has stopped accepting connections and finished the requests in flight: drain and stop.
        await to_thread.run_sync(self.batcher.close)

    # ---- routes ------------------------------------------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        t0 = time.perf_counter()
        if self.in_flight >= self.config.max_concurrent_requests:
            self.metrics.requests.labels("embeddings", "429").inc()
            return _error(ApiError(429, f"server busy: {self.in_flight} requests in flight "
                                   "(--max-concurrent-requests); retry later", None, "overloaded", {"Retry-After": "1"}))
        self.in_flight += 1
        self.metrics.in_flight.inc()
        status = 500
        try:
            response = await self._embed(await request.body())
            status = 200
            return response
        except ApiError as e:
            status = e.status
            return _error(e)
        except Exception as e:  # noqa: BLE001 - one failed request must not stop the server
            log.exception("embedding request failed")
            return _error(ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error"))
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels("embeddings", str(status)).inc()
            self.metrics.latency.observe(time.perf_counter() - t0)

    async def _embed(self, body: bytes) -> Response:
        req = parse_request(body)
        self._check(req)
        big = sum(map(len, req.input)) > INLINE_CHARS
        ids, truncated = await to_thread.run_sync(self._tokenize, req) if big else self._tokenize(req)
        emb = await self.batcher.embed(ids)  # (n, d) pooled float32
        tokens = sum(map(len, ids))
        big = emb.shape[0] * (req.dimensions or self.engine.dim) > INLINE_FLOATS
        payload = (await to_thread.run_sync(_one_torch_thread, self._respond, emb, req, tokens) if big
                   else self._respond(emb, req, tokens))
        self.metrics.texts.inc(len(ids))
        self.metrics.tokens.inc(tokens)
        self.metrics.truncated.inc(truncated)
        return Response(payload, media_type="application/json")

    def _check(self, req: EmbeddingRequest) -> None:
        eng = self.engine
        if req.model is not None and req.model != eng.name:
            raise ApiError(404, f"model: unknown model {req.model!r}; this server serves {eng.name!r}", "model",
                           "model_not_found")
        if len(req.input) > self.config.max_client_batch:
            raise ApiError(413, f"input: {len(req.input)} texts exceed the limit of {self.config.max_client_batch} "
                           "per request (--max-client-batch)", "input", "too_many_inputs")
        if req.dimensions is not None and req.dimensions > eng.dim:
            raise ApiError(400, f"dimensions: {req.dimensions} is out of range 1..{eng.dim}", "dimensions", "invalid_value")
        if req.precision == "int8" and not eng.int8_ready:
            raise ApiError(400, "precision: int8 needs calibration embeddings stored with the model "
                           "(calibration.safetensors); this model has none: `moembed calibrate MODEL TEXTS` stores "
                           "one (then restart the server)", "precision", "int8_uncalibrated")

    def _tokenize(self, req: EmbeddingRequest) -> tuple[list[list[int]], int]:
        try:
            return self.engine.tokenize(req.input, req.input_type, self.config.auto_truncate)
        except TooLong as e:
            raise ApiError(413, f"{e} (the server runs with --no-auto-truncate)", "input", "input_too_long") from None

    def _respond(self, emb, req: EmbeddingRequest, tokens: int) -> bytes:
        x = self.engine.postprocess(emb, req.dimensions, req.precision)
        return encode_response(x, req.encoding_format, self.engine.name, tokens)

    async def models(self, request: Request) -> Response:
        self.metrics.requests.labels("models", "200").inc()
        return JSONResponse({"object": "list", "data": [
            {"id": self.engine.name, "object": "model", "created": self.created, "owned_by": "moembed"}]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.engine.name})

    async def prometheus(self, request: Request) -> Response:
        self.metrics.requests.labels("metrics", "200").inc()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None, "not_found"
                           if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None))


def build_app(engine: Engine, config: ServeConfig, metrics: Metrics | None = None,
              threads: int | None = None) -> Starlette:
    """The server's ASGI app over `engine`. Auth applies when `config.api_key` is set; `threads`: the torch
    threads of the batcher's forward passes (None: the process's setting)."""
    svc = EmbeddingService(engine, config, metrics, threads)
    routes = [
        Route("/v1/embeddings", svc.embeddings, methods=["POST"]),
        Route("/v1/models", svc.models, methods=["GET"]),
        Route("/health", svc.health, methods=["GET"]),
        Route("/metrics", svc.prometheus, methods=["GET"]),
    ]
    middleware = [Middleware(BearerAuth, key=config.api_key.get_secret_value())] if config.api_key else []
    app = Starlette(routes=routes, middleware=middleware, lifespan=svc.lifespan,
                    exception_handlers={HTTPException: _http_error})
    app.state.service = svc
    return app
