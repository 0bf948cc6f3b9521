"""The rollout worker's weight refreshes, against a fake PS client and offload queue (no processes): a bump
that arrives while a refresh is queued or running is not lost, a manager that does not answer costs the
queued generations one refresh attempt per tick, not one each, and a new lineage's version numbered as the
retired one the worker serves is pulled, told apart by its manifest digest. And its queue of generations,
against its real socket: one whose sender's deadline passed while queued is dropped unstarted."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from polling import wait_for
from refbus.bus.broker import Broker, BrokerSettings
from refbus.bus.reqrep import HandlerError, RequestTimeout
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.bus.sockets import make_socket, recv_frames, send_frames
from refbus.nodes.config import Config
from refbus.nodes.rl import rollout as rollout_module
from refbus.nodes.rl.rollout import REFRESH_EVERY_S, RolloutWorker
from refbus.nodes.toy.policy import generate as toy_generate
from refbus.protocol.envelope import Header, Message, WireCodec
from refbus.protocol.messages import Error, Generate, Ok, VersionBump
from refbus.protocol.messages_ps import PsState, PsStatus
from structlog.testing import capture_logs

WAIT_S = 10.0


class FakeOffload:
    """Jobs are kept, not run: the test runs them (and hands back their outcome) when it wants."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Callable[[], Any], Callable[[Any], None], bool]] = []

    def submit(self, job: Callable[[], Any], done: Callable[[Any], None], urgent: bool = False) -> None:
        self.jobs.append((job, done, urgent))

    def run_next(self) -> None:
        job, done, _ = self.jobs.pop(0)
        try:
            outcome = job()
        except Exception as exc:
            outcome = exc
        done(outcome)


class SilentManager:
    """A PS client whose manager never answers (each status() is one whole retry schedule, here instant)."""

    def __init__(self) -> None:
        self.asked = 0

    def status(self) -> Any:
        self.asked += 1
        raise RequestTimeout("ps-status: no reply from the manager")

    def pull(self, **kwargs: Any) -> Any:
        raise AssertionError("nothing to pull from a manager that does not answer")


class FakeCalls:
    """The worker runtime's asynchronous requests: a poll is answered at once from the fake PS client's status()
    (its exception when it raises), or, ``silent``, kept unanswered."""

    def __init__(self, ps: Any, *, silent: bool = False) -> None:
        self.ps = ps
        self.silent = silent
        self.pending: list[Callable[[Any], None]] = []

    def request(self, endpoint: str, body: Any, on_done: Callable[[Any], None], **kwargs: Any) -> str:
        assert isinstance(body, PsStatus)
        if self.silent:
            self.pending.append(on_done)
            return "poll"
        try:
            state = self.ps.status()
        except RequestTimeout as exc:
            on_done(exc)
        else:
            on_done(Message(state.kind, Header((1, 0), "m-1", "ps-manager", 0, 0.0), state))
        return "poll"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class LineageManager:
    """A PS client whose manager has committed ``latest`` (version, manifest digest); a pull returns it."""

    def __init__(self, version: int, digest: str, *, sends_digest: bool = True) -> None:
        self.latest = (version, digest)
        self.sends_digest = sends_digest  # False: a manager from before ps-state carried the digest
        self.pulled: list[tuple[int, str]] = []

    def status(self) -> PsState:
        version, digest = self.latest
        return PsState(latest=version, retained=[version], pinned={}, pending=[], leases=0, trainer_version=version,
                       workers=[], latest_digest=digest if self.sends_digest else "")

    def pull(self, **kwargs: Any) -> Any:
        self.pulled.append(self.latest)
        return SimpleNamespace(version=self.latest[0], digest=self.latest[1])


def _worker(version: int, digest: str = "", ps: Any = None, *,
            silent: bool = False) -> tuple[RolloutWorker, FakeOffload, Any, Clock]:
    """A worker serving ``version``; ``silent``: its tick's poll is never answered."""
    worker = RolloutWorker.__new__(RolloutWorker)
    offload, clock = FakeOffload(), Clock()
    ps = SilentManager() if ps is None else ps
    worker.offload, worker.ps, worker._clock = offload, ps, clock  # type: ignore[assignment]
    worker.runtime, worker.manager = SimpleNamespace(calls=FakeCalls(ps, silent=silent)), "tcp://manager"  # type: ignore[assignment]
    worker.model = SimpleNamespace(state_dict=dict)  # type: ignore[assignment]
    worker.version, worker.digest, worker.torn, worker.torn_pulls, worker.generated = version, digest, None, 0, 0
    worker._refresh_queued, worker._refresh_missed, worker._unanswered_at = False, False, -math.inf
    return worker, offload, ps, clock


