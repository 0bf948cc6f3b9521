"""PS pulls as NIXL transfers (``ps.transport = "nixl"``): the reader READs a shard's bytes straight out of
the worker's segment into its destination, one-sided, with no message per piece.

* The worker's :class:`NixlExport` registers a segment with its NIXL agent the first time a reader asks
  (``ps-nixl-open``) and answers with the agent's metadata and the segment's address and length; it
  deregisters the segment before the segment goes back to the pool (release) or the worker closes.
* The reader's :class:`NixlReader` registers its destinations, READs every tensor, and hashes each one
  against the manifest's checksum, as the frames path does: the bytes are trusted only after that, and the
  caller still checks its pull lease after the read (a segment reused under an expired lease fails one or
  the other).
* A transfer that fails or runs past its deadline is released, which cancels it. When NIXL refuses the release
  (an active transfer it cannot cancel keeps its handle), the reader polls the transfer for as long again as
  its deadline allowed and deregisters the destinations only once NIXL reports it ended. A transfer never
  seen to end keeps its handle, its registration and its destinations (nothing frees memory it may still
  write), and the reader refuses every later read (:class:`NixlUnusable`); :meth:`NixlReader.may_write` says
  whether memory is still exposed to such a transfer.

NIXL is the optional ``nixl`` extra, installed with ``pip install --no-deps nixl-cu12==1.5.1`` (its wheel
declares CUDA libraries this path does not use); without it, :func:`require_nixl` says how to install it.
NIXL's UCX backend moves DRAM to DRAM on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


class NixlUnusable(NixlError):
    """A transfer could be neither cancelled nor seen to end: it may still write into its destinations, so the
    reader keeps them registered (and referenced) and refuses every later read."""


class _Unconfirmed(Exception):
    """Internal: the transfer of ``handle`` may still be running (its release was refused and it never ended)."""

    def __init__(self, handle: Any, message: str) -> None:
        super().__init__(message)
        self.handle = handle


@dataclass
class _Abandoned:
    """A transfer that may still write: what must stay alive and registered until NIXL says it ended."""

    handle: Any
    registration: Any
    targets: list[Any]  # the destination tensors: referenced so their memory is never freed and reused
    places: list[tuple[int, int]]  # (address, bytes) of each destination


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
        self._abandoned: list[_Abandoned] = []  # transfers that may still write (see the module docstring)
        self.unusable: str | None = None  # why every read is refused (a transfer was abandoned), else None

    def read(self, wanted: Sequence[Wanted], opened: Callable[[str], NixlOpened],
             destination: Callable[[ManifestEntry], torch.Tensor], *, deadline_s: float) -> list[torch.Tensor]:
        """Read every ``wanted`` tensor into ``destination(entry)`` (a writable, contiguous flat uint8 CPU tensor
        of ``entry.nbytes``) and return the destinations, in order, each verified against its entry's checksum.
        ``opened(segment)`` asks the worker to expose a segment. Every transfer finishes within ``deadline_s``;
        one that can be neither cancelled nor finished is waited for ``deadline_s`` more (then abandoned).

        Raises:
            NixlUnusable: this reader abandoned a transfer, now or before (nothing is read, ``destination`` is
                not called); the destinations of the one abandoned now may still be written.
            NixlError: an answer is unusable, a transfer failed or timed out, or a tensor's bytes do not match.
        """
        if self.unusable is not None:
            raise NixlUnusable(f"this NIXL reader refuses reads: {self.unusable}")
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
            self._read_segment(segment, remote, [wanted[i] for i in indices], [targets[i] for i in indices], deadline,
                               deadline_s)
        for item, target in zip(wanted, targets, strict=True):
            if xxhash.xxh3_64_intdigest(target.numpy() if target.numel() else b"") != item.entry.checksum:
                raise NixlError(f"tensor {item.entry.name!r} does not match the checksum of its manifest")
        return targets

    def may_write(self, address: int, nbytes: int) -> bool:
        """Whether a transfer this reader abandoned may still write into ``nbytes`` bytes at ``address``. Each
        abandoned transfer is asked once: one NIXL now reports ended is released and deregistered."""
        for abandoned in list(self._abandoned):
            try:
                state = self._agent.check_xfer_state(abandoned.handle)
            except Exception:  # unknown is not ended
                continue
            if state in ("DONE", "ERR"):
                with contextlib.suppress(Exception):
                    self._agent.release_xfer_handle(abandoned.handle)
                self._agent.deregister_memory(abandoned.registration)
                self._abandoned.remove(abandoned)
        return any(start < address + nbytes and address < start + length
                   for abandoned in self._abandoned for start, length in abandoned.places)

    def _read_segment(self, segment: str, remote: NixlOpened, wanted: list[Wanted], targets: list[torch.Tensor],
                      deadline: float, grace_s: float) -> None:
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
        abandoned = False
        try:
            local = self._agent.get_xfer_descs([(addr, n, 0) for addr, n in places], "DRAM")
            far = self._agent.get_xfer_descs([(remote.address + item.offset, item.entry.nbytes, 0) for item in wanted],
                                             "DRAM")
            self._transfer(segment, remote.agent, local, far, deadline, grace_s)
        except _Unconfirmed as exc:
            # The READ may still land: its destinations stay registered and alive, and no read follows.
            abandoned = True
            self._abandoned.append(_Abandoned(exc.handle, registration, list(targets), places))
            self.unusable = str(exc)
            raise NixlUnusable(str(exc)) from None
        finally:
            if not abandoned:
                self._agent.deregister_memory(registration)

    def _transfer(self, segment: str, peer: str, local: Any, far: Any, deadline: float, grace_s: float) -> None:
        try:
            handle = self._agent.initialize_xfer("READ", local, far, peer, b"ps")
        except Exception as exc:
            raise NixlError(f"segment {segment}: the transfer was refused ({exc})") from None
        state = "PROC"  # not known to have ended
        failure: NixlError | None = None
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
                failure = NixlError(f"segment {segment}: the transfer from {peer} failed")
        except NixlError as exc:
            failure = exc
        except Exception as exc:
            failure = NixlError(f"segment {segment}: the transfer from {peer} failed ({exc})")
        self._release(segment, peer, handle, ended=state in ("DONE", "ERR"), grace_s=grace_s, failure=failure)
        if failure is not None:
            raise failure

    def _release(self, segment: str, peer: str, handle: Any, *, ended: bool, grace_s: float,
                 failure: NixlError | None) -> None:
        """Release ``handle`` (cancelling its transfer if it still runs). NIXL refuses to release a transfer it
        cannot cancel: then wait up to ``grace_s`` for it to end, and raise _Unconfirmed if it does not."""
        try:
            self._agent.release_xfer_handle(handle)
            return
        except Exception as exc:
            refused = exc
        self._peers.pop(peer, None)  # the peer may be gone: its metadata is loaded again next time
        if ended:
            return  # nothing more is written; only the handle is lost
        end = time.monotonic() + grace_s
        pause = 0.0
        while True:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception:  # no answer proves nothing: keep asking until the bound
                state = "PROC"
            if state in ("DONE", "ERR"):
                with contextlib.suppress(Exception):  # ended: a second refusal only loses the handle
                    self._agent.release_xfer_handle(handle)
                return
            if time.monotonic() >= end:
                break
            time.sleep(pause)
            pause = min(2 * pause + 1e-5, _POLL_MAX_S)
        raise _Unconfirmed(handle, f"segment {segment}: the transfer from {peer} failed ({failure}), could not be "
                                   f"cancelled ({refused}) and did not end within {grace_s:g} s more; it may still "
                                   "write into its destinations")
