"""Request bodies read under limits, so that no client can make the server hold unbounded memory or time.

    content type  a body must be JSON (`application/json`, `application/*+json`, or no Content-Type): else 415
    size          at most `max_request_bytes`: a larger Content-Length is refused before a byte is read, a
                  streamed (chunked) body as soon as it passes the limit: 413 either way, the rest is never held
    time          the whole body within `read_timeout` seconds of the request's start: else 408, so a client
                  trickling its upload holds nothing for long
    memory        bodies held at once by all requests (arriving or being served) within `max_buffered_bytes`:
                  else 429 + Retry-After; bytes are counted as they arrive, so a slow upload holds only what it sent
    client gone   a client that disconnects before its body is complete raises ClientGone (499 in the metrics)

A request is admitted (counted against --max-concurrent-requests) only once its body is complete, so uploads in
progress never lock other clients out (app.py).
"""

from __future__ import annotations

import asyncio

from moembed.serve.protocol import ApiError


class ClientGone(Exception):
    """The client closed its connection before the request was read or answered."""


def check_content_type(value: str | None) -> None:
    """Refuse a body that does not say it is JSON (415); a request without Content-Type is read as JSON."""
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise ApiError(415, f"Content-Type {media or value!r} is not supported: send the request as JSON with "
                   "'Content-Type: application/json'", None, "unsupported_media_type")


class BodyReader:
    """Reads request bodies within the limits above; `held` counts body bytes not yet released by their requests.
    Lives on the event loop (not thread-safe)."""

    def __init__(self, max_bytes: int, max_buffered: int, timeout: float):
        self.max_bytes, self.max_buffered, self.timeout = max_bytes, max_buffered, timeout
        self.held = 0
        self.stopping = False
        self._reading: set[asyncio.Timeout] = set()

    def release(self, n: int) -> None:
        """A request is done with its n body bytes."""
        self.held -= n

    def stop(self) -> None:
        """Shutdown: bodies still arriving are abandoned now (503)."""
        self.stopping = True
        now = asyncio.get_running_loop().time()
        for cm in list(self._reading):
            cm.reschedule(now)

    async def read(self, receive, content_length: str | None) -> bytes:
        """The whole body from the ASGI `receive`, counted in `held` (the caller releases len(body)), or ApiError
        413 / 408 / 429 / 503, or ClientGone; on an error nothing stays held."""
        if content_length is not None and content_length.isdigit() and int(content_length) > self.max_bytes:
            raise self._too_large(int(content_length))
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout) as cm:
                self._reading.add(cm)
                try:
                    while True:
                        msg = await receive()
                        if msg["type"] == "http.disconnect":
                            raise ClientGone
                        chunk = msg.get("body", b"")
                        if chunk:
                            if size + len(chunk) > self.max_bytes:
                                raise self._too_large(None)
                            if self.held + len(chunk) > self.max_buffered:
                                raise ApiError(429, f"server busy: {self.held} bytes of request bodies held "
                                               "(--max-buffered-bytes); retry later", None, "overloaded",
                                               {"Retry-After": "1"})
                            self.held += len(chunk)
                            size += len(chunk)
                            chunks.append(chunk)
                        if not msg.get("more_body", False):
                            break
                finally:
                    self._reading.discard(cm)
        except TimeoutError:
            self.held -= size
            if self.stopping:
                raise ApiError(503, "server shutting down: request not admitted; retry", None, "shutting_down") from None
            raise ApiError(408, f"request body not received within {self.timeout:g} s (--read-timeout)", None,
                           "request_timeout", {"Connection": "close"}) from None
        except BaseException:
            self.held -= size
            raise
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _too_large(self, announced: int | None) -> ApiError:
        got = f"Content-Length {announced}" if announced is not None else "the body"
        return ApiError(413, f"request body too large: {got} exceeds {self.max_bytes} bytes (--max-request-bytes)",
                        None, "request_too_large")
