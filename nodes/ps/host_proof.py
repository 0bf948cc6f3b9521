"""Same host by proof, not by name: when a client may map a ps-worker's shared-memory segments.

Host names can be shared or faked (containers, namespaces, a copied config), and mapping "the same" path on
another machine reads another worker's memory. So a worker writes a random nonce into a file in its
segment directory and advertises ``(boot_id, nonce_file, nonce)`` (:class:`NonceFile`); a client maps the
worker's segments only if its kernel's boot id is the worker's and it reads the very nonce back from that
file (:func:`refusal`). Same kernel and the same file seen means the same memory; anything else (another
host, another tmpfs mounted at the same path, a stale or garbled file) is a refusal with its reason, and the
client reads frames instead (or fails, when it insists on shared memory).

The nonce file is named like a segment (``<prefix>.<token>.nonce``), so the orphan sweep of a restarted
worker removes the file of one that was killed.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from ...protocol.messages import plain_name
from ...protocol.messages_ps import WorkerInfo

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
_NONCE_MAX_BYTES = 128  # a nonce is 32 hex digits; a larger file is not one


def boot_id() -> str:
    """This kernel's boot id ("" where the kernel does not expose one: such a host proves nothing)."""
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class NonceFile:
    """A worker's proof file: created at start, removed at exit (:meth:`remove`)."""

    path: Path
    nonce: str

    @classmethod
    def create(cls, directory: str | Path, prefix: str, token: str | None = None) -> NonceFile:
        """``token``: the middle of the worker's segment names (default its pid). A file left under that name (by
        an earlier process of the token, killed) is replaced by a new one, never written through: a symlink
        planted there is removed, not followed."""
        nonce = os.urandom(16).hex()
        path = Path(directory) / f"{prefix}.{token or os.getpid()}.nonce"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, nonce.encode())
        finally:
            os.close(fd)
        return cls(path, nonce)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def refusal(worker: WorkerInfo, local_boot_id: str) -> str | None:
    """Why this process may not map ``worker``'s segments, or None when it has proved it may."""
    if not (worker.boot_id and worker.nonce_file and worker.nonce):
        return "the worker advertises no host proof"
    if not local_boot_id:
        return "this host exposes no kernel boot id"
    if worker.boot_id != local_boot_id:
        return f"its kernel boot id {worker.boot_id[:36]!r} is not this host's {local_boot_id!r}"
    if not plain_name(worker.nonce_file):
        return f"its nonce file name {worker.nonce_file[:64]!r} is not a plain file name"
    path = os.path.join(worker.shm_dir, worker.nonce_file)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            data = os.read(fd, _NONCE_MAX_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"its nonce file {path} cannot be read here ({exc.strerror})"
    if data != worker.nonce.encode():
        return f"its nonce file {path} holds another nonce here (another tmpfs, or a stale file)"
    return None
