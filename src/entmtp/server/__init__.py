"""`entmtp serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, server-sent events, Prometheus metrics).

app.py        create_app: the routes and error handlers registered, the request id and access log middleware
routes.py     the routes: a request read, validated and prepared for the engine, then queued
responses.py  errors in OpenAI's shape, whole replies and server-sent event streams
state.py      what the routes share: engine, worker, metrics, settings, draining
schema.py     request validation and the OpenAI response shapes
worker.py     the bounded queue and the one generation thread (one request at a time per device)
metrics.py    the Prometheus counters and gauges
run.py        binding, the header timeout and the draining shutdown
"""
