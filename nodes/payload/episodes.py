"""Running episodes in an env server: ``run`` from the orchestrator, ``generate`` on a rollout worker.

    orchestrator ──run──▶ env server ──generate──▶ rollout worker
                          env server ◀──generated── (tokens, policy version, the branch arrays as frames)
                          score(prompt, completion); keep the arrays; publish episode-finished
    orchestrator ◀──ok──  env server

The ``run`` reply is deferred (the env server keeps serving fetches and deletes while a rollout generates),
and the ``generate`` request is sent without waiting: replies are handled when they arrive. Each run goes to
the rollout worker with the fewest generations in flight (workers found in the broker's registry). A run
whose generation fails or takes longer than ``generate_timeout_s`` is answered with an error; nothing is
kept for it.

The episode record published with the kept arrays (``info``) is what the orchestrator reads: ``group``,
``reward``, ``eval`` and one sample ``{"input_ids": [...], "loss_mask": [...], "ref": 0}`` whose loss mask
covers the completion only. Never imports torch: the score function must not either.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from ...bus.reqrep import Client, HandlerError, Pending
from ...bus.runtime import NodeRuntime
from ...protocol.envelope import Message
from ...protocol.messages import Error, Generate, Generated, Ok, Run
from ..config import Config
from ..entry_points import load_entry_point
from ..settings import EnvServerSettings
from .env_server import ROLE, EnvServer
from .keeper import KeepError

log = structlog.get_logger(__name__)

Score = Callable[[Sequence[int], Sequence[int]], float]


@dataclass
class _InFlight:
    run: Run
    pending: Pending
    client: Client
    sent: float


class EpisodeRunner:
    """Serves ``run`` on an :class:`EnvServer`'s endpoint (loop thread only)."""

    def __init__(self, runtime: NodeRuntime, env_server: EnvServer, settings: EnvServerSettings, *,
                 rollout_refresh_s: float = 1.0) -> None:
        self.runtime = runtime
        self.env_server = env_server
        self.settings = settings
        self.score: Score = load_entry_point(settings.score)
        self.rollouts: dict[str, Client] = {}
        self.load: Counter[str] = Counter()
        self.in_flight: dict[str, _InFlight] = {}
        self.finished = 0
        self.failed = 0
        env_server.server.on(Run.kind, self._on_run)
        runtime.every(rollout_refresh_s, self._refresh_rollouts)
        runtime.every(min(1.0, settings.generate_timeout_s / 4), self._expire)

    def _refresh_rollouts(self) -> None:
        for node in self.runtime.lookup("rollout") or ():
            endpoint = node.endpoints.get("generate")
            if endpoint and endpoint not in self.rollouts:
                client = self.runtime.client(endpoint)
                client.on_stray = self._on_reply
                self.runtime.watch(client.sock, lambda c=client: self._drain(c))
                self.rollouts[endpoint] = client

    def _on_run(self, request: Message) -> None:
        run = request.body
        assert isinstance(run, Run)
        if not self.rollouts:
            self._refresh_rollouts()
        if not self.rollouts:
            raise HandlerError("no-rollout", "no rollout worker is registered yet")
        endpoint = min(self.rollouts, key=lambda ep: self.load[ep])
        client = self.rollouts[endpoint]
        msg_id = client.send(Generate(prompt=run.prompt, max_new_tokens=self.settings.max_new_tokens))
        self.load[endpoint] += 1
        self.in_flight[msg_id] = _InFlight(run, self.env_server.server.pending, client, time.monotonic())
        return None  # answered when the generation comes back

    def _drain(self, client: Client) -> None:
        while (reply := client.recv(0, backend="numpy")) is not None:
            self._on_reply(reply)

    def _on_reply(self, reply: Message) -> None:
        flight = self.in_flight.pop(reply.header.re, None)
        if flight is None:
            return  # a late answer to a run already failed by timeout
        self.load[flight.client.endpoint] -= 1
        body = reply.body
        if isinstance(body, Error):
            self._fail(flight, body.code, f"rollout {flight.client.endpoint}: {body.message}")
        elif isinstance(body, Generated):
            self._finish(flight, body)

    def _finish(self, flight: _InFlight, generated: Generated) -> None:
        run = flight.run
        prompt_length = len(run.prompt)
        completion = generated.tokens[prompt_length:]
        reward = float(self.score(run.prompt, completion))
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
        try:
            self.env_server.keep(run.episode_id, [generated.arrays], policy_version=generated.policy_version,
                                 info=info)
        except KeepError as exc:
            self._fail(flight, exc.code, str(exc))
            return
        self.finished += 1
        self.env_server.server.answer(flight.pending, Ok(detail=f"reward={reward:.3f}"))

    def _fail(self, flight: _InFlight, code: str, message: str) -> None:
        self.failed += 1
        log.warning("run.failed", episode_id=flight.run.episode_id, code=code, error=message)
        self.env_server.server.answer(flight.pending, Error(code=code, message=message, request_kind=Run.kind))

    def _expire(self) -> None:
        horizon = time.monotonic() - self.settings.generate_timeout_s
        for msg_id in [m for m, f in self.in_flight.items() if f.sent < horizon]:
            flight = self.in_flight.pop(msg_id)
            self.load[flight.client.endpoint] -= 1
            self._fail(flight, "timeout", f"no generation from {flight.client.endpoint} within "
                                          f"{self.settings.generate_timeout_s}s")


def run(config: Config, args: argparse.Namespace) -> int:
    """``refbus node env-server``: keep, serve and run episodes until SIGINT/SIGTERM."""
    runtime = NodeRuntime(ROLE, config.runtime(node_id=args.node_id, ready_file=args.ready_file))
    try:
        env_server = EnvServer(runtime, config.env_server)
        EpisodeRunner(runtime, env_server, config.env_server)
    except ValueError as exc:  # a budget, lease or entry point that cannot be used
        log.error("env_server.bad_config", error=str(exc))
        runtime.close()
        return 2
    runtime.run()
    return 0
