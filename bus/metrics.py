"""Prometheus metrics: one HTTP endpoint per node process, and counters that cost nothing on hot paths.

Hot paths (every event, every request) keep plain integer counters on their objects; a
:class:`LiveCounters` collector reads them at scrape time, so the cost is paid per scrape, not per message.
Names follow ``refbus_<noun>_<unit>``; labels never carry ids (blob, episode, message).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

Sample = Mapping[tuple[str, ...], float]


class LiveCounters(Collector):
    """Exposes values read from callables at scrape time.

    ``read`` returns ``{label_values: value}``; ``kind`` is ``counter`` or ``gauge``.
    """

    def __init__(self, name: str, doc: str, labels: Iterable[str], read: Callable[[], Sample], kind: str = "counter"):
        self.name = name
        self.doc = doc
        self.labels = list(labels)
        self.read = read
        self.kind = kind

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        family_type = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        family = family_type(self.name, self.doc, labels=self.labels)
        for label_values, value in self.read().items():
            family.add_metric(list(label_values), value)
        yield family

    def describe(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        family_type = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        yield family_type(self.name, self.doc, labels=self.labels)


def register_live(
    name: str,
    doc: str,
    read: Callable[[], Sample],
    *,
    labels: Iterable[str] = (),
    kind: str = "counter",
    registry: CollectorRegistry = REGISTRY,
) -> LiveCounters:
    collector = LiveCounters(name, doc, labels, read, kind)
    registry.register(collector)
    return collector


def serve_metrics(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> tuple[str, Callable[[], None]]:
    """Start the metrics endpoint in a daemon thread; returns its URL and a function that stops it."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    url = f"http://{host}:{server.server_port}/metrics"

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return url, stop
