"""Run the app under uvicorn: load the model, warn about open binds, shut down on SIGTERM and exit 0.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections and the app stops admitting requests (503); requests
admitted are answered, and those still waiting when `graceful_timeout` seconds have passed get a JSON 503 while
their queued texts are dropped (`EmbeddingService.stop`). uvicorn's own deadline, half a second later, only
backs this up. The app's lifespan then stops the batcher's worker after the pass it is running, so the process
exits within the graceful timeout plus one pass.
"""

from __future__ import annotations

import logging
import signal

import torch
import uvicorn

from moembed.serve.app import build_app
from moembed.serve.config import API_KEY_ENV, ServeConfig
from moembed.serve.engine import EmbedderEngine

log = logging.getLogger("moembed")


def bind_warning(config: ServeConfig) -> str | None:
    """The warning for a bind address other machines can reach, when no API key protects it."""
    if config.loopback or config.api_key is not None:
        return None
    return (f"serving on {config.host} without an API key: anyone who can reach this address can use the model "
            f"(set --api-key-file or {API_KEY_ENV})")


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown starts (uvicorn itself only tells it once every request
    has finished)."""

    def __init__(self, config: uvicorn.Config, service, grace: float):
        super().__init__(config)
        self.service, self.grace = service, grace

    async def shutdown(self, sockets=None) -> None:
        self.service.stop(self.grace)
        await super().shutdown(sockets)


def uvicorn_server(app, config: ServeConfig) -> uvicorn.Server:
    """A uvicorn server for `app` (from build_app) with the config's address and graceful timeout; not started."""
    uv = uvicorn.Config(
        app, host=config.host, port=config.port, lifespan="on", access_log=False, log_level="info",
        timeout_graceful_shutdown=config.graceful_timeout + 0.5,
    )
    return _Server(uv, app.state.service, config.graceful_timeout)


def run(config: ServeConfig) -> None:
    """Serve until SIGTERM/SIGINT; returns once everything in flight has been answered."""
    warning = bind_warning(config)
    if warning:
        log.warning(warning)
    # The forward passes run on the batcher's worker thread with the process's torch threads; this thread (the
    # event loop: parsing, tokenizing, shaping outputs) keeps one. Once this thread has run a parallel region,
    # OpenMP keeps its team, and the worker's team, then one of two on 2 cores, sleeps between regions instead of
    # spinning: every operator of a short text's forward pass ran 1.6-2.3x slower there, a one-text request took
    # 8.2-8.6 ms of forward pass instead of 4.3-4.9 (Zen 4; BENCHMARKS.md, "two torch threads").
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = EmbedderEngine.load(config.model, config.device, config.dtype, config.served_model_name, config.pooling,
                                 config.backend)
    server = uvicorn_server(build_app(engine, config, threads=threads), config)
    # uvicorn re-raises the signal it caught once it has shut down gracefully; by then all work is done, so
    # SIGTERM ends the process with status 0 instead of "killed by SIGTERM".
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
