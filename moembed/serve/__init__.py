"""`moembed serve`: an OpenAI-compatible embeddings server with token-budget dynamic batching.

Read in this order: config (the typed server settings) → engine (everything the server asks of a model) →
batcher (concurrent requests merged into forward passes) → protocol (the request and response JSON) →
metrics, auth → app (the ASGI routes) → server (uvicorn, signals, graceful shutdown).
"""
