"""`entmtp serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, server-sent events, Prometheus metrics).

schema.py   request validation and the OpenAI response shapes
worker.py   the bounded queue and the one generation thread (one request at a time per device)
metrics.py  the Prometheus counters and gauges
app.py      the routes, error handling and streaming
"""
