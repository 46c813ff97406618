"""`moembed serve`: an OpenAI-compatible embeddings server with token-budget dynamic batching and fair passes.

Read in this order: config (the typed server settings) → engine (everything the server asks of a model) →
batcher (concurrent requests merged into forward passes, large ones in slices) → protocol (the request and
response JSON) → limits (request bodies read within bounds) → metrics, auth → app (the ASGI routes) → server
(uvicorn, signals, graceful shutdown).
"""
