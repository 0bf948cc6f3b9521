"""Running episodes (``run`` → ``generate``) on a real broker: an in-process env server with its
:class:`EpisodeRunner`, and in-process rollout nodes whose ``generate`` answers the test controls. Each way a
generation ends reaches the orchestrator's ``run`` once: generated and kept, the rollout worker leaving the
registry (its runs fail at once, not at the deadline), no answer by ``generate_timeout_s``, and a
generation the score function refuses; and a keep over the store's budget waits for room. A broker stopped
(SIGSTOP) mid-run: the registry refresh fails at its deadline without stalling the loop, the known rollout
workers are kept, and runs are still served. An env-server process whose score function misbehaves
(``tests/misbehaving_entry_points.py``) fails that run with a reason and scores the next."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import misbehaving_entry_points as misbehaving
import numpy as np
import pytest
import zmq
from branches import random_arrays
from conftest import FAST_LIVENESS
from polling import wait_for
from refbus.bus.reqrep import Client, RemoteError, RetryPolicy, Server
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.launch import NodeProcess
from refbus.nodes.payload.charges import blob_charge
from refbus.nodes.payload.env_server import EnvServer
from refbus.nodes.payload.episodes import EpisodeRunner
from refbus.nodes.payload.keeper import pack_branches
from refbus.nodes.settings import EnvServerSettings
from refbus.protocol.envelope import Message, WireCodec
from refbus.protocol.messages import Accounted, Accounts, Generate, Generated, Ok, Run

TESTS = Path(__file__).parent
GENERATE_TIMEOUT_S = 3.0
START_S = 30.0
REFRESH_S = 0.1
PATIENT = RetryPolicy(timeout_s=10 * GENERATE_TIMEOUT_S, attempts=1)
LOOKUP = RetryPolicy(timeout_s=0.5, attempts=2, backoff=1.0)  # the env server's requests to the broker


class Rollout:
    """An in-process rollout node (loop in a thread) that holds every ``generate`` until told to answer."""

    def __init__(self, control: str, node_id: str) -> None:
        self.runtime = NodeRuntime("rollout", RuntimeSettings(bus=control, node_id=node_id, metrics_port=-1))
        self.server: Server = self.runtime.serve("generate", "tcp://127.0.0.1:0")
        self.held: list[tuple[Any, Generate]] = []
        self.server.on(Generate.kind, self._hold, cached=False)
        self.runtime.start_background()

    def _hold(self, request: Message) -> None:
        assert isinstance(request.body, Generate)
        self.held.append((self.server.pending, request.body))

    def answer(self, index: int, tokens: list[int] | None = None, arrays_for: int | None = None) -> None:
        """Answer generation ``index`` with the toy task's right answer, or with ``tokens`` (as a rollout function
        may return them, right or not) and arrays covering ``arrays_for`` tokens (default: as many as ``tokens``)."""
        pending, ask = self.held[index]
        if tokens is None:
            tokens = [*ask.prompt, ask.prompt[0] + 1]  # the toy task's right answer
        count = len(tokens) if arrays_for is None else arrays_for
        arrays = random_arrays(count, seed=index, layers=4, top_k=2, k=3, max_count=3, routing_dtype=np.uint8)
        self.runtime.call_soon(lambda: self.server.answer(pending, Generated(tokens, 0, arrays)))


@pytest.fixture
def env_server(bus: tuple[NodeProcess, str]) -> Iterator[tuple[EpisodeRunner, str]]:
    runtime = NodeRuntime("env-server", RuntimeSettings(bus=bus[1], node_id="env-episodes", metrics_port=-1))
    settings = EnvServerSettings(source="episodes", generate_timeout_s=GENERATE_TIMEOUT_S)
    env = EnvServer(runtime, settings)
    runner = EpisodeRunner(runtime, env, settings, rollout_refresh_s=REFRESH_S)
    runtime.start_background()
    yield runner, runtime.endpoints["blobs"]
    runtime.join(timeout=10 * GENERATE_TIMEOUT_S)


def run_async(client: Client, episode: str, prompt: int | list[int] = 3) -> str:
    return client.send(Run(episode_id=episode, group="g", prompt=prompt if isinstance(prompt, list) else [prompt]))


def answer_to(client: Client, msg_id: str) -> Message:
    reply = client.recv(int(10 * GENERATE_TIMEOUT_S * 1000))
    assert reply is not None and reply.header.re == msg_id, reply
    return reply


def test_each_way_a_generation_ends_answers_its_run_once(bus: tuple[NodeProcess, str], env_server: Any) -> None:
    runner, endpoint = env_server
    orchestrator = Client(runner.runtime.ctx, endpoint, WireCodec("orchestrator"), policy=PATIENT)
    first = Rollout(bus[1], "rollout-first")
    try:
        wait_for(lambda: runner.rollouts, 10 * REFRESH_S + 5, "the rollout in the registry")
        generated, stranded = run_async(orchestrator, "ep-0"), run_async(orchestrator, "ep-1")
        wait_for(lambda: len(first.held) == 2, 5, "both generations at the rollout")
        # Each names how long the env server waits for it: the worker drops it unstarted after that.
        assert [ask.deadline_s for _, ask in first.held] == [GENERATE_TIMEOUT_S] * 2
        first.answer(0)
        reply = answer_to(orchestrator, generated)
        assert isinstance(reply.body, Ok) and reply.body.detail.startswith("reward=")
        assert runner.env_server.stats().kept_total == 1

        unscorable = run_async(orchestrator, "ep-bad", prompt=99)  # the score function refuses this prompt
        wait_for(lambda: len(first.held) == 3, 5, "the third generation at the rollout")
        first.answer(2)
        reply = answer_to(orchestrator, unscorable)
        assert reply.kind == "error" and reply.body.code == "score-failed", reply.body
        assert runner.env_server.stats().kept_total == 1

        def broken_keep(*_: Any, **__: Any) -> None:
            raise RuntimeError("the store's file system failed")

        runner.env_server.keep = broken_keep  # a keep failing otherwise than KeepError: the run is still answered
        failing = run_async(orchestrator, "ep-io")
        wait_for(lambda: len(first.held) == 4, 5, "the fourth generation at the rollout")
        first.answer(3)
        reply = answer_to(orchestrator, failing)
        assert reply.kind == "error" and reply.body.code == "internal" and "file system" in reply.body.message
        del runner.env_server.keep

        first.runtime.join(timeout=5)  # bye: the registry drops it, its generation will never come
        reply = answer_to(orchestrator, stranded)
        assert reply.kind == "error" and reply.body.code == "rollout-down", reply.body

        silent = Rollout(bus[1], "rollout-silent")
        try:
            wait_for(lambda: runner.rollouts == {silent.runtime.endpoints["generate"]}, 10 * REFRESH_S + 5,
                     "only the silent rollout in the registry")
            unanswered = run_async(orchestrator, "ep-2")
            reply = answer_to(orchestrator, unanswered)
            assert reply.kind == "error" and reply.body.code == "timeout", reply.body
            assert len(silent.held) == 1  # sent once: a generation is never asked for twice
        finally:
            silent.runtime.join(timeout=5)
        assert (runner.finished, runner.failed) == (1, 4)
        with pytest.raises(RemoteError, match="no-rollout"):
            wait_for(lambda: not runner.rollouts, 10 * REFRESH_S + 5, "the registry emptied")
            orchestrator.request(Run(episode_id="ep-3", group="g", prompt=[3]))
    finally:
        first.runtime.join(timeout=5)
        orchestrator.close()


def test_a_score_that_is_not_a_finite_number_fails_its_run(bus: tuple[NodeProcess, str], env_server: Any) -> None:
    """Regression: a NaN reward was kept and published; one such reward made its group's advantages NaN and
    the trained weights with them. Now the run fails ``score-failed`` and nothing is kept."""
    runner, endpoint = env_server
    runner.score = lambda prompt, completion: float("nan")  # or an infinity: the same check
    orchestrator = Client(runner.runtime.ctx, endpoint, WireCodec("orchestrator"), policy=PATIENT)
    rollout = Rollout(bus[1], "rollout-nan")
    try:
        wait_for(lambda: runner.rollouts, 10 * REFRESH_S + 5, "the rollout in the registry")
        sent = run_async(orchestrator, "ep-nan")
        wait_for(lambda: len(rollout.held) == 1, 5, "the generation at the rollout")
        rollout.answer(0)
        reply = answer_to(orchestrator, sent)
        assert reply.kind == "error" and reply.body.code == "score-failed", reply.body
        assert "not a finite number" in reply.body.message
        assert (runner.finished, runner.failed, runner.env_server.stats().kept_total) == (0, 1, 0)
    finally:
        rollout.runtime.join(timeout=5)
        orchestrator.close()


def test_a_run_sent_again_while_it_runs_is_generated_scored_kept_and_answered_once(
        bus: tuple[NodeProcess, str], env_server: Any) -> None:
    """Regression: a run's request sent again while unanswered (a client's retry: a deferred reply is never
    cached, so the server runs it again) generated twice; a second generation arriving while the first was
    scored replaced it, and the first's score was kept with the second's tokens (a wrong answer kept with the
    right one's reward). Now the repeat of a run still running is ignored: its one answer comes when it ends."""
    runner, endpoint = env_server
    kept: list[dict[str, Any]] = []
    keep = runner.env_server.keep

    def recorded_keep(episode_id: str, branches: Any, **kwargs: Any) -> Any:
        kept.append(kwargs["info"])
        return keep(episode_id, branches, **kwargs)

    runner.env_server.keep = recorded_keep
    orchestrator = Client(runner.runtime.ctx, endpoint, WireCodec("orchestrator"), policy=PATIENT)
    rollout = Rollout(bus[1], "rollout-twice")
    try:
        wait_for(lambda: runner.rollouts, 10 * REFRESH_S + 5, "the rollout in the registry")
        sent, frames = orchestrator.encode(Run(episode_id="ep-twice", group="g", prompt=[3]))
        assert orchestrator.try_send(frames, Run.kind) and orchestrator.try_send(frames, Run.kind)  # the same twice
        after = run_async(orchestrator, "ep-after", prompt=5)  # served after the repeat: one connection, in order
        wait_for(lambda: len(rollout.held) >= 2, 5, "two generations at the rollout")
        assert [ask.prompt for _, ask in rollout.held] == [[3], [5]]
        rollout.answer(0)
        rollout.answer(1)
        for msg_id in (sent, after):  # scored in turn
            reply = answer_to(orchestrator, msg_id)
            assert isinstance(reply.body, Ok), reply.body
        assert orchestrator.recv(int(GENERATE_TIMEOUT_S * 1000)) is None  # answered once (its deadline passed)
        assert sorted((info["samples"][0]["input_ids"], info["reward"]) for info in kept) == [([3, 4], 1.0),
                                                                                               ([5, 6], 1.0)]
        assert len(rollout.held) == 2
    finally:
        rollout.runtime.join(timeout=5)
        orchestrator.close()


def test_a_keep_over_budget_waits_for_room_instead_of_wasting_its_generation(bus: tuple[NodeProcess, str]) -> None:
    """Backpressure on the run path: the second episode does not fit until the first is discarded; its run
    waits (retrying the keep) and succeeds. A third that never gets room fails at ``generate_timeout_s``."""
    sizes = [sum(blob_charge(p.nbytes) for p in pack_branches([random_arrays(2, seed=i, layers=4, top_k=2, k=3,
                                                                             max_count=3, routing_dtype=np.uint8)]))
             for i in range(3)]
    # What Rollout.answer(i) generates, one at a time (each episode's small info is charged on top).
    budget = min(sizes[0] + sizes[1], sizes[1] + sizes[2]) - 1
    runtime = NodeRuntime("env-server", RuntimeSettings(bus=bus[1], node_id="env-small", metrics_port=-1))
    settings = EnvServerSettings(source="small", generate_timeout_s=GENERATE_TIMEOUT_S, budget_bytes=budget,
                                 high_water=0.4)
    env = EnvServer(runtime, settings)
    runner = EpisodeRunner(runtime, env, settings, rollout_refresh_s=REFRESH_S)
    runtime.start_background()
    orchestrator = Client(runtime.ctx, runtime.endpoints["blobs"], WireCodec("orchestrator"), policy=PATIENT)
    rollout = Rollout(bus[1], "rollout-bp")
    try:
        wait_for(lambda: runner.rollouts, 10 * REFRESH_S + 5, "the rollout in the registry")
        first = run_async(orchestrator, "ep-0")
        wait_for(lambda: len(rollout.held) == 1, 5, "the first generation at the rollout")
        rollout.answer(0)
        assert isinstance(answer_to(orchestrator, first).body, Ok)
        assert env.pressure().full and env.status()["full"] == 1.0  # about half the budget: above high water

        second = run_async(orchestrator, "ep-1")
        wait_for(lambda: len(rollout.held) == 2, 5, "the second generation at the rollout")
        rollout.answer(1)
        wait_for(lambda: runner.keep_retries >= 2, GENERATE_TIMEOUT_S, "the second keep waiting for room")
        assert env.discard("ep-0")  # its holder is done with it: room comes back
        assert isinstance(answer_to(orchestrator, second).body, Ok)

        third = run_async(orchestrator, "ep-2")  # never gets room: ep-1 stays held
        wait_for(lambda: len(rollout.held) == 3, 5, "the third generation at the rollout")
        rollout.answer(2)
        reply = answer_to(orchestrator, third)
        assert reply.kind == "error" and reply.body.code == "over-budget", reply.body
        assert (runner.finished, runner.failed, env.stats().kept_total) == (2, 1, 2)
    finally:
        rollout.runtime.join(timeout=5)
        orchestrator.close()
        runtime.join(timeout=10 * GENERATE_TIMEOUT_S)


def test_a_broker_that_stops_answering_never_stalls_the_env_server(bus: tuple[NodeProcess, str]) -> None:
    broker, control = bus
    runtime = NodeRuntime("env-server", RuntimeSettings(bus=control, node_id="env-cutoff", metrics_port=-1,
                                                        retry=LOOKUP))
    settings = EnvServerSettings(source="cutoff", generate_timeout_s=GENERATE_TIMEOUT_S)
    env = EnvServer(runtime, settings)
    runner = EpisodeRunner(runtime, env, settings, rollout_refresh_s=REFRESH_S)
    failed_lookups: list[str] = []
    lookup_async = runtime.lookup_async

    def counted(role: str, on_done: Any, **kwargs: Any) -> None:  # records the lookups that came back empty
        def done(nodes: Any) -> None:
            if nodes is None:
                failed_lookups.append(role)
            on_done(nodes)
        lookup_async(role, done, **kwargs)

    runtime.lookup_async = counted  # type: ignore[method-assign]
    runtime.start_background()
    orchestrator = Client(runtime.ctx, runtime.endpoints["blobs"], WireCodec("orchestrator"), policy=PATIENT)
    rollout = Rollout(control, "rollout-cutoff")
    stopped = False
    try:
        wait_for(lambda: runner.rollouts, 10 * REFRESH_S + 5, "the rollout in the registry")
        known = set(runner.rollouts)
        os.kill(broker.pid, signal.SIGSTOP)  # cut off: it reads nothing and answers nothing
        stopped = True
        wait_for(lambda: "rollout" in failed_lookups, 10 * LOOKUP.deadline_s, "a registry refresh to fail")
        assert runner.rollouts == known, "a refresh that failed must keep the rollout workers it knew"
        # The loop serves while refreshes go unanswered: a run goes to the known worker and is answered.
        served = run_async(orchestrator, "ep-cutoff")
        wait_for(lambda: len(rollout.held) == 1, 10 * LOOKUP.deadline_s, "the generation at the rollout")
        rollout.answer(0)
        reply = answer_to(orchestrator, served)
        assert isinstance(reply.body, Ok), reply.body
        assert runner.env_server.stats().kept_total == 1
        assert len(failed_lookups) >= 1 and runner.rollouts == known
    finally:
        if stopped:
            os.kill(broker.pid, signal.SIGCONT)
        rollout.runtime.join(timeout=5)
        orchestrator.close()
        runtime.join(timeout=10 * GENERATE_TIMEOUT_S)


def start_env_process(bus: tuple[NodeProcess, str], spawn: Any, tmp_path: Path, name: str) -> NodeProcess:
    """A ready env-server process (node id ``env-user-code``) scoring with ``misbehaving_entry_points:score``, a
    run's deadline GENERATE_TIMEOUT_S; its hung scores return once the file ``tmp_path / "release"`` exists.
    The caller puts tests/ on the ``PYTHONPATH``."""
    env = spawn(["node", "env-server", "--bus-control", bus[1], "--node-id", "env-user-code", *FAST_LIVENESS,
                 "--env-server-score", "misbehaving_entry_points:score",
                 "--env-server-generate-timeout-s", str(GENERATE_TIMEOUT_S)], name,
                env={misbehaving.RELEASE_ENV: str(tmp_path / "release")})
    env.wait_ready(START_S)
    return env


@pytest.fixture
def env_process(bus: tuple[NodeProcess, str], spawn: Any, monkeypatch: pytest.MonkeyPatch,
                tmp_path: Path) -> NodeProcess:
    """A ready env-server process whose score misbehaves (:func:`start_env_process`)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    return start_env_process(bus, spawn, tmp_path, "env-user-code")


def run_generated(client: Client, rollout: Rollout, episode: str, prompt: int | list[int], **answer: Any) -> str:
    """Send a run of ``prompt`` and have ``rollout`` answer its generation (``answer``: what :meth:`Rollout.answer`
    answers instead of the right one); the run's message id."""
    index = len(rollout.held)  # before the run is sent: its generation may reach the rollout at once
    sent = run_async(client, episode, prompt)
    wait_for(lambda: len(rollout.held) > index, START_S, f"the generation of {episode} at the rollout")
    rollout.answer(index, **answer)
    return sent


@pytest.mark.parametrize("prompt,raised", [(misbehaving.EXITS, "SystemExit: the score gave up"),
                                           (misbehaving.INTERRUPTS, "KeyboardInterrupt")])
def test_a_score_that_raises_what_is_no_exception_fails_only_its_run(bus: tuple[NodeProcess, str],
                                                                      env_process: NodeProcess, prompt: int,
                                                                      raised: str) -> None:
    """Regression: a score calling ``sys.exit()`` (or raising ``KeyboardInterrupt``) ended the env server's
    scoring thread, silently for ``SystemExit``: that run and every later one went unanswered, each waiting
    out the orchestrator's deadline, on an env server that looked healthy. Now the run fails ``score-failed``
    naming what was raised, and the next run is scored and kept."""
    ctx = zmq.Context()
    orchestrator = Client(ctx, env_process.info["endpoints"]["blobs"], WireCodec("orchestrator"), policy=PATIENT)
    rollout = Rollout(bus[1], "rollout-user-code")
    try:
        reply = answer_to(orchestrator, run_generated(orchestrator, rollout, "ep-raises", prompt))
        assert reply.kind == "error" and reply.body.code == "score-failed", reply.body
        assert raised in reply.body.message
        reply = answer_to(orchestrator, run_generated(orchestrator, rollout, "ep-next", 3))
        assert isinstance(reply.body, Ok), reply.body
        assert env_process.proc.poll() is None
    finally:
        rollout.runtime.join(timeout=5)
        orchestrator.close()
        ctx.term()


def test_a_score_whose_exception_has_no_message_fails_its_run(bus: tuple[NodeProcess, str],
                                                              env_process: NodeProcess) -> None:
    """Regression: a score raising an exception whose ``__str__`` raised too made the env server's answer
    raise while it was written: the run went unanswered until the orchestrator's deadline, with no reason it
    could log. Now it fails ``score-failed`` naming the exception's type, and the next run is scored."""
    ctx = zmq.Context()
    orchestrator = Client(ctx, env_process.info["endpoints"]["blobs"], WireCodec("orchestrator"), policy=PATIENT)
    rollout = Rollout(bus[1], "rollout-unprintable")
    try:
        reply = answer_to(orchestrator, run_generated(orchestrator, rollout, "ep-unprintable", misbehaving.UNPRINTABLE))
        assert reply.kind == "error" and reply.body.code == "score-failed", reply.body
        assert "Unprintable: <its message could not be made" in reply.body.message
        reply = answer_to(orchestrator, run_generated(orchestrator, rollout, "ep-next", 3))
        assert isinstance(reply.body, Ok), reply.body
    finally:
        rollout.runtime.join(timeout=5)
        orchestrator.close()
        ctx.term()


def kept_blobs(client: Client) -> int:
    accounted = client.request(Accounts()).body
    assert isinstance(accounted, Accounted), accounted
    return accounted.kept


def test_a_hung_score_fails_its_runs_at_their_deadline_and_keeps_nothing_for_them(
        bus: tuple[NodeProcess, str], env_process: NodeProcess, tmp_path: Path) -> None:
    """Regression: a score that did not return left its run unanswered past the env server's deadline
    (``generate_timeout_s``, by which the orchestrator expects an answer), and the runs queued behind it too;
    once it returned, the episode was kept and published for a run the orchestrator had counted failed. Now
    each run fails ``timeout`` at its deadline while the env server goes on serving, a score still queued then
    is never computed, the hung one's late result keeps nothing, and the next run is scored and kept."""
    ctx = zmq.Context()
    orchestrator = Client(ctx, env_process.info["endpoints"]["blobs"], WireCodec("orchestrator"), policy=PATIENT)
    rollout = Rollout(bus[1], "rollout-hung")
    try:
        hung = run_generated(orchestrator, rollout, "ep-hung", misbehaving.HANGS)
        queued = run_generated(orchestrator, rollout, "ep-queued", 3)  # scored after the hung one: never in time
        assert kept_blobs(orchestrator) == 0  # the loop serves while the score hangs
        for sent in (hung, queued):
            reply = answer_to(orchestrator, sent)
            assert reply.kind == "error" and reply.body.code == "timeout", reply.body
            assert "not scored within" in reply.body.message
        (tmp_path / "release").touch()
        reply = answer_to(orchestrator, run_generated(orchestrator, rollout, "ep-next", 3))
        assert isinstance(reply.body, Ok), reply.body  # scored after the late results, in order
        assert kept_blobs(orchestrator) == 1  # ep-next's only
        said = env_process.log_path.read_text()
        assert said.count('"run.scored_late"') == 1 and '"episode_id": "ep-hung"' in said  # ep-queued unscored
    finally:
        rollout.runtime.join(timeout=5)
        orchestrator.close()
        ctx.term()


def test_an_env_server_killed_while_a_score_hangs_restarts_with_nothing_of_that_run(
        bus: tuple[NodeProcess, str], env_process: NodeProcess, spawn: Any, tmp_path: Path) -> None:
    """SIGKILL mid-run: the process dies with a score hung, its run unanswered and its generation held.
    Restarted under the same node id (its durable store re-adopted), it holds nothing of that run, and serves
    runs."""
    ctx = zmq.Context()
    orchestrator = Client(ctx, env_process.info["endpoints"]["blobs"], WireCodec("orchestrator"), policy=PATIENT)
    rollout = Rollout(bus[1], "rollout-killed")
    try:
        run_generated(orchestrator, rollout, "ep-hung", misbehaving.HANGS)
        wait_for((tmp_path / f"release{misbehaving.HUNG_SUFFIX}").exists, GENERATE_TIMEOUT_S, "the score to hang")
        os.kill(env_process.pid, signal.SIGKILL)
        assert env_process.proc.wait(timeout=START_S) == -signal.SIGKILL
    finally:
        orchestrator.close()
    restarted = start_env_process(bus, spawn, tmp_path, "env-user-code-again")
    orchestrator = Client(ctx, restarted.info["endpoints"]["blobs"], WireCodec("orchestrator"), policy=PATIENT)
    try:
        assert kept_blobs(orchestrator) == 0
        (tmp_path / "release").touch()
        reply = answer_to(orchestrator, run_generated(orchestrator, rollout, "ep-after", 3))
        assert isinstance(reply.body, Ok), reply.body
        assert kept_blobs(orchestrator) == 1
    finally:
        rollout.runtime.join(timeout=5)
        orchestrator.close()
        ctx.term()


def fails_alone(client: Client, rollout: Rollout, env: NodeProcess, episode: str, prompt: int | list[int], code: str,
                said: str, **answer: Any) -> None:
    """A run of ``prompt`` whose generation ``rollout`` answers (``answer``: see :meth:`Rollout.answer`) fails
    ``code`` naming ``said`` and keeps nothing; the node goes on: the next run is kept."""
    kept = kept_blobs(client)  # asked before the run is sent: its answer may come first, and request() drops it
    reply = answer_to(client, run_generated(client, rollout, episode, prompt, **answer))
    assert reply.kind == "error" and reply.body.code == code, reply.body
    assert said in reply.body.message, reply.body.message
    assert kept_blobs(client) == kept
    reply = answer_to(client, run_generated(client, rollout, f"{episode}-next", 3))
    assert isinstance(reply.body, Ok), reply.body
    assert kept_blobs(client) == kept + 1
    assert env.proc.poll() is None


@pytest.mark.parametrize("prompt,returned", [(misbehaving.STRING, "type str"), (misbehaving.BOOL, "type bool")])
def test_a_score_that_is_no_real_number_fails_only_its_run(bus: tuple[NodeProcess, str], env_process: NodeProcess,
                                                           prompt: int, returned: str) -> None:
    """Regression: a score returning a string ("1.0") or a bool was taken through ``float()``: the string's value
    and True as 1.0 were kept as rewards. Now the run fails ``score-failed`` naming the type returned."""
    ctx = zmq.Context()
    orchestrator = Client(ctx, env_process.info["endpoints"]["blobs"], WireCodec("orchestrator"), policy=PATIENT)
    rollout = Rollout(bus[1], "rollout-no-number")
    try:
        fails_alone(orchestrator, rollout, env_process, "ep-no-number", prompt, "score-failed",
                    f"returned {returned}, not a real number")
    finally:
        rollout.runtime.join(timeout=5)
        orchestrator.close()
        ctx.term()


def test_a_generation_whose_tokens_disagree_with_its_prompt_or_arrays_fails_only_its_run(
        bus: tuple[NodeProcess, str], env_process: NodeProcess) -> None:
    """Regression: a rollout function's tokens shorter than its prompt, or per-token arrays covering more tokens
    than its tokens, were kept and the run answered ok; the orchestrator then deleted the first ``malformed`` (a
    loss mask longer than its tokens) and trained the second with arrays of tokens it never had. Now the run
    fails ``bad-generation`` naming what disagrees, nothing is kept, and the node goes on."""
    ctx = zmq.Context()
    orchestrator = Client(ctx, env_process.info["endpoints"]["blobs"], WireCodec("orchestrator"), policy=PATIENT)
    rollout = Rollout(bus[1], "rollout-disagrees")
    try:
        fails_alone(orchestrator, rollout, env_process, "ep-short", [3, 7], "bad-generation",
                    "1 tokens for a prompt of 2", tokens=[3])
        fails_alone(orchestrator, rollout, env_process, "ep-long-arrays", [3], "bad-generation",
                    "arrays cover 5 tokens, not 2", tokens=[3, 4], arrays_for=5)
    finally:
        rollout.runtime.join(timeout=5)
        orchestrator.close()
        ctx.term()


GARBAGE = [  # (prompt, tokens, arrays_for, what the error names): what a rollout function may return
    ([3], [], 0, "0 tokens for a prompt of 1"),
    ([3], [3, 4], 1, "arrays cover 1 tokens, not 2"),
    ([3], [3, -1], None, "token ids run from 0 to 2**63 - 1"),
    ([3], [3, 2**64 - 1], None, "tokens: expected a list of numbers"),
    ([3, 7], [3, 7], 40, "arrays cover 40 tokens, not 2"),
    ([3, 7], [3, 8, 9], None, "do not start with its prompt: token 1 is 8, the prompt's is 7"),
    ([2**64 - 1], [5, 6], None, "do not start with its prompt: token 0 is 5"),
]


def test_an_env_server_fed_garbage_generations_keeps_none_and_serves_on(bus: tuple[NodeProcess, str],
                                                                        env_process: NodeProcess) -> None:
    """Garbage from a rollout function (no tokens, too few arrays, token ids no vocabulary has, tokens that do not
    start with the prompt): each run fails ``bad-generation`` naming what is wrong, nothing of it is kept, and the
    next run is kept."""
    ctx = zmq.Context()
    orchestrator = Client(ctx, env_process.info["endpoints"]["blobs"], WireCodec("orchestrator"), policy=PATIENT)
    rollout = Rollout(bus[1], "rollout-garbage")
    try:
        for index, (prompt, tokens, arrays_for, said) in enumerate(GARBAGE):
            fails_alone(orchestrator, rollout, env_process, f"ep-garbage-{index}", prompt, "bad-generation", said,
                        tokens=tokens, arrays_for=arrays_for)
    finally:
        rollout.runtime.join(timeout=5)
        orchestrator.close()
        ctx.term()
