"""`entmtp serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, server-sent events, Prometheus metrics).

app.py        create_app: the routes and error handlers registered, the request id and access log middleware
routes.py     the routes: a request read, validated and prepared for the engine, then queued
responses.py  errors in OpenAI's shape, whole replies and server-sent event streams
state.py      what the routes share: engine, worker, metrics, settings, draining
schema.py     request validation and the OpenAI response shapes
worker.py     the bounded queue, the job protocol, and the generation thread of --max-batch 1 (one at a time)
batching.py   the generation thread of --max-batch B > 1: up to B requests stepped together as one batch
thread.py     the one thread that builds the engine and runs the generation loop (torch is slower on two)
metrics.py    the Prometheus counters, gauges and histograms (the batched steps' too)
run.py        binding, the header timeout and the draining shutdown
ray_config.py `serve --ray`'s settings, arguments and `serve deploy` YAML (no Ray needed)
ray_serve.py  `serve --ray`: the engine replicas and the front as a Ray Serve application (docs/serving-ray.md)
ray_front.py  the Ray application's HTTP ingress, relaying each request to an engine replica
relay.py      a request and its answer carried between the front and a replica; failures in OpenAI's shape
ray_metrics.py a replica's Prometheus metrics mirrored into Ray's metrics export
"""
