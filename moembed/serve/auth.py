"""Bearer-key authentication: every endpoint but /health needs `Authorization: Bearer KEY` (401 otherwise).

The key is compared in constant time (hmac.compare_digest), so response timing does not reveal how much of a
guessed key was right. Each refusal is reported to `on_refused(path)` (the server counts them in /metrics).
"""

from __future__ import annotations

import hmac

from moembed.serve.protocol import ApiError

OPEN_PATHS = frozenset({"/health"})


def authorized(header: bytes | None, key: bytes) -> bool:
    """Whether an Authorization header value carries the key as a Bearer token."""
    if not header:
        return False
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


class BearerAuth:
    """ASGI middleware in front of the app (no per-request overhead beyond one header lookup)."""

    def __init__(self, app, key: str, on_refused=None):
        self.app = app
        self.key = key.encode()
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if authorized(header, self.key):
            return await self.app(scope, receive, send)
        if self.on_refused is not None:
            self.on_refused(scope["path"])
        err = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", None, "invalid_api_key")
        body = err.body()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