def _bump(version: int, digest: str = "") -> Any:
    return SimpleNamespace(body=VersionBump(version, 0, digest))


def test_a_bump_during_a_refresh_queues_another_refresh_when_it_ends() -> None:
    worker, offload, _, _ = _worker(version=3)
    worker._on_bump(_bump(4))
    assert len(offload.jobs) == 1 and offload.jobs[0][2]  # urgent: ahead of the generations
    worker._on_bump(_bump(5))  # while that refresh is queued (or running): it may miss version 5
    worker._want_refresh()  # a tick meanwhile adds nothing
    assert len(offload.jobs) == 1
    offload.run_next()
    assert len(offload.jobs) == 1, "the bump that came during the refresh was dropped"
    offload.run_next()
    assert offload.jobs == []  # one more, not a loop


def test_a_tick_during_a_refresh_queues_nothing_more() -> None:
    worker, offload, _, _ = _worker(version=3, ps=LineageManager(4, "4"))
    worker._want_refresh()  # its poll finds version 4: a refresh is queued
    worker._want_refresh()
    offload.run_next()
    assert offload.jobs == []


def test_a_tick_whose_poll_the_manager_does_not_answer_holds_no_generation_up() -> None:
    """With whole weights, the tick's poll goes from the loop thread: the offload thread, which generates, gets
    nothing to wait on while the manager is silent; a bump meanwhile is remembered, and a poll that failed
    leaves the next tick free to ask again."""
    worker, offload, _, _ = _worker(version=3, silent=True)
    calls = worker.runtime.calls
    worker._want_refresh()
    worker._want_refresh()  # the next tick, the first poll still unanswered: not asked twice
    assert offload.jobs == [] and len(calls.pending) == 1
    worker._on_bump(_bump(4))
    calls.pending.pop()(RequestTimeout("ps-status: no reply"))
    assert len(offload.jobs) == 1 and offload.jobs[0][2]  # the bump's refresh, ahead of the generations
    offload.run_next()  # unanswered too
    worker._want_refresh()
    assert len(calls.pending) == 1 and offload.jobs == []


def test_a_poll_answered_with_something_else_is_said_and_the_next_tick_asks_again() -> None:
    """Garbage for the poll: the manager's endpoint answers ``ps-status`` with a body of another kind. Before,
    the poll ended in silence, as if the version served were the latest; now it is logged, nothing is pulled,
    and the next tick polls again."""
    worker, offload, _, _ = _worker(version=3, silent=True)
    calls = worker.runtime.calls
    worker._want_refresh()
    with capture_logs() as logs:
        calls.pending.pop()(Message(Ok.kind, Header((1, 0), "m-1", "ps-manager", 0, 0.0), Ok()))
    assert [(e["event"], e["error"]) for e in logs] == [("weights.poll_failed",
                                                         "tcp://manager answered ps-status with ok")]
    assert offload.jobs == []
    worker._want_refresh()
    assert len(calls.pending) == 1


def test_a_silent_manager_costs_queued_generations_one_refresh_per_tick() -> None:
    worker, _, ps, clock = _worker(version=-1)
    ask = Generate(prompt=[1, 2], max_new_tokens=2)
    for _ in range(5):  # generations queued while the worker has no weights and the manager is silent
        with pytest.raises(HandlerError) as refused:
            worker._generate(ask, worker._clock())
        assert refused.value.code == "no-weights"
    assert ps.asked == 1
    clock.now += REFRESH_EVERY_S  # a tick later: one more attempt
    for _ in range(3):
        with pytest.raises(HandlerError):
            worker._generate(ask, worker._clock())
    assert ps.asked == 2


def test_a_bump_of_the_version_served_from_a_new_lineage_is_pulled() -> None:
    """The worker serves version 5 of the old lineage and missed everything since the trainer world restarted
    at 3: the new lineage's 5 has the number it serves and another digest, and is pulled; its repeat is not."""
    ps = LineageManager(5, "new-5")
    worker, offload, _, _ = _worker(version=5, digest="old-5", ps=ps)
    worker._on_bump(_bump(5, "new-5"))
    assert len(offload.jobs) == 1, "a new lineage's version of the number served was taken for the one served"
    offload.run_next()
    assert ps.pulled == [(5, "new-5")] and (worker.version, worker.digest) == (5, "new-5")
    worker._on_bump(_bump(5, "new-5"))
    assert offload.jobs == []


