"""A NIXL READ that times out and cannot be cancelled (NIXL refuses to release its handle) must not be
forgotten: its destinations stay registered until NIXL reports it ended, and one never seen to end leaves the
reader unusable and ``out`` untouched by any other copy (the pull is a TornPull). A fake agent stands in for
NIXL (its READ is a real memmove, posted when the test says so); no worker process is needed."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from refbus.nodes.ps import client as client_module
from refbus.nodes.ps import nixl
from refbus.nodes.ps.client import PsClient, PsError, TornPull
from refbus.nodes.ps.frames import Wanted
from refbus.protocol.messages_ps import (
    Location,
    Manifest,
    ManifestEntry,
    NixlOpen,
    NixlOpened,
    PullBegin,
    PullGrant,
    WorkerInfo,
)


class FakeAgent:
    """NIXL's agent as the reader uses it. ``stuck``: the READ never ends by itself and its release is refused;
    ``ends_after``: once its release was refused, it reports ended at the ``ends_after``-th state check."""

    name = "reader-agent"

    def __init__(self) -> None:
        self.log: list[str] = []
        self.stuck = False
        self.ends_after: int | None = None
        self.checks_after_refusal = 0
        self.refused = False
        self.finished = False  # the test ends the transfer (as the network would, late)
        self._handles: dict[int, tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {}

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return metadata  # the metadata is the remote agent's name

    def register_memory(self, places: list[tuple[int, int, int, str]], kind: str) -> int:
        self.log.append("register")
        return id(places)

    def deregister_memory(self, registration: int) -> None:
        self.log.append("deregister")

    def get_xfer_descs(self, places: list[tuple[int, int, int]], kind: str) -> list[tuple[int, int]]:
        return [(addr, n) for addr, n, _ in places]

    def initialize_xfer(self, op: str, local: Any, far: Any, peer: str, note: bytes) -> int:
        handle = len(self._handles) + 1
        self._handles[handle] = (local, far)
        return handle

    def _copy(self, handle: int) -> None:
        for (dst, n), (src, m) in zip(*self._handles[handle], strict=True):
            assert n == m
            ctypes.memmove(dst, src, n)

    def transfer(self, handle: int) -> str:
        self.log.append("transfer")
        if self.stuck:
            return "PROC"
        self._copy(handle)
        return "DONE"

    def check_xfer_state(self, handle: int) -> str:
        if self.refused:
            self.checks_after_refusal += 1
            if self.finished or (self.ends_after is not None and self.checks_after_refusal >= self.ends_after):
                self.log.append("ended")
                return "DONE"
        return "DONE" if self.finished else "PROC"

    def release_xfer_handle(self, handle: int) -> None:
        if self.stuck and not self.finished and not (
                self.ends_after is not None and self.checks_after_refusal >= self.ends_after):
            self.refused = True
            self.log.append("release-refused")
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: the transfer cannot be cancelled")
        self.log.append("released")


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> FakeAgent:
    fake = FakeAgent()
    monkeypatch.setattr(nixl, "_agent", lambda prefix: fake)
    return fake


class Source:
    """A worker's segment: a real buffer whose address the fake READ copies from."""

    def __init__(self, tensors: dict[str, np.ndarray]) -> None:
        self.buffer = np.concatenate([t.view(np.uint8).reshape(-1) for t in tensors.values()])
        self.entries: list[ManifestEntry] = []
        offset = 0
        for name, t in tensors.items():
            nbytes = t.nbytes
            self.entries.append(ManifestEntry(name, str(t.dtype), list(t.shape), nbytes,
                                              xxhash.xxh3_64_intdigest(t.tobytes()), [Location("w0", "seg0", offset),
                                                                                      Location("w1", "seg1", offset)]))
            offset += nbytes

    def opened(self, segment: str) -> NixlOpened:
        return NixlOpened("worker-agent", b"worker-agent", self.buffer.ctypes.data, self.buffer.nbytes)


STATE = {"a": np.arange(64, dtype=np.float32), "b": np.arange(32, dtype=np.int64) * 7}


def _read(reader: nixl.NixlReader, source: Source, deadline_s: float = 0.05,
          destination: Callable[[ManifestEntry], torch.Tensor] | None = None) -> list[torch.Tensor]:
    wanted = [Wanted(e, e.locations[0].offset, "seg0") for e in source.entries]
    return reader.read(wanted, source.opened, destination or (lambda e: torch.zeros(e.nbytes, dtype=torch.uint8)),
                       deadline_s=deadline_s)


def test_a_refused_release_waits_for_the_transfer_to_end_before_deregistering(agent: FakeAgent) -> None:
    reader = nixl.NixlReader("r")
    source = Source(STATE)
    agent.stuck, agent.ends_after = True, 3  # still running at the first two checks after the refusal
    with pytest.raises(nixl.NixlError, match="within its deadline") as err:
        _read(reader, source)
    assert not isinstance(err.value, nixl.NixlUnusable)
    # Deregistered only once NIXL said the transfer ended, never while it may still write.
    assert agent.log == ["register", "transfer", "release-refused", "ended", "released", "deregister"]
    assert agent.checks_after_refusal == 3 and reader.unusable is None
    agent.stuck = False  # the reader still works
    got = _read(reader, source)
    assert bytes(torch.cat(got).numpy()) == source.buffer.tobytes()


