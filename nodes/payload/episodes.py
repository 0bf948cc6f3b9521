"""Running episodes in an env server: ``run`` from the orchestrator, ``generate`` on a rollout worker.

    orchestrator ──run──▶ env server ──generate──▶ rollout worker
                          env server ◀──generated── (tokens, policy version, the branch arrays as frames)
                          score(prompt, completion); keep the arrays; publish episode-finished
    orchestrator ◀──ok──  env server

The ``run`` reply is deferred (the env server keeps serving fetches and deletes while a rollout generates),
and the ``generate`` request is an asynchronous call (``runtime.calls``) whose deadline is
``generate_timeout_s``. Each run goes to the rollout worker with the fewest generations in flight (workers
found in the broker's registry, refreshed every ``rollout_refresh_s`` by an asynchronous ``nodes`` request,
so a broker that stops answering never stalls the loop: what is known is kept until it answers again; a
run that arrives while no worker is known waits for the next answer, then fails ``no-rollout`` if there
is still none). A run whose generation fails, misses its deadline or whose worker leaves the registry is answered
with an error; nothing is kept for it. So is a run whose rollout function's tokens are fewer than its prompt's, do
not start with it, hold an id the orchestrator refuses (:func:`~.records.token_ids`) or do not match its arrays'
rows one for one: it fails ``bad-generation``, naming what disagrees, before it is scored (kept, the orchestrator
would delete it ``malformed``, or train it with arrays of other tokens). A run's request sent again while the run
still runs (a client's retry: a deferred reply is never cached) is ignored: it is generated once, and answered once
when it ends. The score function is user code: it runs on an :class:`~refbus.bus.offload.Offload` thread, one
episode at a time, so a slow one never stalls the loop (a score that raises, ``sys.exit()`` included, or returns
what the orchestrator would refuse as a reward, fails its run with ``score-failed``: anything but a real number, a
string or a bool included, named by its type, or NaN or an infinity: :func:`~.records.reward_of`). The run's deadline,
``generate_timeout_s`` from its arrival, covers its score too: a run not scored by then (its score slow or hung,
or queued behind one that is) fails ``timeout`` at it, its generation's arrays released; a score still queued at
it is never computed, and one that returns after it keeps nothing (the orchestrator has counted the run failed and
freed its room).

A keep refused with a ``retry_after_s`` (``over-budget``: the store is full for now, its holders have not
deleted yet; or ``journal-failed``: its tmpfs had no room for the journal record) is tried again after that
long, holding the generated arrays, until ``generate_timeout_s`` from the run's arrival: backpressure costs
the run time, not its generation. Past that the run fails with the keep's code.

The episode record published with the kept arrays (``info``) is what the orchestrator reads: ``group``,
``reward``, ``eval`` and one sample ``{"input_ids": [...], "loss_mask": [...], "ref": 0}`` whose loss mask
covers the completion only. Never imports torch: the score function must not either.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from ...bus.offload import Offload, describe
from ...bus.reqrep import SEND_ONCE, Outcome, PeerDown, Pending, RemoteError, RequestTimeout
from ...bus.runtime import NodeRuntime
from ...protocol.envelope import Message
from ...protocol.messages import Error, Generate, Generated, NodeInfo, Ok, Run
from ..entry_points import load_entry_point
from ..settings import EnvServerSettings
from .branch import Branch, BranchError
from .keeper import KeepError
from .records import MalformedEpisode, reward_of, token_ids

if TYPE_CHECKING:
    from .env_server import EnvServer

log = structlog.get_logger(__name__)

Score = Callable[[Sequence[int], Sequence[int]], float]


class EpisodeRunner:
    """Serves ``run`` on an :class:`EnvServer`'s endpoint (loop thread only)."""

    def __init__(self, runtime: NodeRuntime, env_server: EnvServer, settings: EnvServerSettings, *,
                 rollout_refresh_s: float = 1.0) -> None:
        self.runtime = runtime
        self.env_server = env_server
        self.settings = settings
        self.score: Score = load_entry_point(settings.score)
        self.scoring = Offload(runtime, "score")  # user code: scores never stall the env server's loop
        self.rollouts: set[str] = set()  # generate endpoints
        self.arrived: dict[Pending, float] = {}  # the runs not answered yet -> when each arrived (monotonic)
        self._scoring: dict[Pending, Generated] = {}  # runs whose score is queued or running -> their generation
        self.finished = 0
        self.failed = 0
        self.keep_retries = 0
        self._unplaced: list[tuple[Run, Pending]] = []  # runs that arrived while no rollout worker was known
        env_server.server.on(Run.kind, self._on_run)
        runtime.every(rollout_refresh_s, self._refresh_rollouts)

    def _refresh_rollouts(self) -> None:
        """Ask the registry for the rollout workers, without waiting: :meth:`_refreshed` gets the answer."""
        self.runtime.lookup_async("rollout", self._refreshed)

    def _refreshed(self, nodes: list[NodeInfo] | None) -> None:
        if nodes is not None:  # None: the broker did not answer, keep what we know
            live = {endpoint for node in nodes if (endpoint := node.endpoints.get("generate"))}
            for endpoint in self.rollouts - live:  # gone from the registry: its generations will not come back
                self.runtime.calls.peer_down(endpoint, "no longer in the registry")
            self.rollouts = live
        unplaced, self._unplaced = self._unplaced, []
        for run, pending in unplaced:
            if self.rollouts:
                self._dispatch(run, pending)
            else:
                self._fail(run, pending, "no-rollout", "no rollout worker is registered yet")

    def _on_run(self, request: Message) -> None:
        run = request.body
        assert isinstance(run, Run)
        pending = self.env_server.server.pending
        if pending in self.arrived:  # sent again while it runs (a client's retry: a deferred reply is never cached)
            return None  # its one answer comes when the run ends
        self.arrived[pending] = time.monotonic()
        if self.rollouts:
            self._dispatch(run, pending)
        else:  # none known yet: placed when the registry answers
            self._unplaced.append((run, pending))
            self._refresh_rollouts()
        return None  # answered when the generation's outcome is known

    def _dispatch(self, run: Run, pending: Pending) -> None:
        calls = self.runtime.calls
        endpoint = min(sorted(self.rollouts), key=calls.in_flight)
        # Sent once: a rollout worker does not cache generations, so a resend would generate twice.
        # Its deadline goes with it: the worker drops it unstarted once this node has given up on it.
        deadline_s = self.settings.generate_timeout_s
        calls.request(endpoint, Generate(prompt=run.prompt, max_new_tokens=self.settings.max_new_tokens,
                                         deadline_s=deadline_s),
                      lambda outcome: self._generated(run, pending, endpoint, outcome),
                      deadline_s=deadline_s, policy=SEND_ONCE, backend="numpy")

    def _generated(self, run: Run, pending: Pending, endpoint: str, outcome: Outcome) -> None:
        if isinstance(outcome, RemoteError):
            self._fail(run, pending, outcome.code, f"rollout {endpoint}: {outcome.detail}")
        elif isinstance(outcome, RequestTimeout):
            self._fail(run, pending, "timeout", f"no generation from {endpoint} within "
                                                f"{self.settings.generate_timeout_s}s")
        elif isinstance(outcome, PeerDown):
            self._fail(run, pending, "rollout-down", str(outcome))
        elif isinstance(outcome.body, Generated):
            if (error := _disagreement(run.prompt, outcome.body)) is not None:  # user code's: fails only its run
                self._fail(run, pending, "bad-generation", f"rollout {endpoint}: {error}")
            else:
                self._finish(run, pending, outcome.body)
        else:
            self._fail(run, pending, "internal", f"rollout {endpoint} answered {outcome.kind}, not generated")

    def _finish(self, run: Run, pending: Pending, generated: Generated) -> None:
        """Queue the score of ``generated``, due by the run's deadline (:meth:`_overdue` fails the run then)."""
        deadline = self.arrived[pending] + self.settings.generate_timeout_s  # one generation a run: not answered yet
        self._scoring[pending] = generated
        self.runtime.later(max(deadline - time.monotonic(), 0.0), lambda: self._overdue(run, pending))
        prompt, completion = run.prompt, generated.tokens[len(run.prompt):]  # the job holds no arrays
        self.scoring.submit(lambda: self._score_by(deadline, prompt, completion),
                            lambda reward: self._scored(run, pending, reward))

    def _score_by(self, deadline: float, prompt: Sequence[int], completion: Sequence[int]) -> float | None:
        """The score (offload thread), checked as the orchestrator checks a reward (:func:`~.records.reward_of`,
        raising :class:`~.records.MalformedEpisode`: its object's own conversions run here, off the loop); None,
        never computed, when the run's ``deadline`` passed while it was queued: a score function slower than the
        runs come then spends its time on runs still waited for."""
        if time.monotonic() >= deadline:
            return None
        return reward_of(self.score(prompt, completion))

    def _overdue(self, run: Run, pending: Pending) -> None:
        """The run's deadline: fail it unless its score came (the keep that follows has its own bound)."""
        if self._scoring.pop(pending, None) is not None:
            self._fail(run, pending, "timeout",
                       f"not scored within the run's {self.settings.generate_timeout_s}s (generate_timeout_s): "
                       f"{self.settings.score} is slow or hung, or the scores queued before it were")

    def _scored(self, run: Run, pending: Pending, reward: float | Exception | None) -> None:
        if reward is None:  # its deadline passed while it was queued
            self._overdue(run, pending)
            return
        generated = self._scoring.pop(pending, None)
        if generated is None:  # failed at its deadline already: what the score says comes too late to keep
            log.warning("run.scored_late", episode_id=run.episode_id, score=self.settings.score,
                        detail="its run failed at its deadline: nothing is kept")
            return
        if isinstance(reward, MalformedEpisode):  # what it returned: a reward the orchestrator would refuse
            self._fail(run, pending, "score-failed", f"{self.settings.score}: returned {reward}")
            return
        if isinstance(reward, Exception):  # user code: its failure is this run's answer, not the node's
            # Described so that no message of the user's own (a __str__ that raises) leaves its run unanswered.
            self._fail(run, pending, "score-failed", f"{self.settings.score}: {describe(reward)}")
            return
        prompt_length = len(run.prompt)
        completion = generated.tokens[prompt_length:]
        info = {
            "group": run.group,
            "reward": reward,
            "eval": run.eval,
            "samples": [{
                "input_ids": list(generated.tokens),
                "loss_mask": [0] * prompt_length + [1] * len(completion),
                "ref": 0,
            }],
        }
        self._keep(run, pending, generated, info, reward)

    def _keep(self, run: Run, pending: Pending, generated: Generated, info: dict[str, Any], reward: float) -> None:
        try:
            self.env_server.keep(run.episode_id, [generated.arrays], policy_version=generated.policy_version,
                                 info=info)
        except KeepError as exc:
            waited = time.monotonic() - self.arrived.get(pending, 0.0)
            if exc.retry_after_s > 0 and waited + exc.retry_after_s < self.settings.generate_timeout_s:
                self.keep_retries += 1
                self.runtime.later(exc.retry_after_s, lambda: self._keep(run, pending, generated, info, reward))
                return
            self._fail(run, pending, exc.code, str(exc))
            return
        except Exception as exc:  # the run is answered whatever failed: its caller would wait out its deadline
            log.exception("run.keep_failed", episode_id=run.episode_id)
            self._fail(run, pending, "internal", f"{type(exc).__name__}: {exc}")
            return
        self.finished += 1
        self.arrived.pop(pending, None)
        self.env_server.server.answer(pending, Ok(detail=f"reward={reward:.3f}"))

    def _fail(self, run: Run, pending: Pending, code: str, message: str) -> None:
        self.failed += 1
        self.arrived.pop(pending, None)
        log.warning("run.failed", episode_id=run.episode_id, code=code, error=message)
        self.env_server.server.answer(pending, Error(code=code, message=message, request_kind=Run.kind))


