"""The ASGI app (Starlette): POST /v1/embeddings, GET /v1/models, GET /health, GET /metrics.

A request's path: the body, read under limits (limits.py: 415 not JSON, 413 too large, 408 too slow, 429 too
many bytes held) → admission, once the body is complete (at most `max_concurrent_requests` at once, else 429 +
Retry-After) → JSON validation (400 naming the field) → limits (413: too many texts, or a text too long with
truncation off) → each text cut to `--max-chars` characters → tokenization → the batcher (shared forward passes on
the worker thread) → truncation, normalisation and precision → JSON. Tokenizing and serialising large requests
run in a thread pool, so the event loop keeps accepting requests while they work. A client that disconnects is
logged and counted as 499, and the texts it left queued are dropped.

Shutdown (`stop`, called on SIGTERM): no request is admitted any more (503), bodies still arriving are abandoned
(503); requests admitted are answered, and those still unanswered when the grace period ends get 503 while their
queued texts are dropped.
"""

from __future__ import annotations

import asyncio
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
from moembed.serve.batcher import Batcher, ShuttingDown
from moembed.serve.config import ServeConfig
from moembed.serve.engine import Engine, TooLong
from moembed.serve.limits import BodyReader, ClientGone, check_content_type
from moembed.serve.metrics import CONTENT_TYPE, Metrics, endpoint
from moembed.serve.protocol import ApiError, EmbeddingRequest, encode_response, parse_request, response_pieces

log = logging.getLogger("moembed")

