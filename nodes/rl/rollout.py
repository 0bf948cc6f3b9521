"""`refbus node rollout`: a rollout worker that generates with the newest weights it was allowed to pull.

Serves ``generate`` (from env servers running episodes) with the configured generate entry point and
answers with the tokens, the policy version that produced them, and the per-token arrays to keep (router
choices, top-k heads, sampling mask) as zero-copy frames.

Weights: the worker pulls a version from the parameter server whenever a ``version-bump`` announces a
newer one (and polls the parameter server once a second, for a bump it joined too late to see), copying
into its model's own tensors (no allocation per version). Staleness is then bounded by how far the trainer
runs ahead of the orchestrator's admission: the orchestrator never admits more work than its bound allows,
and the trainer drops what is too stale when it is packed. Until version 0 exists, ``generate`` is refused
(``no-weights``) and the env server's run fails cleanly.
"""

from __future__ import annotations

import argparse
import zlib
from typing import TYPE_CHECKING, Any

import structlog
import torch

from ...bus.reqrep import HandlerError, RemoteError, RequestTimeout
from ...bus.runtime import NodeRuntime
from ...protocol.envelope import Message
from ...protocol.messages import Generate, Generated, VersionBump
from ..entry_points import load_entry_point
from ..ps.client import PsClient, PsError

if TYPE_CHECKING:
    from ..config import Config

log = structlog.get_logger(__name__)


class RolloutWorker:
    """The rollout role on a :class:`NodeRuntime` (loop thread only)."""

    def __init__(self, runtime: NodeRuntime, config: Config) -> None:
        rl = config.rl
        self.runtime = runtime
        self.rl = rl
        self.model = load_entry_point(rl.policy)(rl.seed)
        self.generate = load_entry_point(rl.generate)
        self.ps = PsClient(runtime, config.ps.manager)
        self.version = -1
        self.generated = 0
        # Each worker samples its own stream (crc32: stable across processes, unlike hash()).
        self.generator = torch.Generator().manual_seed(rl.seed + zlib.crc32(runtime.node_id.encode()))
        server = runtime.serve("generate", config.rollout.endpoint)
        server.on(Generate.kind, self._on_generate, cached=False)
        runtime.subscribe(self._on_bump, kinds=frozenset({VersionBump.kind}))
        runtime.every(1.0, self._poll)
        runtime.status = lambda: {"version": float(self.version), "generated": float(self.generated)}
        runtime.metric("refbus_rollout_policy_version", "Weights version this rollout worker serves.",
                       lambda: {(): float(self.version)}, kind="gauge")
        runtime.metric("refbus_rollout_generated_total", "Sequences generated.", lambda: {(): float(self.generated)})

    def _on_bump(self, message: Message) -> None:
        bump = message.body
        assert isinstance(bump, VersionBump)
        if bump.version > self.version:
            self.refresh()

    def _poll(self) -> None:
        try:
            latest = self.ps.status().latest
        except (RemoteError, RequestTimeout) as exc:
            log.warning("weights.status_failed", error=str(exc))
            return
        if latest > self.version:
            self.refresh()

    def refresh(self) -> None:
        """Pull the latest committed version if it is newer than the one served."""
        try:
            state = self.ps.pull(out=self.model.state_dict())
        except RemoteError as exc:
            if exc.code != "unknown-version":  # nothing committed yet is normal at start-up
                log.warning("weights.pull_failed", code=exc.code, error=exc.detail)
            return
        except (RequestTimeout, PsError) as exc:
            log.warning("weights.pull_failed", error=str(exc))
            return
        if state.version != self.version:
            log.info("weights.pulled", version=state.version, previous=self.version)
            self.version = state.version

    def _on_generate(self, request: Message) -> Generated:
        ask = request.body
        assert isinstance(ask, Generate)
        if self.version < 0:
            self.refresh()
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


def run(config: Config, args: argparse.Namespace) -> int:
    """``refbus node rollout``: serve generations until SIGINT/SIGTERM."""
    torch.set_num_threads(config.rl.torch_threads)
    runtime = NodeRuntime("rollout", config.runtime(node_id=args.node_id, ready_file=args.ready_file))
    RolloutWorker(runtime, config)
    runtime.run()
    return 0