def _disagreement(prompt: Sequence[int], generated: Generated) -> str | None:
    """What makes a rollout function's ``generated`` for ``prompt`` unfit to keep, or None: its tokens are the
    prompt's and then the completion's (so at least as many as the prompt's, and starting with them), each an id the
    orchestrator takes (:func:`~.records.token_ids`), and its arrays have one row per token, no more and no fewer.
    Otherwise the episode would be kept and its run answered ok, then deleted ``malformed`` by the orchestrator (a
    loss mask longer than its tokens, a blob short of them), or trained with arrays of tokens it never had."""
    tokens = generated.tokens
    if len(tokens) < len(prompt):
        return f"{len(tokens)} tokens for a prompt of {len(prompt)}: a generation's tokens are its prompt's, then " \
               "its completion's"
    try:
        ids = token_ids("tokens", tokens)
    except MalformedEpisode as error:
        return str(error)
    if (head := ids[: len(prompt)].tolist()) != list(prompt):  # the score and the loss mask would cut it wrongly
        at = next(i for i, (token, asked) in enumerate(zip(head, prompt, strict=True)) if token != asked)
        return f"its tokens do not start with its prompt: token {at} is {head[at]}, the prompt's is {prompt[at]}"
    try:
        count = Branch.from_arrays(generated.arrays).token_count
    except BranchError:  # the keep refuses it (``bad-branch``), naming the field, and keeps nothing
        return None
    if count != len(tokens):
        return f"its arrays cover {count} tokens, not {len(tokens)}: one row per token of its prompt and completion"
    return None
