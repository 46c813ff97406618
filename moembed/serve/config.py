"""Typed, validated server settings. Errors name the command-line flag at fault (`--max-batch-tokens: ...`)."""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from moembed.errors import MoembedError

DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
API_KEY_ENV = "MOEMBED_API_KEY"


class ServeConfig(BaseModel):
    """Everything `moembed serve` can be told. Defaults suit one CPU or one GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # what and where
    model: str  # a model directory (any family Embedder.load reads)
    served_model_name: str | None = None  # the `model` id clients send; default: the model's own name
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps; auto picks the accelerator when there is one
    # auto: bf16 autocast on an accelerator, float32 on CPU; int8: dynamic int8 matmuls (CPU only)
    dtype: Literal["auto", "float32", "bf16", "int8"] = "auto"
    pooling: str | None = None  # replaces the model's pooling (`Embedder.load(pooling=)`); None: the model's

    # dynamic batching (batcher.py)
    max_batch_tokens: int | None = Field(None, ge=1)  # padded tokens per forward; None: see batch_tokens()
    max_batch_size: int = Field(64, ge=1)  # texts per forward

    # limits and back-pressure
    max_concurrent_requests: int = Field(512, ge=1)  # requests admitted at once; beyond: 429 + Retry-After
    max_client_batch: int = Field(2048, ge=1)  # texts per request; beyond: 413
    auto_truncate: bool = True  # texts longer than the model's maximum: truncated (True) or 413 (False)
    api_key: SecretStr | None = None  # Bearer key required on every endpoint but /health
    graceful_timeout: float = Field(30.0, gt=0)  # seconds to finish requests in flight after SIGTERM

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not DEVICE_RE.match(v):
            raise ValueError(f"unknown device {v!r}; choose one of auto, cpu, cuda, cuda:N, mps")
        return v

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().strip():
            raise ValueError("must not be empty")
        return v

    def batch_tokens(self, device_type: str) -> int:
        """The padded-token budget per forward: the flag, or 16384 on an accelerator and 4096 on CPU (where a
        bigger pass adds latency without adding throughput)."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return 4096 if device_type == "cpu" else 16384

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name other than localhost
            return False

    @classmethod
    def from_flags(cls, **flags) -> "ServeConfig":
        """Build from command-line values; a bad value raises MoembedError naming its flag."""
        try:
            return cls(**flags)
        except ValidationError as e:
            err = e.errors()[0]
            flag = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else "serve"
            raise MoembedError(f"{flag}: {err['msg'].removeprefix('Value error, ')}") from None
