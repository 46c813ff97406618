"""`moembed serve`: an OpenAI-compatible embeddings server (see docs/serving.md)."""

from __future__ import annotations

import logging
import os
import sys

import typer

from moembed.cli import options as o


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    model: str = typer.Argument(..., help="moembed, Hugging Face BERT or sentence-transformers directory"),
    host: str = typer.Option("127.0.0.1", help="bind address (loopback by default)"),
    port: int = typer.Option(8000, help="TCP port"),
    served_model_name: str = typer.Option(None, help="the model id clients send (default: the model's name)"),
    device: str = o.device_option(),
    dtype: o.ServeCompute = typer.Option("auto", help="auto: bf16 on an accelerator, float32 on CPU; int8: dynamic "
                                         "int8 matmuls, CPU only"),
    max_batch_tokens: int = typer.Option(None, help="padded tokens per forward pass (default: 4096 on CPU, 16384 on an accelerator)"),
    max_batch_size: int = typer.Option(64, help="texts per forward pass"),
    max_share_tokens: int = typer.Option(None, help="padded tokens one request may put into a forward pass; a larger "
                                         "request is split and interleaved with others (default: 256 on CPU, "
                                         "--max-batch-tokens on an accelerator)"),
    max_concurrent_requests: int = typer.Option(512, help="requests served at once; beyond: 429 + Retry-After"),
    max_client_batch: int = typer.Option(2048, help="texts per request; beyond: 413"),
    auto_truncate: bool = typer.Option(True, "--auto-truncate/--no-auto-truncate",
                                       help="truncate texts longer than the model's maximum (else 413)"),
    max_request_bytes: int = typer.Option(16 << 20, help="bytes per request body; beyond: 413, before it is held"),
    max_buffered_bytes: int = typer.Option(256 << 20, help="bytes of request bodies held at once; beyond: 429"),
    max_chars: int = typer.Option(None, help="characters per text; a longer text is cut before tokenizing (413 with "
                                  "--no-auto-truncate); default: 32 per token of the model's maximum length"),
    read_timeout: float = typer.Option(30.0, help="seconds to receive a request body; beyond: 408"),
    api_key: str = typer.Option(None, envvar="MOEMBED_API_KEY", show_envvar=True,
                                help="require 'Authorization: Bearer KEY' on every endpoint but /health (visible "
                                "in ps: prefer MOEMBED_API_KEY or --api-key-file)"),
    api_key_file: str = typer.Option(None, help="read the API key from the first line of this file (mode 600)"),
    graceful_timeout: float = typer.Option(30.0, help="seconds to finish requests in flight after SIGTERM; then "
                                           "503 for those left and exit"),
    pooling: o.Pooling = typer.Option(None, help="how token states become one vector (default: the model's)"),
    backend: o.Backend = o.backend_option(),
) -> None:
    """Serve a model over HTTP: POST /v1/embeddings (OpenAI's shape), /v1/models, /health, /metrics."""
    from moembed.serve.config import ServeConfig
    from moembed.serve.server import run

    config = ServeConfig.from_flags(
        model=model, host=host, port=port, served_model_name=served_model_name, device=device, dtype=dtype,
        max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size,
        max_concurrent_requests=max_concurrent_requests, max_client_batch=max_client_batch,
        auto_truncate=auto_truncate, api_key=api_key, graceful_timeout=graceful_timeout,
        max_share_tokens=max_share_tokens, max_request_bytes=max_request_bytes, max_buffered_bytes=max_buffered_bytes,
        max_chars=max_chars, read_timeout=read_timeout, api_key_file=api_key_file,
        pooling=pooling, backend=backend,
    )
    run(config)
    # Every request has been answered and logged: leave without the interpreter's teardown, which spends seconds
    # unloading torch and would break the promise to exit within --graceful-timeout + 1 s after SIGTERM.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
