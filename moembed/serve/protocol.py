"""The JSON of the API: the embeddings request (OpenAI's shape plus moembed's `input_type` and `precision`),
the response, and OpenAI-style error bodies `{"error": {"message", "type", "param", "code"}}`.

Conventions: `dimensions` keeps the first k components (Matryoshka) and renormalises as the model does;
`encoding_format: "base64"` sends each embedding's raw little-endian bytes (float32 for precision float32, as
OpenAI does; int8 and packed uint8 bytes for the other precisions), `"float"` sends JSON numbers.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ApiError(Exception):
    """A request the server refuses: HTTP status + the OpenAI error fields."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
             415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> bytes:
        err = {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
               "param": self.param, "code": self.code}
        return json.dumps({"error": err}).encode()


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings. Unknown fields are refused (a misspelt `dimension` must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: list[str]  # a single string is accepted and becomes a list of one
    model: str | None = None
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    input_type: Literal["query", "document"] | None = None
    precision: Literal["float32", "int8", "ubinary"] = "float32"
    user: str | None = None  # accepted for OpenAI compatibility, unused

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> list[str]:
        if isinstance(v, str):
            return [v]
        if not isinstance(v, list):
            raise ValueError(f"expected a string or a list of strings, got {_kind(v)}")
        if not v:
            raise ValueError("must not be an empty list")
        for i, t in enumerate(v):
            if not isinstance(t, str):
                hint = " (token-id input is not supported; send text)" if isinstance(t, (int, list)) else ""
                raise ValueError(f"item {i} is {_kind(t)}, expected a string{hint}")
        return v


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(v), type(v).__name__)


def parse_request(body: bytes) -> EmbeddingRequest:
    """Request body → EmbeddingRequest, or ApiError(400) naming the field at fault."""
    try:
        return EmbeddingRequest.model_validate_json(body)
    except ValidationError as e:
        raise _to_api_error(e) from None


def _to_api_error(e: ValidationError) -> ApiError:
    err = e.errors(include_url=False)[0]
    kind, loc = err["type"], [str(p) for p in err["loc"]]
    param = loc[0] if loc else None
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "json_invalid":
        return ApiError(400, f"request body is not valid JSON ({err.get('ctx', {}).get('error', msg)})", None, "invalid_json")
    if not loc:
        return ApiError(400, "request body must be a JSON object", None, "invalid_request")
    if kind == "missing":
        return ApiError(400, f"{param}: required field missing", param, "missing_field")
    if kind == "extra_forbidden":
        return ApiError(400, f"{param}: unknown field", param, "unknown_field")
    if kind == "literal_error":
        choices = err.get("ctx", {}).get("expected", "")
        return ApiError(400, f"{param}: unknown value {err['input']!r}; choose one of {choices}", param, "invalid_value")
    if kind == "value_error":  # our own validators: the message is complete
        return ApiError(400, f"{param}: {msg}", param, "invalid_value")
    return ApiError(400, f"{param}: {msg[0].lower()}{msg[1:]}, got {err['input']!r}", param, "invalid_value")


def encode_response(x: np.ndarray, encoding_format: str, model: str, tokens: int) -> bytes:
    """Embeddings (n, k) → the response body. float32 rows go out little-endian in base64."""
    return b"".join(response_pieces(x, encoding_format, model, tokens, len(x) or 1))


def response_pieces(x: np.ndarray, encoding_format: str, model: str, tokens: int, rows: int) -> Iterator[bytes]:
    """The response body of `encode_response` in pieces of at most `rows` embeddings each, byte for byte the same
    once joined. Writing JSON numbers holds the interpreter lock for a whole `json.dumps` call (about 1 µs a
    number: half a second for 2,048 × 384), so the server encodes a large response piece by piece and lets other
    threads run in between."""
    if encoding_format == "base64":
        x = x.astype(x.dtype.newbyteorder("<"), copy=False)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    yield b'{"object":"list","data":['
    for start in range(0, len(x), rows):
        block = x[start:start + rows]
        if encoding_format == "base64":
            vecs = [base64.b64encode(r.tobytes()).decode("ascii") for r in block]
        else:
            vecs = block.tolist()
        data = [{"object": "embedding", "index": start + i, "embedding": r} for i, r in enumerate(vecs)]
        piece = json.dumps(data, separators=(",", ":"))[1:-1]  # the items, without the list's brackets
        yield ("," + piece if start else piece).encode()
    tail = json.dumps({"model": model, "usage": usage}, separators=(",", ":"))
    yield b"]," + tail[1:].encode()
