"""Prometheus metrics: one HTTP endpoint per node process, and counters that cost nothing on hot paths.

Hot paths (every event, every request) keep plain integer counters on their objects; a
:class:`LiveCounters` collector reads them at scrape time, so the cost is paid per scrape, not per message.
Names follow ``refbus_<noun>_<unit>``; labels never carry ids (blob, episode, message).

The endpoint can also answer extra paths with JSON (:data:`ROUTES`): the broker serves Prometheus service
discovery there (``/sd``), so one fixed address finds every node of a cluster.
"""

from __future__ import annotations

import io
import json
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from .sockets import CannotBind, bind_error

Readings = Mapping[tuple[str, ...], float]

Route = Callable[[], object]
"""An extra path of the metrics endpoint: called on the HTTP thread per request; returns a JSON-able value."""

MAX_CONNECTIONS = 32
"""Connections the endpoint serves at once, each on a thread of its own. One more is closed as soon as it is
accepted: clients that connect and send nothing (or trickle) hold at most this many threads and file
descriptors, never enough to starve the node's ZeroMQ sockets of descriptors or the process of threads."""

REQUEST_TIMEOUT_S = 5.0
"""How long a connection has, from when it is taken up, to send its whole request; then it is closed. A
deadline for the request, not a timeout per read: a client sending a byte now and then gets no longer."""

ROUTES: dict[str, Route] = {}
"""The process's extra paths (path -> route), served by :func:`serve_metrics` by default; like
prometheus_client's ``REGISTRY``, a process-wide table, so a role adds a path without owning the server."""


def by_label(counts: Mapping[str, float]) -> dict[tuple[str, ...], float]:
    """``counts`` (label value -> count) as one-label readings, from a copy: a read runs on the metrics HTTP
    thread while the loop thread changes ``counts``, and iterating a dict another thread grows raises."""
    return {(label,): float(count) for label, count in dict(counts).items()}


class LiveCounters(Collector):
    """Exposes values read from callables at scrape time.

    ``read`` returns ``{label_values: value}``; ``kind`` is ``counter`` or ``gauge``. It runs on the metrics
    HTTP thread: what the loop thread changes it reads from a copy made in one step (``dict(d)``,
    ``list(d.values())``: one call into C, atomic under the GIL for dicts of plain keys), never by iterating
    the live dict, which raises when the loop thread adds a key meanwhile (the scrape fails).
    """

    def __init__(self, name: str, doc: str, labels: Iterable[str], read: Callable[[], Readings], kind: str = "counter"):
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
    read: Callable[[], Readings],
    *,
    labels: Iterable[str] = (),
    kind: str = "counter",
    registry: CollectorRegistry = REGISTRY,
) -> LiveCounters:
    collector = LiveCounters(name, doc, labels, read, kind)
    registry.register(collector)
    return collector


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per connection, at most :data:`MAX_CONNECTIONS` of them at once."""

    daemon_threads = True
    # Connections the kernel holds until they are accepted: past the default (5) a burst has its SYNs dropped, and
    # a scrape among them waits out a retransmission (a second and more).
    request_queue_size = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # closed at once: no thread, and its descriptor back
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: nothing else gives the slot back
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client too slow (past :data:`REQUEST_TIMEOUT_S`) or gone is not worth a traceback; anything else is."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _DeadlineReader(io.RawIOBase):
    """Reads of ``sock``, each bounded by what is left until ``deadline`` (monotonic); raises TimeoutError past it."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no whole request within {REQUEST_TIMEOUT_S} s")
        self._sock.settimeout(left)  # also bounds the reply's writes, which come after the last read
        return self._sock.recv_into(buffer)


class _QuietHandler(WSGIRequestHandler):
    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain reader: it holds a reference that would keep the socket open past its close
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + REQUEST_TIMEOUT_S))

    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not worth a log line each."""


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _with_routes(metrics_app: WsgiApp, routes: Mapping[str, Route]) -> WsgiApp:
    """A WSGI app answering ``routes``' paths with their JSON and every other path with ``metrics_app``.

    ``routes`` is looked up per request, so a path added after the server started is served.
    """

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        route = routes.get(environ.get("PATH_INFO", ""))
        if route is None:
            return metrics_app(environ, start_response)
        body = json.dumps(route()).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return app


def serve_metrics(
    host: str, port: int, registry: CollectorRegistry = REGISTRY, routes: Mapping[str, Route] = ROUTES
) -> tuple[str, Callable[[], None]]:
    """Start the metrics endpoint in a daemon thread; returns its URL (``.../metrics``) and a function that
    stops it. Raises :class:`~.sockets.AddressInUse` when another process holds ``port``,
    :class:`~.sockets.CannotBind` when ``host`` does not resolve or is not this machine's,
    :class:`~.sockets.BindRefused` when the port is privileged and this user may not bind it.

    Every path answers with ``registry``'s metrics (as prometheus_client's own server does), except the
    paths of ``routes``, which answer with their route's value as JSON. prometheus_client's server polls for
    shutdown every 0.5 s; this one every 50 ms, so a node exits promptly.
    """
    app = _with_routes(make_wsgi_app(registry), routes)
    try:
        server = make_server(host, port, app, _ThreadingWSGIServer, handler_class=_QuietHandler)
    except socket.gaierror as exc:  # a host name that does not resolve
        raise CannotBind(f"http://{host}:{port}", f"{host!r} does not resolve ({exc.strerror})") from None
    except OSError as exc:
        refused = bind_error(f"http://{host}:{port}", exc.errno, exc.strerror or str(exc))
        if refused is not None:
            raise refused from None
        raise
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                              name="metrics")
    thread.start()
    url = f"http://{host}:{server.server_port}/metrics"

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return url, stop