# Work below these sizes runs inline on the event loop: a thread hand-off would cost more than it saves.
INLINE_CHARS = 4096  # characters to tokenize
INLINE_FLOATS = 16384  # output numbers to serialise
PIECE_FLOATS = 4096  # output numbers a large response is written in at a time, with other threads let run between


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
        share = config.share_tokens(engine.device_type, budget)
        self.batcher = Batcher(engine.embed, engine.dim, budget, config.max_batch_size, self.metrics.on_batch, threads,
                               share)
        self.metrics.watch_queue(lambda: self.batcher.queue_depth)
        self.reader = BodyReader(config.max_request_bytes, config.max_buffered_bytes, config.read_timeout)
        self.max_chars = config.chars(engine.max_length)
        self.in_flight = 0
        self.stopping = False
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.batcher.start()
        ids, _ = self.engine.tokenize(["warm-up"])
        await self.batcher.embed(ids)  # the first pass pays one-off costs (allocations, kernel selection)
        log.info("serving %s (dim %d, max length %d) on %s, computing in %s", self.engine.name, self.engine.dim,
                 self.engine.max_length, self.engine.device_type, self.engine.compute)
        yield
        # uvicorn has stopped accepting connections and every request has been answered: stop the worker.
        self.batcher.abort(ShuttingDown("server shutting down"))
        await to_thread.run_sync(self.batcher.close)

    def stop(self, grace: float) -> None:
        """SIGTERM: admit no more requests; answer those admitted, or give them 503 after `grace` seconds."""
        self.stopping = True
        self.reader.stop()
        self.batcher.oldest_first()
        asyncio.get_running_loop().call_later(grace, self._expire)

    def _expire(self) -> None:
        n = self.batcher.abort(ShuttingDown("server shutting down: the graceful timeout ended before this request "
                                            "was embedded"))
        if n:
            log.warning("graceful timeout: %d request(s) still queued answered with 503", n)

    # ---- routes ------------------------------------------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        t0 = time.perf_counter()
        status, body = 500, b""
        try:
            if self.stopping:
                raise ApiError(503, "server shutting down: request not admitted; retry", None, "shutting_down")
            check_content_type(request.headers.get("content-type"))
            body = await self.reader.read(request.receive, request.headers.get("content-length"))
            if self.in_flight >= self.config.max_concurrent_requests:
                raise ApiError(429, f"server busy: {self.in_flight} requests in flight (--max-concurrent-requests); "
                               "retry later", None, "overloaded", {"Retry-After": "1"})
            self.in_flight += 1
            self.metrics.in_flight.inc()
            try:
                response = await self._embed(body, request.receive)
            finally:
                self.in_flight -= 1
                self.metrics.in_flight.dec()
            status = 200
            return response
        except ApiError as e:
            status = e.status
            return _error(e)
        except ClientGone:
            status = 499  # nginx's code for it: nobody reads this response
            log.info("embeddings: the client closed its connection before the response")
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - one failed request must not stop the server
            log.exception("embedding request failed")
            return _error(ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error"))
        finally:
            self.reader.release(len(body))
            self.metrics.requests.labels("embeddings", str(status)).inc()
            self.metrics.latency.observe(time.perf_counter() - t0)

    async def _embed(self, body: bytes, receive) -> Response:
        req = parse_request(body)
        self._check(req)
        texts, cut = self._cut(req.input)
        big = sum(map(len, texts)) > INLINE_CHARS
        ids, truncated = await to_thread.run_sync(self._tokenize, texts, req) if big else self._tokenize(texts, req)
        truncated += sum(len(ids[i]) < self.engine.max_length for i in cut)  # cut, yet short enough in tokens
        try:
            emb = await _until_gone(self.batcher.submit(ids), receive)  # (n, d) pooled float32
        except ShuttingDown as e:
            raise ApiError(503, str(e), None, "shutting_down") from None
        tokens = sum(map(len, ids))
        big = emb.shape[0] * (req.dimensions or self.engine.dim) > INLINE_FLOATS
        payload = (await to_thread.run_sync(_one_torch_thread, self._respond_in_pieces, emb, req, tokens) if big
                   else self._respond(emb, req, tokens))
        self.metrics.texts.inc(len(ids))
        self.metrics.tokens.inc(tokens)
        self.metrics.truncated.inc(truncated)
        return Response(payload, media_type="application/json")

    def _cut(self, texts: list[str]) -> tuple[list[str], list[int]]:
        """Texts cut to `max_chars` characters before the tokenizer sees them (its work and memory grow with the
        whole text, while the model reads only its first max_length tokens), and the indices cut; with truncation
        off, a longer text is refused with 413."""
        limit = self.max_chars
        cut = [i for i, t in enumerate(texts) if len(t) > limit]
        if not cut:
            return texts, cut
        if not self.config.auto_truncate:
            i = cut[0]
            raise ApiError(413, f"input[{i}]: {len(texts[i])} characters exceed the limit of {limit} (--max-chars; "
                           "the server runs with --no-auto-truncate)", "input", "input_too_long")
        return [t[:limit] if len(t) > limit else t for t in texts], cut

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

    def _tokenize(self, texts: list[str], req: EmbeddingRequest) -> tuple[list[list[int]], int]:
        try:
            return self.engine.tokenize(texts, req.input_type, self.config.auto_truncate)
        except TooLong as e:
            raise ApiError(413, f"{e} (the server runs with --no-auto-truncate)", "input", "input_too_long") from None

    def _respond(self, emb, req: EmbeddingRequest, tokens: int) -> bytes:
        x = self.engine.postprocess(emb, req.dimensions, req.precision)
        return encode_response(x, req.encoding_format, self.engine.name, tokens)

    def _respond_in_pieces(self, emb, req: EmbeddingRequest, tokens: int) -> bytes:
        """`_respond` for a large response, on a pool thread: the JSON is written PIECE_FLOATS numbers at a time,
        and between pieces this thread gives up the interpreter lock (`time.sleep(0)`), so the event loop and the
        batcher's forward passes (which take the lock back after every torch operator) wait for one piece, not
        for the whole body: one `json.dumps` of 2,048 × 384 floats held them for 0.5-2 s."""
        x = self.engine.postprocess(emb, req.dimensions, req.precision)
        pieces = []
        for piece in response_pieces(x, req.encoding_format, self.engine.name, tokens,
                                     max(1, PIECE_FLOATS // max(x.shape[1], 1))):
            pieces.append(piece)
            time.sleep(0)
        return b"".join(pieces)

    async def models(self, request: Request) -> Response:
        self.metrics.requests.labels("models", "200").inc()
        return JSONResponse({"object": "list", "data": [
            {"id": self.engine.name, "object": "model", "created": self.created, "owned_by": "moembed"}]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.engine.name})

    async def prometheus(self, request: Request) -> Response:
        self.metrics.requests.labels("metrics", "200").inc()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


async def _until_gone(fut: asyncio.Future, receive):
    """The future's result, unless the client disconnects first: then the future is cancelled (the batcher drops
    the texts it has not embedded yet) and ClientGone is raised."""
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((fut, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not fut.done():
            fut.cancel()
        gone.cancel()
    if fut.cancelled():
        raise ClientGone
    return fut.result()


async def _disconnect(receive) -> None:
    """Returns when the client disconnects (the ASGI server's receive() waits for that once the body is read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


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
    refused = lambda path: svc.metrics.requests.labels(endpoint(path), "401").inc()  # noqa: E731
    middleware = ([Middleware(BearerAuth, key=config.api_key.get_secret_value(), on_refused=refused)]
                  if config.api_key else [])
    app = Starlette(routes=routes, middleware=middleware, lifespan=svc.lifespan,
                    exception_handlers={HTTPException: _http_error})
    app.state.service = svc
    return app
