"""Prometheus metrics of one server (its own registry): requests, tokens, speed, tree shares, queue length."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "entmtp_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "entmtp_prompt_tokens", "prompt tokens of finished generations", registry=r
        )
        self.tokens = Counter("entmtp_generated_tokens", "generated tokens", registry=r)
        self.steps = Counter("entmtp_decode_steps", "speculative decode steps", registry=r)
        self.seconds = Counter("entmtp_generation_seconds", "wall time spent generating", registry=r)
        self.cancelled = Counter(
            "entmtp_cancelled_generations", "generations stopped by a disconnect", registry=r
        )
        self.tree_steps = Counter(
            "entmtp_tree_steps", "decode steps by the tree verified", ["tree"], registry=r
        )
        self.tokens_per_second = Gauge(
            "entmtp_tokens_per_second", "tokens/s of the last generation", registry=r
        )
        self.tokens_per_step = Gauge(
            "entmtp_tokens_per_step", "tokens/step of the last generation", registry=r
        )
        self.queue = Gauge("entmtp_queue_length", "requests waiting for the device", registry=r)
        self.running = Gauge("entmtp_running", "requests generating now (0 or 1)", registry=r)

    def finished(self, result, cancelled: bool) -> None:
        if cancelled:
            self.cancelled.inc()
        if result is None:
            return
        self.prompt_tokens.inc(result.prompt_tokens)
        self.tokens.inc(len(result.token_ids))
        self.steps.inc(result.num_steps)
        self.seconds.inc(result.seconds)
        self.tokens_per_second.set(result.tokens_per_second)
        self.tokens_per_step.set(result.mean_tokens_per_step)
        for step in result.steps:
            self.tree_steps.labels(tree=step.tree).inc()
