"""One thread for user code that may block, so the node loop keeps serving while it runs.

Handlers and timers run on the loop thread and must not block for long, yet some roles call user code that
may compute for seconds (a generation, a score). They hand it to an :class:`Offload`: jobs run one at a
time on its own thread, urgent ones before the others, and each job's outcome is handed back to the loop
thread (``runtime.call_soon``), where the role answers its deferred request or publishes. Jobs of one
Offload never overlap, so they may share state (a model and the weights copied into it) without a lock.

Whatever a job raises ends that job only: an ``Exception`` is its outcome, and a ``BaseException`` that is no
``Exception`` (user code's ``sys.exit()``, a ``KeyboardInterrupt`` it raises itself: no signal reaches this
thread, Python delivers them to the main thread) becomes a :class:`JobAborted`. Let through, it would end the
thread in silence (``SystemExit``) or with a traceback on stderr, and every job after it would wait for ever.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from .runtime import NodeRuntime

log = structlog.get_logger(__name__)

T = TypeVar("T")


def describe(exc: BaseException) -> str:
    """``exc`` as ``"Type: message"`` (``"Type"`` without one), for a reply or a log line; never raises, though
    user code's exception may have a ``__str__`` that does (its message then reads as unprintable)."""
    name = type(exc).__name__
    try:
        message = str(exc)
    except Exception:  # the exception's own code failed: its type still says what it was
        message = "<its message could not be made: __str__ raised>"
    return f"{name}: {message}" if message else name


class JobAborted(Exception):
    """What a job's ``then`` gets in place of a ``BaseException`` that is no ``Exception`` (``SystemExit``,
    ``KeyboardInterrupt``, ``GeneratorExit``) the job raised: it ended that job, not the process. The original is
    chained (``__cause__``)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the job raised {describe(cause)}")
        self.__cause__ = cause


class Offload:
    """A worker thread for ``runtime``'s blocking jobs, stopped by the runtime's shutdown (a hook added now:
    jobs that use something another hook closes need the Offload made before that something)."""

    def __init__(self, runtime: NodeRuntime, name: str) -> None:
        self.runtime = runtime
        self._urgent: deque[tuple[Callable[[], Any], Callable[[Any], None]]] = deque()
        self._jobs: deque[tuple[Callable[[], Any], Callable[[Any], None]]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-{runtime.node_id}", daemon=True)
        self._thread.start()
        runtime.shutdown_hooks.append(self.close)

    def submit(self, job: Callable[[], T], then: Callable[[T | Exception], None], *, urgent: bool = False) -> None:
        """Run ``job()`` on the offload thread once the jobs queued before it ran (``urgent``: once the urgent
        ones queued before it ran, ahead of every other); then ``then(result)`` on the loop thread, or
        ``then(exception)`` when the job raised (a :class:`JobAborted` for what is no ``Exception``). After
        :meth:`close`, or when the loop ended first, ``then`` is never called."""
        with self._cond:
            if self._closed:
                return
            (self._urgent if urgent else self._jobs).append((job, then))
            self._cond.notify()

    def close(self) -> None:
        """Drop the queued jobs, let the running one finish, stop the thread (loop thread, at shutdown)."""
        with self._cond:
            self._closed = True
            self._urgent.clear()
            self._jobs.clear()
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._urgent or self._jobs or self._closed)
                if self._closed:
                    return
                job, then = (self._urgent or self._jobs).popleft()
            try:
                outcome = job()
            except Exception as exc:  # handed to ``then``: the role decides what a failure means
                outcome = exc
            except BaseException as exc:  # raised by the job's own code (see the module's docstring)
                outcome = JobAborted(exc)
            self.runtime.call_soon(lambda then=then, outcome=outcome: then(outcome))