def test_a_transfer_never_seen_to_end_leaves_the_reader_unusable_and_its_memory_registered(agent: FakeAgent) -> None:
    reader = nixl.NixlReader("r")
    source = Source(STATE)
    agent.stuck = True
    targets: list[torch.Tensor] = []

    def destination(entry: ManifestEntry) -> torch.Tensor:
        targets.append(torch.zeros(entry.nbytes, dtype=torch.uint8))
        return targets[-1]

    with pytest.raises(nixl.NixlUnusable, match="could not be cancelled"):
        _read(reader, source, destination=destination)
    assert "deregister" not in agent.log and reader.unusable
    assert reader.may_write(targets[0].data_ptr(), 1) and not reader.may_write(targets[0].data_ptr() - 8, 8)
    called: list[ManifestEntry] = []
    with pytest.raises(nixl.NixlUnusable, match="refuses reads"):  # nothing is touched: not even a destination
        _read(reader, source, destination=lambda e: called.append(e) or torch.zeros(e.nbytes, dtype=torch.uint8))
    assert called == [] and agent.log.count("transfer") == 1
    agent.finished = True  # the READ ends at last: the memory is released then, and only then
    assert not reader.may_write(targets[0].data_ptr(), 1)
    assert agent.log[-2:] == ["released", "deregister"]


# --- the client: a pull into out= whose READ was abandoned ---------------------------------------------------


class _Policy:
    @staticmethod
    def timeouts() -> list[float]:
        return [0.02]


class _WorkerClient:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.policy = _Policy()


class _Manager:
    endpoint = "manager"

    def __init__(self) -> None:
        self.asked: list[object] = []

    def request(self, body: object) -> object:
        self.asked.append(body)
        return None


class _Keeper:
    def hold(self, lease: str, ttl_s: float) -> None:
        pass

    def drop(self, lease: str) -> None:
        pass


@pytest.fixture
def ps(agent: FakeAgent, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[PsClient, Source, list[str]]]:
    source = Source(STATE)
    manifest = Manifest(3, "digest", int(source.buffer.nbytes), source.entries,
                        [WorkerInfo(w, f"tcp://{w}", "elsewhere", "/dev/shm") for w in ("w0", "w1")])
    client = PsClient.__new__(PsClient)
    client._nixl = nixl.NixlReader("r")
    client._manager = _Manager()  # type: ignore[assignment]
    client._keeper = _Keeper()  # type: ignore[assignment]
    client.holder, client.chunk_bytes, client.before_write = "rollout", 1 << 20, None
    client.read_bytes, client._counting = client_module.Counter(), threading.Lock()
    client._local_location = lambda entry, workers: None  # type: ignore[method-assign]
    client._worker = lambda info: _WorkerClient(info.endpoint)  # type: ignore[method-assign, assignment]
    asked: list[str] = []

    def ask(worker: Any, body: Any, expect: Any) -> Any:
        asked.append(f"{worker.endpoint}:{body.kind}")
        if isinstance(body, PullBegin):
            return PullGrant("lease-1", 30.0, manifest)
        assert isinstance(body, NixlOpen)
        return source.opened(body.segment)

    client._ask = ask  # type: ignore[method-assign]

    def frames(worker: Any, wanted: list[Wanted], destination: Any, **kwargs: Any) -> list[torch.Tensor]:
        asked.append(f"{worker.endpoint}:frames")
        out = []
        for item in wanted:
            target = destination(item.entry)
            start = item.offset
            target.copy_(torch.from_numpy(source.buffer[start:start + item.entry.nbytes].copy()))
            out.append(target)
        return out

    monkeypatch.setattr(client_module, "read_frames", frames)
    yield client, source, asked


def test_a_pull_into_out_whose_read_was_abandoned_is_torn_and_out_is_not_written_again(
        ps: tuple[PsClient, Source, list[str]], agent: FakeAgent) -> None:
    client, _, asked = ps
    agent.stuck = True
    out = {name: torch.zeros(t.shape, dtype=getattr(torch, str(t.dtype))) for name, t in STATE.items()}
    with pytest.raises(TornPull) as err:
        client.pull(out=out)
    assert isinstance(err.value.cause, PsError) and "could not be cancelled" in str(err.value.cause)
    # No other copy (w1, by NIXL or frames) was read into out: only the abandoned READ may still land there.
    assert asked == ["manager:ps-pull-begin", "tcp://w0:ps-nixl-open"]
    assert all(not t.any() for t in out.values())
    assert "deregister" not in agent.log
    # A later pull into the same tensors is refused before it asks for anything (the memory is still exposed).
    with pytest.raises(PsError, match="abandoned NIXL transfer"):
        client.pull(out=out)
    assert len(asked) == 2
    # Other memory is pulled as frames: the reader refuses reads.
    pulled = client.pull()
    assert all(np.array_equal(pulled[name].numpy(), t) for name, t in STATE.items())
    assert asked[2:] == ["manager:ps-pull-begin", "tcp://w0:frames"] and client.read_bytes["nixl"] == 0
    agent.finished = True  # once NIXL reports the READ ended, out may be pulled into again (by frames)
    client.pull(out=out)
    assert all(np.array_equal(out[name].numpy(), t) for name, t in STATE.items())


def test_an_abandoned_read_into_buffers_falls_back_to_another_copy(
        ps: tuple[PsClient, Source, list[str]], agent: FakeAgent) -> None:
    client, _, asked = ps
    agent.stuck = True
    pulled = client.pull()  # no out: the READ's buffers stay with the reader, w1 serves the pull by frames
    assert all(np.array_equal(pulled[name].numpy(), t) for name, t in STATE.items())
    assert asked == ["manager:ps-pull-begin", "tcp://w0:ps-nixl-open", "tcp://w1:frames"]