def test_a_poll_that_finds_the_version_served_from_a_new_lineage_pulls_it() -> None:
    """The same, with the bump missed too: the once-a-tick poll reads the latest digest and pulls it."""
    ps = LineageManager(5, "new-5")
    worker, offload, _, _ = _worker(version=5, digest="old-5", ps=ps)
    worker._want_refresh()
    offload.run_next()
    assert ps.pulled == [(5, "new-5")] and (worker.version, worker.digest) == (5, "new-5")
    worker._want_refresh()
    assert offload.jobs == [] and ps.pulled == [(5, "new-5")]  # nothing new: no refresh, no pull


def test_a_manager_that_sends_no_digest_is_polled_by_number_alone() -> None:
    ps = LineageManager(5, "new-5", sends_digest=False)
    worker, offload, _, _ = _worker(version=5, digest="old-5", ps=ps)
    worker._want_refresh()
    assert offload.jobs == [] and ps.pulled == []


def test_generations_whose_sender_gave_up_are_dropped_unstarted() -> None:
    """Before, a worker slower than its requests generated every one it had queued, long after the env server
    had given up on it (``generate`` has no retry: its reply was a stray). Against a real worker's socket: while
    one generation holds the model, three requests wait past the deadline they name and are answered
    ``expired``, unstarted; one naming no deadline (an older sender) is generated; a deadline that is no
    duration (negative, NaN) is refused ``schema`` at once, the worker going on."""
    loopback = "tcp://127.0.0.1:0"
    bus = NodeRuntime("bus", RuntimeSettings(node_id="bus", metrics_port=-1), register=False)
    Broker(bus, BrokerSettings(control=loopback, events_in=loopback, events_out=loopback))
    bus.start_background()
    runtime = NodeRuntime("rollout", RuntimeSettings(bus=bus.endpoints["control"], node_id="rollout-x",
                                                     metrics_port=-1))
    worker = RolloutWorker(runtime, Config())
    clock, entered, release = Clock(), threading.Event(), threading.Event()
    worker.refresh, worker._clock, worker.version = lambda: None, clock, 0  # type: ignore[method-assign]

    def held_first(*args: Any, **kwargs: Any) -> Any:
        if not entered.is_set():
            entered.set()
            assert release.wait(WAIT_S), "the test never released the first generation"
        return toy_generate(*args, **kwargs)

    worker.generate = held_first
    ctx = zmq.Context()
    sock = None
    try:
        runtime.start_background()
        sock = make_socket(ctx, zmq.DEALER, connect=runtime.endpoints["generate"])
        codec = WireCodec("env-x")
        sent: dict[str, str] = {}

        def ask(name: str, deadline_s: float) -> None:
            msg_id = codec.new_id()
            sent[msg_id] = name
            send_frames(sock, codec.encode(Generate(prompt=[1, 2], max_new_tokens=2, deadline_s=deadline_s),
                                           msg_id=msg_id))

        ask("first", 1.0)
        assert entered.wait(WAIT_S), "the first generation never started"
        for name, deadline_s in (("late-0", 1.0), ("late-1", 1.0), ("late-2", 1.0), ("no-deadline", 0.0),
                                 ("negative", -1.0), ("nan", math.nan)):
            ask(name, deadline_s)
        answers: dict[str, str] = {}

        def read() -> None:
            while sock.poll(0):
                reply = codec.decode(recv_frames(sock))
                body = reply.body
                answers[sent[reply.header.re]] = body.code if isinstance(body, Error) else body.kind

        # Refused as they arrive, after the worker's loop took every request sent before them.
        wait_for(lambda: read() or {"negative", "nan"} <= answers.keys(), WAIT_S, "the garbage refused")
        clock.now += 1.0  # the senders' deadlines pass while the first generation holds the model
        release.set()
        wait_for(lambda: read() or len(answers) == len(sent), WAIT_S, "every request answered")
        assert answers == {"first": "generated", "late-0": "expired", "late-1": "expired", "late-2": "expired",
                           "no-deadline": "generated", "negative": "schema", "nan": "schema"}
        assert (worker.generated, worker.expired) == (2, 3)
    finally:
        release.set()
        if sock is not None:
            sock.close(linger=0)
        runtime.join(WAIT_S)
        bus.join(WAIT_S)
        ctx.term()


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("its message cannot be made")


def test_a_generation_whose_exception_cannot_be_printed_is_answered_internal_naming_its_type() -> None:
    """The policy raised an exception whose ``__str__`` itself raises: the ``generate`` is still answered
    (``internal``, naming the exception's type). Before, making the reply raised on the loop thread and the
    request went unanswered until its sender's deadline."""
    reply = rollout_module._reply(_Unprintable())
    assert isinstance(reply, Error) and reply.code == "internal" and reply.message.startswith("_Unprintable: ")
    assert rollout_module._reply(HandlerError("no-weights", "none yet")) == Error("no-weights", "none yet",
                                                                                  Generate.kind)
