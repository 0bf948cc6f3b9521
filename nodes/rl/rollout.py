"""`refbus node rollout`: a rollout worker that generates with the newest weights it was allowed to pull.

Serves ``generate`` (from env servers running episodes) with the configured generate entry point and
answers with the tokens, the policy version that produced them, and the per-token arrays to keep (router
choices, top-k heads, sampling mask) as zero-copy frames.

Weights: the worker pulls a version from the parameter server whenever a ``version-bump`` announces a
version other than the one it serves (newer; or lower: a restarted trainer world resumed from a checkpoint
and started a new lineage; or the same number with another manifest digest: a new lineage's version that
replaced the retired one the worker holds, every bump and poll in between missed), and polls the parameter
server once a second (``ps-status``: the latest version and its digest), for a bump it joined too late to
see, copying into its model's own tensors (no allocation per version). Staleness is then bounded by how
far the trainer runs ahead of the orchestrator's admission: the orchestrator never admits more work than its
bound allows, and the trainer drops what is too stale when it is packed. Until version 0 exists, ``generate`` is refused
(``no-weights``) and the env server's run fails cleanly.

Torn weights: a pull copies into the model's tensors (there is no memory for a second copy), so a pull
that fails part-way (:class:`~refbus.nodes.ps.client.TornPull`) leaves a model mixing two versions. The
worker then serves no version: ``generate`` is refused with ``no-weights`` (retryable: the run is sent
again) until a full pull succeeds, which it attempts on every refresh tick and before every refusal, except
within a tick of an attempt that went unanswered (a manager that does not answer costs the queued
generations one attempt's retries per tick, not each generation its own).

Threads: generations and weight pulls run one at a time on one :class:`~refbus.bus.offload.Offload`
thread, so the node loop answers heartbeats and takes requests and bumps while the model computes, and a
pull never changes the weights under a generation. A pull goes ahead of the generations still queued: a
bump is acted on once the generation in progress ends; one that arrives while a refresh is queued or
running queues another refresh when that one ends. The once-a-tick poll of a worker serving whole weights
is asked from the loop thread, and a refresh is queued only once its answer names another version: a
manager that does not answer (dead, restarting, hung) holds up no generation with the weights the worker
has. The ``generate`` reply is deferred and sent from the loop thread.

Abandoned requests: a ``generate`` says how long its sender waits (``deadline_s``). One still queued that
long after it arrived is dropped when its turn comes, unstarted: its sender has given up on it, and a worker
slower than its requests would otherwise spend all its time on generations nobody waits for. It is answered
``expired`` (a reply the sender no longer reads), counted (``refbus_rollout_expired_total``) and logged
(``generate.expired``). The time is measured from its arrival here, never from the sender's clock: the
worker may start one its sender has just given up on, never drop one its sender still waits for.
"""

from __future__ import annotations

import argparse
import math
import time
import zlib
from typing import TYPE_CHECKING, Any

import structlog
import torch

from ...bus.offload import Offload, describe
from ...bus.reqrep import HandlerError, Outcome, RemoteError, RequestTimeout
from ...bus.runtime import NodeRuntime
from ...protocol.envelope import Message
from ...protocol.messages import Body, Error, Generate, Generated, VersionBump
from ...protocol.messages_ps import PsState, PsStatus
from ..entry_points import load_entry_point
from ..ps.client import PsClient, PsError, TornPull

if TYPE_CHECKING:
    from ..config import Config

log = structlog.get_logger(__name__)

REFRESH_EVERY_S = 1.0  # the refresh tick: a poll for a missed bump, and the pace of refreshes before refusals


