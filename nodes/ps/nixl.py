"""PS pulls as NIXL transfers (``ps.transport = "nixl"``): the reader READs a shard's bytes straight out of
the worker's segment into its destination, one-sided, with no message per piece.

* The worker's :class:`NixlExport` registers a segment with its NIXL agent the first time a reader asks
  (``ps-nixl-open``) and answers with the agent's metadata and the segment's address and length; it
  deregisters the segment before the segment goes back to the pool (release) or the worker closes.
* The reader's :class:`NixlReader` registers its destinations, READs every tensor, and hashes each one
  against the manifest's checksum, as the frames path does: the bytes are trusted only after that, and the
  caller still checks its pull lease after the read (a segment reused under an expired lease fails one or
  the other).

NIXL is the optional ``nixl`` extra, installed with ``pip install --no-deps nixl-cu12==1.5.1`` (its wheel
declares CUDA libraries this path does not use); without it, :func:`require_nixl` says how to install it.
NIXL's UCX backend moves DRAM to DRAM on machines without a GPU.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from ...protocol.messages_ps import ManifestEntry, NixlOpened

if TYPE_CHECKING:  # the worker side must not import torch (see .worker)
    import torch

    from .frames import Wanted

INSTALL_HINT = "install the optional `nixl` extra: pip install --no-deps nixl-cu12==1.5.1"
_POLL_MAX_S = 0.001  # longest pause between polls of a transfer: short next to any transfer worth NIXL


class NixlError(Exception):
    """NIXL is missing, a worker's answer is unusable, or a transfer failed, timed out or does not match."""


def require_nixl() -> Any:
    """The ``nixl_cu12._api`` module; raises NixlError saying how to install it when it is missing."""
    try:
        from nixl_cu12 import _api
    except ImportError as exc:
        raise NixlError(f"ps.transport = \"nixl\" needs NIXL, not importable here ({exc}): {INSTALL_HINT}") from None
    return _api


def _agent(prefix: str) -> Any:
    """A fresh UCX agent; the name is unique per process incarnation, so a restarted peer is a new agent."""
    api = require_nixl()
    name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


class NixlExport:
    """A worker's side: segments registered for remote reads, by segment name. Single-threaded (node loop).

    The agent starts on the first :meth:`open`, so a worker whose readers never ask needs no NIXL.
    """

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._agent: Any = None
        self._registered: dict[str, Any] = {}  # segment name -> its registration

    def open(self, name: str, address: int, capacity: int) -> NixlOpened:
        """Register segment ``name`` (``capacity`` bytes at ``address``, mapped by the caller until it calls
        :meth:`forget`) if it is not yet, and describe it for a reader."""
        if self._agent is None:
            self._agent = _agent(self.node_id)
        if name not in self._registered:
            self._registered[name] = self._agent.register_memory([(address, capacity, 0, "")], "DRAM")
        return NixlOpened(self._agent.name, self._agent.get_agent_metadata(), address, capacity)

    def forget(self, name: str) -> None:
        """Deregister segment ``name`` (before it is reused or unmapped); a no-op for one never opened."""
        registration = self._registered.pop(name, None)
        if registration is not None:
            self._agent.deregister_memory(registration)

    def close(self) -> None:
        for name in list(self._registered):
            self.forget(name)


class NixlReader:
    """A reader's side: one agent, the workers' agents it has met, by name. Not thread-safe (one pull at a time)."""

    def __init__(self, node_id: str) -> None:
        self._agent = _agent(node_id)
        self._peers: dict[str, bytes] = {}  # agent name -> the metadata last loaded

    def read(self, wanted: Sequence[Wanted], opened: Callable[[str], NixlOpened],
             destination: Callable[[ManifestEntry], torch.Tensor], *, deadline_s: float) -> list[torch.Tensor]:
        """Read every ``wanted`` tensor into ``destination(entry)`` (a writable, contiguous flat uint8 CPU tensor
        of ``entry.nbytes``) and return the destinations, in order, each verified against its entry's checksum.
        ``opened(segment)`` asks the worker to expose a segment. Every transfer finishes within ``deadline_s``.

        Raises:
            NixlError: an answer is unusable, a transfer failed or timed out, or a tensor's bytes do not match.
        """
        targets = [destination(item.entry) for item in wanted]
        by_segment: dict[str, list[int]] = {}
        for index, item in enumerate(wanted):
            if item.entry.nbytes:
                by_segment.setdefault(item.segment, []).append(index)
        deadline = time.monotonic() + deadline_s
        for segment, indices in by_segment.items():
            try:
                remote = opened(segment)
            except Exception as exc:  # the request's outcome (RemoteError, RequestTimeout, ...) is the cause
                raise NixlError(f"opening segment {segment} for NIXL reads failed: {exc}") from exc
            self._read_segment(segment, remote, [wanted[i] for i in indices], [targets[i] for i in indices], deadline)
        for item, target in zip(wanted, targets, strict=True):
            if xxhash.xxh3_64_intdigest(target.numpy() if target.numel() else b"") != item.entry.checksum:
                raise NixlError(f"tensor {item.entry.name!r} does not match the checksum of its manifest")
        return targets

    def _read_segment(self, segment: str, remote: NixlOpened, wanted: list[Wanted], targets: list[torch.Tensor],
                      deadline: float) -> None:
        for item in wanted:
            if item.offset + item.entry.nbytes > remote.capacity:
                raise NixlError(f"tensor {item.entry.name!r} ends past segment {segment} of {remote.capacity} bytes")
        # The metadata lists the worker's registrations: loaded again whenever it changed (a segment registered
        # since), which NIXL takes as an update of the agent it knows.
        if self._peers.get(remote.agent) != remote.metadata:
            try:
                added = self._agent.add_remote_agent(remote.metadata)
            except Exception as exc:  # NIXL raises its own types for metadata it cannot parse
                raise NixlError(f"segment {segment}: unusable agent metadata ({exc})") from None
            added = added.decode() if isinstance(added, bytes) else added
            if added != remote.agent:
                raise NixlError(f"segment {segment}: the metadata names agent {added!r}, the answer {remote.agent!r}")
            self._peers[remote.agent] = remote.metadata
        places = [(t.data_ptr(), t.numel()) for t in targets]
        registration = self._agent.register_memory([(addr, n, 0, "") for addr, n in places], "DRAM")
        try:
            local = self._agent.get_xfer_descs([(addr, n, 0) for addr, n in places], "DRAM")
            far = self._agent.get_xfer_descs([(remote.address + item.offset, item.entry.nbytes, 0) for item in wanted],
                                             "DRAM")
            self._transfer(segment, remote.agent, local, far, deadline)
        finally:
            self._agent.deregister_memory(registration)

    def _transfer(self, segment: str, peer: str, local: Any, far: Any, deadline: float) -> None:
        try:
            handle = self._agent.initialize_xfer("READ", local, far, peer, b"ps")
        except Exception as exc:
            raise NixlError(f"segment {segment}: the transfer was refused ({exc})") from None
        try:
            state = self._agent.transfer(handle)
            pause = 0.0
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise NixlError(f"segment {segment}: the transfer from {peer} did not finish within its deadline")
                time.sleep(pause)
                pause = min(2 * pause + 1e-5, _POLL_MAX_S)
                state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise NixlError(f"segment {segment}: the transfer from {peer} failed")
        except NixlError:
            raise
        except Exception as exc:
            raise NixlError(f"segment {segment}: the transfer from {peer} failed ({exc})") from None
        finally:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # a handle of a failed or abandoned transfer may refuse release: the peer is gone
                self._peers.pop(peer, None)
