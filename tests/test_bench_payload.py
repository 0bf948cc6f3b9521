"""The payload bench's fetch check: every step of a real ``StepFetcher`` (fake env servers in this process,
real sockets) lands in buffers filled with a sentinel first and is checked against each blob's own bytes, so a
fetch that writes nothing into buffers an earlier step filled correctly, or swaps two blobs, fails the bench
instead of passing. The bare-ZeroMQ baseline's frames are checked the same way. Also: the orchestrator child's peak
RSS is its own, not its parent's."""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from refbus.nodes.payload import fetcher as fetcher_module
from refbus.nodes.payload.branch import Branch
from test_fetcher import FakeEnvServer, start_env_server

from bench import payload
from bench.harness import MIB, WAIT_S, BenchError, workers

pytest_plugins = ["wire_fixtures"]

BLOBS, BLOB_BYTES, STEPS = 4, 16 << 10, 3


@pytest.fixture
def kept(serve: Callable[..., Any]) -> Iterator[tuple[list[Any], dict[str, np.ndarray]]]:
    """``BLOBS`` blobs kept on one fake env server as the bench keeps them (blob ``i`` holds ``blob_rows`` of
    ``i``): the bench's micro batches and the rows each blob id must assemble to."""
    env: FakeEnvServer = start_env_server(serve, "bench-test-env")
    refs = [env.keep(f"b{i}", Branch(routed_experts=payload.blob_rows(BLOB_BYTES, i))) for i in range(BLOBS)]
    yield payload.micro_batches(refs), payload.expected_rows({ref.blob_id: i for i, ref in enumerate(refs)},
                                                             BLOB_BYTES)


def fetch_steps(kept: tuple[list[Any], dict[str, np.ndarray]]) -> list[tuple[float, float]]:
    batches, expected = kept
    with payload.step_fetcher("bench-test-trainer") as (fetcher, calls):
        return payload.checked_fetches(fetcher, calls, batches, expected, STEPS)


def sabotage(monkeypatch: pytest.MonkeyPatch, wrong: Callable[..., Any]) -> None:
    """The fetcher's ``assemble`` replaced by ``wrong(assemble, plan, branches, step, **kwargs)``."""
    real, calls = fetcher_module.assemble, [0]

    def assemble(plan: Any, branches: list[Any], **kwargs: Any) -> Any:
        calls[0] += 1
        return wrong(real, plan, branches, calls[0] - 1, **kwargs)  # one micro batch a step: call i is step i

    monkeypatch.setattr(fetcher_module, "assemble", assemble)


def test_every_step_of_an_honest_fetch_passes_its_check(kept: tuple[list[Any], dict[str, np.ndarray]]) -> None:
    batches, _ = kept
    assert len(batches) == 1  # the sabotage below counts one assembly a step
    assert len(fetch_steps(kept)) == STEPS


def test_a_step_that_writes_nothing_into_buffers_an_earlier_step_filled_fails(
    kept: tuple[list[Any], dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def writes_nothing_after_the_first_step(real: Callable[..., Any], plan: Any, branches: list[Any], step: int,
                                            *, allocator: Any, **kwargs: Any) -> Any:
        if step == 0:
            return real(plan, branches, allocator=allocator, **kwargs)
        scratch = real(plan, branches, **kwargs)  # everything but the routing rows as usual, off the pool
        routing = scratch.routed_experts
        # The pool's routing buffer handed out as if filled: it holds whatever was there before this step.
        return dataclasses.replace(scratch, routed_experts=allocator(tuple(routing.shape), routing.dtype))

    sabotage(monkeypatch, writes_nothing_after_the_first_step)
    with pytest.raises(BenchError, match="wrong routing rows"):
        fetch_steps(kept)


def test_a_fetch_that_swaps_two_blobs_fails(
    kept: tuple[list[Any], dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def swaps_the_first_two(real: Callable[..., Any], plan: Any, branches: list[Any], step: int,
                            **kwargs: Any) -> Any:
        return real(plan, [branches[1], branches[0], *branches[2:]], **kwargs)

    sabotage(monkeypatch, swaps_the_first_two)
    with pytest.raises(BenchError, match="wrong routing rows for b0"):
        fetch_steps(kept)


def test_the_orchestrator_childs_peak_rss_is_its_own_not_its_parents() -> None:
    ballast = np.ones(384 * MIB, dtype=np.uint8)  # this process's peak: far above a fresh child's
    with workers("bench-test-orchestrator") as (child,):
        child.submit(payload.orchestrator_like)
        child.message()  # its endpoint: it is serving
        child.tell("stop")
        assert child.result() < ballast.nbytes // 2
    del ballast


class _Reports:
    """What a baseline server task reports to its parent, as a bench worker's channel carries it; ``then`` runs
    after each report."""

    def __init__(self, then: Callable[[], None] = lambda: None) -> None:
        self.values: queue.Queue[Any] = queue.Queue()
        self._then = then

    def send(self, value: Any) -> None:
        self.values.put(value)
        self._then()


def bare_zmq_steps(steps: int, *, then: Callable[[], None] = lambda: None) -> list[float]:
    """``steps`` steps of the bare-ZeroMQ baseline against a ``zmq_peer`` on a thread of this process (real
    sockets); the timed steps' seconds."""
    reports = _Reports(then)
    peer = threading.Thread(target=payload.zmq_peer, args=(reports, BLOBS, BLOB_BYTES, steps, "127.0.0.1"))
    peer.start()
    try:
        port = reports.values.get(timeout=WAIT_S)
        return payload.zmq_fetch(None, [("127.0.0.1", port)], BLOBS, BLOB_BYTES, steps - 1)
    finally:
        peer.join(WAIT_S)
        assert not peer.is_alive()


def test_the_bare_zeromq_baseline_receives_every_frame_of_every_step() -> None:
    assert len(bare_zmq_steps(STEPS)) == STEPS - 1


def test_the_bare_zeromq_baseline_fails_on_frames_with_other_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The peer has built its frames when it reports its port: from then on the receiver expects other bytes.
    with pytest.raises(BenchError, match="bare ZeroMQ delivered wrong frames"):
        bare_zmq_steps(1, then=lambda: monkeypatch.setattr(payload, "RAW_BYTE", payload.RAW_BYTE + 1))
