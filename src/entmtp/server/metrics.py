"""Prometheus metrics of one server (its own registry): requests, tokens, speed, tree shares, queue length,
and, with `--max-batch` > 1, the batched steps: rows per step, tokens per step over the batch, padding."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..batch import BatchStep

ROWS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # rows per batched step (le: at most)
TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # tokens one batched step emitted over all its rows


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
        self.draft_tokens = Counter(
            "entmtp_draft_tokens",
            "drafted tree nodes by source: heads, lookup, prediction, suffix, forced (drafts.py)",
            ["source"],
            registry=r,
        )
        self.accepted_draft_tokens = Counter(
            "entmtp_accepted_draft_tokens",
            "accepted drafted tokens by source (emitted; bonus tokens are no source's)",
            ["source"],
            registry=r,
        )
        self.tokens_per_second = Gauge(
            "entmtp_tokens_per_second", "tokens/s of the last generation", registry=r
        )
        self.tokens_per_step = Gauge(
            "entmtp_tokens_per_step", "tokens/step of the last generation", registry=r
        )
        self.queue = Gauge("entmtp_queue_length", "requests waiting for the device", registry=r)
        self.running = Gauge(
            "entmtp_running", "requests generating now: rows of the batch (0..--max-batch)", registry=r
        )
        self.batch_size = Gauge("entmtp_batch_size", "rows in the last batched step", registry=r)
        self.batch_steps = Counter(
            "entmtp_batch_steps", "batched steps (one forward verifying every row's tree)", registry=r
        )
        self.batch_rows = Histogram(
            "entmtp_batch_rows", "rows per batched step", buckets=ROWS_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "entmtp_batch_step_tokens",
            "tokens a batched step emitted, summed over its rows (bonus tokens included)",
            buckets=TOKENS_BUCKETS,
            registry=r,
        )
        self.batch_padding = Counter(
            "entmtp_batch_padding_tokens",
            "tokens a batched forward ran only to pad a row's tree to the step's largest",
            registry=r,
        )

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
        drafts = result.drafts
        for source, n in drafts.drafted.items():
            self.draft_tokens.labels(source=source).inc(n)
            self.accepted_draft_tokens.labels(source=source).inc(drafts.accepted.get(source, 0))

    def stepped(self, step: BatchStep, tokens: int) -> None:
        """A batched step of `step.rows` rows emitted `tokens` tokens in all."""
        self.batch_size.set(step.rows)
        self.batch_steps.inc()
        self.batch_rows.observe(step.rows)
        self.batch_tokens.observe(tokens)
        real = sum(n + 1 for n in step.nodes)  # each row's tree: its root and its drafted nodes
        self.batch_padding.inc(step.tokens - real)