class RolloutWorker:
    """The rollout role on a :class:`NodeRuntime`: requests and events on the loop thread, the model (its
    generations and weight pulls) on the offload thread."""

    def __init__(self, runtime: NodeRuntime, config: Config) -> None:
        rl = config.rl
        self.runtime = runtime
        self.rl = rl
        self.model = load_entry_point(rl.policy)(rl.seed)
        self.generate = load_entry_point(rl.generate)
        # Made before the PsClient: its shutdown hook must stop a pull in progress before the client closes.
        self.offload = Offload(runtime, "rollout-model")
        self.ps = PsClient(runtime, config.ps.manager, remote=config.ps.transport)  # type: ignore[arg-type]
        self.manager = config.ps.manager  # polled from the loop thread (see _want_refresh)
        self.version = -1  # written on the offload thread only; -1 also while the weights are torn
        # The served version's manifest digest (offload thread; "" with version -1): a new lineage numbers
        # its versions as the ones it retired, so the number alone cannot tell them apart.
        self.digest = ""
        self.torn: TornPull | None = None  # the failed pull that tore the weights, until a full pull (offload)
        self.torn_pulls = 0
        self.generated = 0
        self.expired = 0  # generations dropped unstarted: their sender had given up (offload thread)
        self._refresh_queued = False  # loop thread
        self._refresh_missed = False  # loop thread: a bump came while a refresh was queued or running
        self._clock = time.monotonic
        self._unanswered_at = -math.inf  # offload thread: when the last refresh ended unanswered (_clock)
        # Each worker samples its own stream (crc32: stable across processes, unlike hash()).
        self.generator = torch.Generator().manual_seed(rl.seed + zlib.crc32(runtime.node_id.encode()))
        self.server = runtime.serve("generate", config.rollout.endpoint)
        self.server.on(Generate.kind, self._on_generate, cached=False)
        runtime.subscribe(self._on_bump, kinds=frozenset({VersionBump.kind}))
        runtime.every(REFRESH_EVERY_S, self._want_refresh)
        runtime.status = lambda: {"version": float(self.version), "generated": float(self.generated),
                                  "torn": float(self.torn is not None)}
        runtime.metric("refbus_rollout_policy_version", "Weights version this rollout worker serves.",
                       lambda: {(): float(self.version)}, kind="gauge")
        runtime.metric("refbus_rollout_generated_total", "Sequences generated.", lambda: {(): float(self.generated)})
        runtime.metric("refbus_rollout_expired_total",
                       "Generations dropped unstarted: their sender's deadline had passed while they were queued.",
                       lambda: {(): float(self.expired)})
        runtime.metric("refbus_rollout_torn_pulls_total",
                       "Weight pulls that failed part-way and left the model torn (generation refused until a "
                       "full pull).", lambda: {(): float(self.torn_pulls)})
        runtime.metric("refbus_rollout_weights_read_bytes_total",
                       "Weight bytes pulled, by path: shm (mapped from a ps-worker on this host) or frames.",
                       lambda: {(path,): float(n) for path, n in self.ps.read_totals().items()}, labels=("path",))

    # --- loop thread ---------------------------------------------------------------------------------

    def _on_bump(self, message: Message) -> None:
        bump = message.body
        assert isinstance(bump, VersionBump)
        if (bump.version, bump.manifest_digest) != (self.version, self.digest):  # lower or same: a new lineage
            self._want_refresh(bumped=True)

    def _want_refresh(self, bumped: bool = False) -> None:
        """Queue one refresh ahead of the generations. While one is queued or running (or its poll is asked), a
        tick is dropped (the next tick comes) but a bump is remembered: that refresh may have read the manager
        before the bump's version committed, so another one is queued when it ends. A tick while the weights
        are whole only asks the manager (:meth:`_polled` queues the refresh): the offload thread, which runs the
        generations, never waits on a manager that may not answer."""
        if self._refresh_queued:
            self._refresh_missed = self._refresh_missed or bumped
            return
        self._refresh_queued = True
        if bumped or self.version < 0:
            self.offload.submit(self.refresh, self._refreshed, urgent=True)
        else:
            self.runtime.calls.request(self.manager, PsStatus(), self._polled)

    def _polled(self, outcome: Outcome) -> None:
        """The tick's poll answered (or failed): queue the refresh when the manager's latest is not the version
        served, else end the poll as a refresh would end."""
        state = outcome.body if not isinstance(outcome, Exception) else None
        if isinstance(state, PsState) and not self._serves(state):
            self.offload.submit(self.refresh, self._refreshed, urgent=True)
            return
        if isinstance(outcome, Exception):
            log.warning("weights.poll_failed", error=str(outcome))
        elif not isinstance(state, PsState):  # a manager of another build, or not a manager: said, the next tick asks
            log.warning("weights.poll_failed", error=f"{self.manager} answered ps-status with {outcome.kind}")
        self._refreshed(None)

    def _refreshed(self, outcome: object) -> None:
        self._refresh_queued = False
        if isinstance(outcome, Exception):
            log.error("weights.refresh_failed", exc_info=outcome)
        if self._refresh_missed:
            self._refresh_missed = False
            self._want_refresh(bumped=True)

    def _on_generate(self, request: Message) -> None:
        ask = request.body
        assert isinstance(ask, Generate)
        pending = self.server.pending
        arrived = self._clock()
        self.offload.submit(lambda: self._generate(ask, arrived),
                            lambda reply: self.server.answer(pending, _reply(reply)))
        return None  # answered from the loop thread once generated

    # --- offload thread ------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Pull the latest committed version if it is not the one served, by number or digest (offload
        thread)."""
        try:
            status = self.ps.status()
            self._unanswered_at = -math.inf
            if self._serves(status):
                return
            state = self.ps.pull(out=self.model.state_dict())
        except TornPull as exc:
            self.torn, self.version, self.digest = exc, -1, ""
            self.torn_pulls += 1
            log.error("weights.torn", version=exc.version, written=len(exc.written), error=str(exc.cause))
            return
        except RemoteError as exc:
            if exc.code != "unknown-version":  # nothing committed yet is normal at start-up
                log.warning("weights.pull_failed", code=exc.code, error=exc.detail)
            return
        except (RequestTimeout, PsError) as exc:
            if isinstance(exc, RequestTimeout):
                self._unanswered_at = self._clock()
            log.warning("weights.pull_failed", error=str(exc))
            return
        if (state.version, state.digest) != (self.version, self.digest):
            log.info("weights.pulled", version=state.version, previous=self.version, digest=state.digest,
                     previous_digest=self.digest, repaired=self.torn is not None)
            self.version, self.digest = state.version, state.digest
        self.torn = None

    def _serves(self, state: PsState) -> bool:
        """Whether the manager's latest committed version (``state``) is the one served, or there is none (an
        older manager sends no digest: the number alone decides, as it did there)."""
        return state.latest == -1 or (state.latest == self.version and state.latest_digest in ("", self.digest))

    def _generate(self, ask: Generate, arrived: float) -> Generated:
        """Generate for ``ask`` (arrived at ``arrived``, on :attr:`_clock`): refused ``expired`` when its sender's
        deadline has passed since, ``no-weights`` without whole weights."""
        waited = self._clock() - arrived
        if 0 < ask.deadline_s <= waited:
            self.expired += 1
            log.warning("generate.expired", waited_s=round(waited, 3), deadline_s=ask.deadline_s,
                        expired=self.expired)
            raise HandlerError("expired", f"queued {waited:.3f}s, past the sender's deadline of {ask.deadline_s}s: "
                               "dropped unstarted")
        if self.version < 0 and self._clock() - self._unanswered_at >= REFRESH_EVERY_S:
            self.refresh()  # not again within a tick of one unanswered: each would wait out its whole retries
        if self.torn is not None:
            raise HandlerError("no-weights", f"the weights are torn ({self.torn}); generation is refused until a "
                               "full pull succeeds")
        if self.version < 0:
            raise HandlerError("no-weights", "no committed weights version yet")
        rl = self.rl
        with torch.no_grad():
            (rollout,) = self.generate(self.model, torch.tensor([ask.prompt]), ask.max_new_tokens,
                                       temperature=rl.temperature, top_k_logprobs=rl.top_k_logprobs,
                                       sampling_top_k=rl.sampling_top_k, generator=self.generator)
        self.generated += 1
        arrays: dict[str, Any] = rollout.branch().to_arrays()
        return Generated(tokens=[int(t) for t in rollout.tokens], policy_version=self.version, arrays=arrays)


def _reply(outcome: Generated | Exception) -> Body:
    """The ``generate`` reply: the generation, or the error it failed with (as a handler's would be)."""
    if isinstance(outcome, HandlerError):
        return Error(outcome.code, str(outcome), Generate.kind)
    if isinstance(outcome, Exception):
        log.error("generate.failed", exc_info=outcome)
        return Error("internal", describe(outcome), Generate.kind)  # user code's: its __str__ may raise
    return outcome


def run(config: Config, args: argparse.Namespace) -> int:
    """``refbus node rollout``: serve generations until SIGINT/SIGTERM."""
    torch.set_num_threads(config.rl.torch_threads)
    runtime = NodeRuntime("rollout", config.runtime(node_id=args.node_id, ready_file=args.ready_file))
    RolloutWorker(runtime, config)
    runtime.run()
    return 0
