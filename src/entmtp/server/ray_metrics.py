"""A replica's Prometheus metrics, mirrored into Ray's metrics export: every sample of the server's registry
(metrics.py) becomes a Ray gauge of the same name and labels, which Ray tags with the deployment, the
replica and the application, and each node's metrics agent serves to Prometheus (as `ray_<name>`). A
counter is mirrored as its current value, a histogram as its `_bucket`/`_sum`/`_count` samples."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry

log = logging.getLogger("entmtp.server")
EXPORT_S = 5.0  # seconds between two mirrorings (Ray's agent reports every ~10 s)


class Mirror:
    """Sets one gauge per (sample name, label names) from `registry`'s samples; `make_gauge(name,
    description, tag_keys)` makes a gauge with a `set(value, tags=...)` (ray.serve.metrics.Gauge)."""

    def __init__(self, registry: CollectorRegistry, make_gauge: Callable):
        self.registry, self.make_gauge = registry, make_gauge
        self.gauges: dict[tuple[str, tuple[str, ...]], object] = {}

    def export(self) -> int:
        """Mirror every sample now; how many were set."""
        count = 0
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):  # the creation timestamps prometheus_client adds
                    continue
                keys = tuple(sorted(sample.labels))
                gauge = self.gauges.get((sample.name, keys))
                if gauge is None:
                    gauge = self.make_gauge(sample.name, family.documentation or sample.name, keys)
                    self.gauges[sample.name, keys] = gauge
                gauge.set(sample.value, tags=dict(sample.labels))
                count += 1
        return count

    def start(self, stop: threading.Event, every: float = EXPORT_S) -> threading.Thread:
        """Mirror every `every` s on a daemon thread until `stop` is set."""

        def loop() -> None:
            while not stop.wait(every):
                try:
                    self.export()
                except Exception:  # noqa: BLE001 - metrics must never take the replica down
                    log.exception("mirroring the metrics into Ray's export failed")

        thread = threading.Thread(target=loop, name="entmtp-ray-metrics", daemon=True)
        thread.start()
        return thread
