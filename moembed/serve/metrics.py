"""Server metrics in the Prometheus text format (GET /metrics), on a registry of the server's own.

    moembed_requests_total{endpoint,status}    requests answered, by endpoint and HTTP status (401s included;
                                               499: the client disconnected before its response)
    moembed_texts_total, moembed_tokens_total  texts embedded and their tokens (prefix and specials included)
    moembed_texts_truncated_total              texts cut to the model's maximum length
    moembed_batch_size                         texts per forward pass (histogram)
    moembed_batch_padded_tokens                batch size × longest text per forward pass (histogram)
    moembed_forward_seconds                    duration of a forward pass (histogram)
    moembed_queue_depth                        texts waiting for a forward pass (gauge)
    moembed_requests_in_flight                 embedding requests admitted and not yet answered (gauge)
    moembed_request_duration_seconds           embedding request latency, admission to response (histogram)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from moembed.serve.batcher import BatchStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
_POW2 = tuple(float(2**i) for i in range(0, 17))  # 1 … 65536
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


ENDPOINTS = {"/v1/embeddings": "embeddings", "/v1/models": "models", "/metrics": "metrics", "/health": "health"}


def endpoint(path: str) -> str:
    """The `endpoint` label of a request path ("other" for paths the server does not serve)."""
    return ENDPOINTS.get(path, "other")


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("moembed_requests", "Requests answered", ["endpoint", "status"], registry=r)
        self.texts = Counter("moembed_texts", "Texts embedded", registry=r)
        self.tokens = Counter("moembed_tokens", "Tokens of the texts embedded", registry=r)
        self.truncated = Counter("moembed_texts_truncated", "Texts truncated to the maximum length", registry=r)
        self.batch_size = Histogram("moembed_batch_size", "Texts per forward pass", buckets=_POW2, registry=r)
        self.batch_tokens = Histogram("moembed_batch_padded_tokens", "Padded tokens per forward pass",
                                      buckets=_POW2, registry=r)
        self.forward = Histogram("moembed_forward_seconds", "Forward pass duration", buckets=_SECONDS, registry=r)
        self.queue_depth = Gauge("moembed_queue_depth", "Texts waiting for a forward pass", registry=r)
        self.in_flight = Gauge("moembed_requests_in_flight", "Embedding requests being served", registry=r)
        self.latency = Histogram("moembed_request_duration_seconds", "Embedding request latency",
                                 buckets=_SECONDS, registry=r)

    def on_batch(self, s: BatchStats) -> None:
        """Called by the batcher's worker thread after each forward pass (prometheus_client is thread-safe)."""
        self.batch_size.observe(s.size)
        self.batch_tokens.observe(s.padded_tokens)
        self.forward.observe(s.seconds)

    def watch_queue(self, depth) -> None:
        """Read the queue depth from `depth()` at each scrape."""
        self.queue_depth.set_function(depth)

    def render(self) -> bytes:
        return generate_latest(self.registry)
