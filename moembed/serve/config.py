"""Typed, validated server settings. Errors name the command-line flag at fault (`--max-batch-tokens: ...`)."""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from moembed.errors import MoembedError

DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
API_KEY_ENV = "MOEMBED_API_KEY"
MiB = 1 << 20
# --max-chars by default: characters per token of the model's maximum length. English runs at 4-5 characters a
# token and whitespace-heavy text (code, tables) at about 10, so a cut at 32 leaves every token the model reads.
CHARS_PER_TOKEN = 32


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
    backend: str = "auto"  # how inference runs (`Embedder.load(backend=)`, moembed.model.settings.BACKENDS)

    # dynamic batching (batcher.py)
    max_batch_tokens: int | None = Field(None, ge=1)  # padded tokens per forward; None: see batch_tokens()
    max_batch_size: int = Field(64, ge=1)  # texts per forward
    # padded tokens one request may put into one pass while others could be waiting; None: see share_tokens()
    max_share_tokens: int | None = Field(None, ge=1)

    # limits and back-pressure
    max_concurrent_requests: int = Field(512, ge=1)  # requests admitted at once; beyond: 429 + Retry-After
    max_client_batch: int = Field(2048, ge=1)  # texts per request; beyond: 413
    auto_truncate: bool = True  # texts longer than the model's maximum: truncated (True) or 413 (False)
    max_request_bytes: int = Field(16 * MiB, ge=1)  # body bytes per request; beyond: 413 before it is held
    max_buffered_bytes: int = Field(256 * MiB, ge=1)  # body bytes held at once by all requests; beyond: 429
    max_chars: int | None = Field(None, ge=1)  # characters per text read (cut before tokenizing); None: see chars()
    read_timeout: float = Field(30.0, gt=0)  # seconds to receive a request body; beyond: 408
    api_key: SecretStr | None = None  # Bearer key required on every endpoint but /health
    graceful_timeout: float = Field(30.0, gt=0)  # seconds to finish requests in flight after SIGTERM

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        from moembed.model.settings import BACKENDS

        if v not in BACKENDS:
            raise ValueError(f"unknown backend {v!r}; choose one of {', '.join(BACKENDS)}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not DEVICE_RE.match(v):
            raise ValueError(f"unknown device {v!r}; choose one of auto, cpu, cuda, cuda:N, mps")
        return v

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: SecretStr | None) -> SecretStr | None:
        """Surrounding whitespace is dropped: an HTTP header value never carries it (RFC 9110 §5.5), so a key
        pasted with a trailing space or newline could never match. A key must be one visible token."""
        if v is None:
            return v
        key = v.get_secret_value().strip()
        if not key:
            raise ValueError("must not be empty")
        if any(c.isspace() or not c.isprintable() or not c.isascii() for c in key):
            raise ValueError("must be printable ASCII without spaces (it travels in an HTTP header)")
        return SecretStr(key)

    @model_validator(mode="after")
    def _buffers(self) -> "ServeConfig":
        if self.max_buffered_bytes < self.max_request_bytes:
            raise ValueError(f"--max-buffered-bytes ({self.max_buffered_bytes}) must be at least "
                             f"--max-request-bytes ({self.max_request_bytes})")
        return self

    def chars(self, max_length: int) -> int:
        """Characters of a text the server reads: the flag, or CHARS_PER_TOKEN per token of the model's maximum."""
        return self.max_chars if self.max_chars is not None else CHARS_PER_TOKEN * max_length

    def share_tokens(self, device_type: str, budget: int) -> int:
        """Padded tokens one request may put into one pass: the flag, or 256 on CPU (a CPU pass costs about its
        tokens' work, so short passes lose little throughput, and a newcomer waits at most one such slice) and
        the whole budget on an accelerator (its passes take milliseconds)."""
        if self.max_share_tokens is not None:
            return min(self.max_share_tokens, budget)
        return min(256, budget) if device_type == "cpu" else budget

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
    def from_flags(cls, api_key_file: str | None = None, **flags) -> "ServeConfig":
        """Build from command-line values; a bad value raises MoembedError naming its flag. `api_key_file`: read
        the key from that file instead (not visible in `ps`, unlike --api-key)."""
        if api_key_file is not None:
            if flags.get("api_key") is not None:
                raise MoembedError(f"--api-key-file: give the key one way, not also with --api-key or {API_KEY_ENV}")
            flags["api_key"] = read_key_file(api_key_file)
        try:
            return cls(**flags)
        except ValidationError as e:
            err = e.errors()[0]
            flag = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else "serve"
            msg = err["msg"].removeprefix("Value error, ")
            raise MoembedError(msg if msg.startswith("--") else f"{flag}: {msg}") from None


def read_key_file(path: str) -> str:
    """The API key in `path` (its first line, surrounding whitespace dropped). Refuses a file that others than
    its owner may read (chmod 600 it), as ssh does for private keys."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise MoembedError(f"--api-key-file: {path}: not a regular file")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise MoembedError(f"--api-key-file: {path}: readable by other users (mode {stat.S_IMODE(mode):o}); "
                               f"run: chmod 600 {path}")
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as e:
        raise MoembedError(f"--api-key-file: {path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise MoembedError(f"--api-key-file: {path}: not UTF-8 text") from None
    if not key:
        raise MoembedError(f"--api-key-file: {path}: the first line is empty")
    return key
