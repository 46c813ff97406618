"""`moembed serve`: an OpenAI-compatible embeddings server (see docs/serving.md)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    model: str = typer.Argument(..., help="moembed, Hugging Face BERT or sentence-transformers directory"),
    host: str = typer.Option("127.0.0.1", help="bind address (loopback by default)"),
    port: int = typer.Option(8000, help="TCP port"),
    served_model_name: str = typer.Option(None, help="the model id clients send (default: the model's name)"),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N | mps (auto: the accelerator if any)"),
    dtype: str = typer.Option("auto", help="auto | float32 | bf16 | int8 (auto: bf16 on an accelerator, float32 on "
                              "CPU; int8: dynamic int8 matmuls, CPU only)"),
    max_batch_tokens: int = typer.Option(None, help="padded tokens per forward pass (default: 4096 on CPU, 16384 on an accelerator)"),
    max_batch_size: int = typer.Option(64, help="texts per forward pass"),
    max_concurrent_requests: int = typer.Option(512, help="requests served at once; beyond: 429 + Retry-After"),
    max_client_batch: int = typer.Option(2048, help="texts per request; beyond: 413"),
    auto_truncate: bool = typer.Option(True, "--auto-truncate/--no-auto-truncate",
                                       help="truncate texts longer than the model's maximum (else 413)"),
    api_key: str = typer.Option(None, envvar="MOEMBED_API_KEY", show_envvar=True,
                                help="require 'Authorization: Bearer KEY' on every endpoint but /health"),
    graceful_timeout: float = typer.Option(30.0, help="seconds to finish requests in flight after SIGTERM"),
    pooling: str = typer.Option(None, help="mean|cls|last|max|mean_sqrt_len|weightedmean (default: the model's)"),
) -> None:
    """Serve a model over HTTP: POST /v1/embeddings (OpenAI's shape), /v1/models, /health, /metrics."""
    from moembed.serve.config import ServeConfig
    from moembed.serve.server import run

    config = ServeConfig.from_flags(
        model=model, host=host, port=port, served_model_name=served_model_name, device=device, dtype=dtype,
        max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size,
        max_concurrent_requests=max_concurrent_requests, max_client_batch=max_client_batch,
        auto_truncate=auto_truncate, api_key=api_key, graceful_timeout=graceful_timeout,
        pooling=pooling,
    )
    run(config)
