"""Prometheus metrics: one HTTP endpoint per node process, and counters that cost nothing on hot paths.

Hot paths (every event, every request) keep plain integer counters on their objects; a
:class:`LiveCounters` collector reads them at scrape time, so the cost is paid per scrape, not per message.
Names follow ``refbus_<noun>_<unit>``; labels never carry ids (blob, episode, message).
"""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Callable, Iterable, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, make_wsgi_app
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


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not worth a log line each."""


def serve_metrics(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> tuple[str, Callable[[], None]]:
    """Start the metrics endpoint in a daemon thread; returns its URL and a function that stops it.

    prometheus_client's own server polls for shutdown every 0.5 s; this one every 50 ms, so a node exits
    promptly.
    """
    server = make_server(host, port, make_wsgi_app(registry), _ThreadingWSGIServer, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                              name="metrics")
    thread.start()
    url = f"http://{host}:{server.server_port}/metrics"

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return url, stop
