"""CURVE keys, the allow-list and the ZAP handler: who may connect to a node, and as which node id.

A key directory (made by ``refbus keys generate DIR``) holds:

* ``cluster.key`` / ``cluster.key_secret``: the cluster's server key pair. Every bound socket serves with it,
  so a connecting socket knows the server key without asking anyone: a server is authenticated as "a cluster
  member", not as one node.
* ``<node-id>.key`` / ``<node-id>.key_secret``: one client key pair per node; the node connects with it.
* ``allow-list``: one line per node, ``PUBLIC_KEY NODE_ID ROLE`` (a line starting with ``# `` is a comment).

Secret files are mode 0600 and never printed. A node loads its own pair and the allow-list at start
(:func:`load_curve`); its :class:`ZapHandler` then admits only allow-listed client keys and labels each
connection with the key's node id as its ZeroMQ ``User-Id``, which the request servers and the broker's
``events_in`` compare with every message's ``src``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import stat
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import structlog
import zmq
from zmq.utils import z85

from ..protocol.messages import is_id

log = structlog.get_logger(__name__)

CLUSTER = "cluster"
ALLOW_LIST = "allow-list"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks (RFC 27), per context
ZAP_DOMAIN = b"refbus"
NAME_CHARS = 128  # of a node id or role in the allow-list (:func:`~refbus.protocol.messages.is_id`)
KEY_CHARS = 40  # a Z85-encoded 32-byte CURVE key
# Node ids whose key files would be the directory's own files: a node "cluster" is the cluster key pair.
RESERVED_IDS = frozenset({CLUSTER, ALLOW_LIST})


class SecurityError(ValueError):
    """Key files, the allow-list or a bind that cannot be used; the message names the file or key to fix."""


@dataclass(frozen=True)
class Grant:
    """One allow-list entry: the node id and role a client key may act as."""

    node_id: str
    role: str


@dataclass(frozen=True)
class Curve:
    """What one node's sockets need: the cluster's server pair (bound sockets) and the node's own pair
    (connecting sockets), plus the allow-list its ZAP handler admits (public key -> grant)."""

    server_public: bytes
    server_secret: bytes
    public: bytes
    secret: bytes
    allowed: dict[bytes, Grant]
    grant: Grant  # what the allow-list grants this node's own key

    def __repr__(self) -> str:  # secrets stay out of logs and tracebacks
        return f"Curve(public={self.public.decode()}, allowed={len(self.allowed)} keys)"


def apply_curve(sock: zmq.Socket, curve: Curve, *, server: bool) -> None:
    """Make ``sock`` a CURVE server (it will bind: clients are checked by the ZAP handler) or a CURVE client
    of the cluster's server key (it will connect)."""
    if server:
        sock.curve_secretkey = curve.server_secret
        sock.curve_publickey = curve.server_public
        sock.zap_domain = ZAP_DOMAIN
        sock.curve_server = True
    else:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret


def peer_id(frame: zmq.Frame) -> str:
    """The node id the ZAP handler bound to the connection ``frame`` came in on ("" when it has none)."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return ""


# --- key files -----------------------------------------------------------------------------------------


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise SecurityError(f"{what} {path} does not exist (made by `refbus keys generate`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SecurityError(f"{what} {path} cannot be read: {exc}") from None


def _read_key(path: Path, what: str) -> bytes:
    return _parse_key(_read_text(path, what).strip(), f"{what} {path}")


def _parse_key(text: str, where: str) -> bytes:
    if not text.isascii():
        raise SecurityError(f"{where} is not a CURVE key: it holds non-ASCII characters, Z85 text expected")
    key = text.encode("ascii")
    if len(key) != KEY_CHARS:
        raise SecurityError(f"{where} is not a CURVE key: {KEY_CHARS} Z85 characters expected, found {len(key)}")
    try:
        z85.decode(key)
    # struct.error: Z85 characters whose 5-character groups exceed 32 bits (e.g. '#####')
    except (ValueError, KeyError, IndexError, struct.error):
        raise SecurityError(f"{where} is not a CURVE key: not Z85 text") from None
    return key


def _check_private(path: Path, what: str) -> None:
    """Refuse ``path`` when a user other than this one (or root) could change it: owned by another user, or
    writable by group or others. Whoever can rewrite the allow-list, or replace files in the key directory,
    can admit their own key as any node. A group- or other-writable file (not a directory) is accepted where
    no other user can reach it: in a directory this user owns that grants group and others nothing (what
    ``generate`` leaves, and where a file written under a umask of 002 lands)."""
    st = _stat(path, what)
    if st.st_uid not in (os.geteuid(), 0):
        raise SecurityError(f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) "
                            "or root: another user could change the keys it admits")
    if st.st_mode & 0o022 and (stat.S_ISDIR(st.st_mode) or not _only_mine(path.resolve().parent)):
        raise SecurityError(f"{what} {path} is writable by group or others (mode "
                            f"{stat.S_IMODE(st.st_mode):o}): chmod go-w it")


def _stat(path: Path, what: str) -> os.stat_result:
    try:
        return path.stat()
    except FileNotFoundError:
        raise SecurityError(f"{what} {path} does not exist (made by `refbus keys generate`)") from None
    except OSError as exc:
        raise SecurityError(f"{what} {path} cannot be read: {exc}") from None


def _only_mine(directory: Path) -> bool:
    """True when no other user (root aside) can reach the files in ``directory``: this user owns it and it
    grants group and others no access at all."""
    try:
        st = directory.stat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _read_pair(secret_path: Path, what: str) -> tuple[bytes, bytes]:
    """``(public, secret)``: the secret file must be private to its owner and match its public file."""
    if secret_path.exists() and secret_path.stat().st_mode & 0o077:
        raise SecurityError(f"{what} {secret_path} is readable by others: chmod 600 it")
    secret = _read_key(secret_path, what)
    public_path = secret_path.with_name(secret_path.name.removesuffix(SECRET_SUFFIX) + PUBLIC_SUFFIX)
    public = _read_key(public_path, f"public key of {what}")
    if zmq.curve_public(secret) != public:
        raise SecurityError(f"{secret_path} and {public_path} are not one key pair")
    return public, secret


def read_allow_list(path: Path) -> dict[bytes, Grant]:
    """The allow-list at ``path``: public key -> grant. Every malformed line is an error naming it, and so is a
    file another user could change (:func:`_check_private`)."""
    _check_private(path, "allow-list")
    lines = _read_text(path, "allow-list").splitlines()
    allowed: dict[bytes, Grant] = {}
    node_ids: set[str] = set()
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0] == "#":  # a key may start with '#' (Z85), never with "# "
            continue
        where = f"allow-list {path} line {number}"
        if len(fields) != 3 or not all(is_id(f, NAME_CHARS) for f in fields[1:]):
            raise SecurityError(f"{where}: expected 'PUBLIC_KEY NODE_ID ROLE', found {line.strip()[:120]!r}")
        key = _parse_key(fields[0], where)
        if key in allowed or fields[1] in node_ids:
            raise SecurityError(f"{where}: key or node id {fields[1]!r} listed twice")
        allowed[key] = Grant(fields[1], fields[2])
        node_ids.add(fields[1])
    return allowed


def load_curve(curve_dir: str, key_file: str, node_id: str = "", role: str = "") -> Curve:
    """The CURVE material of a node: the cluster pair and allow-list in ``curve_dir`` and the node's own pair
    from ``key_file`` (default ``<curve_dir>/<node_id>.key_secret``). The allow-list must grant that key
    ``node_id`` (when given; otherwise the grant names the node) and ``role`` (when given). Raises
    :class:`SecurityError` naming what to fix, also when another user could change the directory or the
    allow-list."""
    if not (key_file or node_id):
        raise SecurityError("with security.curve_dir set, a node needs --node-id or security.curve_key to find "
                            "its key")
    directory = Path(curve_dir)
    _check_private(directory, "key directory")
    server_public, server_secret = _read_pair(directory / (CLUSTER + SECRET_SUFFIX), "cluster secret key")
    secret_path = Path(key_file) if key_file else directory / (node_id + SECRET_SUFFIX)
    public, secret = _read_pair(secret_path, f"secret key of node {node_id or secret_path.stem!r}")
    allowed = read_allow_list(directory / ALLOW_LIST)
    grant = allowed.get(public)
    if grant is None:
        raise SecurityError(f"the key {secret_path} is not in {directory / ALLOW_LIST}")
    if (node_id and grant.node_id != node_id) or (role and grant.role != role):
        raise SecurityError(f"the key {secret_path} is allowed as node {grant.node_id!r} ({grant.role}), "
                            f"not as {node_id or grant.node_id!r} ({role or grant.role}): start the node with "
                            f"--node-id {grant.node_id}, or use that node's key")
    return Curve(server_public, server_secret, public, secret, allowed, grant)


def _write_private(path: Path, text: str) -> None:
    """Create ``path`` mode 0600 (whatever the umask) holding ``text``; an existing file is an error."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never briefly open to others
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _write_pair(directory: Path, stem: str) -> bytes:
    secret_path, public_path = directory / (stem + SECRET_SUFFIX), directory / (stem + PUBLIC_SUFFIX)
    if secret_path.exists() or public_path.exists():
        raise SecurityError(f"{secret_path} already exists: remove it first to replace the key")
    public, secret = zmq.curve_keypair()
    _write_private(secret_path, secret.decode() + "\n")
    public_path.write_text(public.decode() + "\n")
    return public


def generate(curve_dir: str, node_id: str = "", role: str = "") -> list[str]:
    """Make ``curve_dir`` and the cluster key pair when missing; with ``node_id``, also that node's pair,
    listed in the allow-list as ``role``. The directory, made or found, ends mode 0700 and the allow-list (when
    this user owns it) 0600, whatever the umask; a directory owned by another user is refused. Returns what
    was made, one line each (no secret in them)."""
    directory = Path(curve_dir)
    if bool(node_id) != bool(role):
        raise SecurityError("--node-id and --role go together")
    for name in (node_id, role):
        if name and not is_id(name, NAME_CHARS):
            raise SecurityError(f"{name!r}: node ids and roles are 1-128 letters, digits, '.', '_' or '-'")
    if node_id in RESERVED_IDS:
        raise SecurityError(f"{node_id!r} is reserved: the key directory's own files use that name; pick "
                            "another node id")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    owner = directory.stat().st_uid
    if owner != os.geteuid():
        raise SecurityError(f"key directory {directory} is owned by uid {owner}, not by this user "
                            f"(uid {os.geteuid()}): use a directory of your own")
    directory.chmod(0o700)  # mkdir's mode is cut by the umask, and a directory found may be open to others
    made = []
    allow_list = directory / ALLOW_LIST
    if not (directory / (CLUSTER + SECRET_SUFFIX)).exists():
        public = _write_pair(directory, CLUSTER)
        made.append(f"cluster server key {public.decode()} in {directory / (CLUSTER + PUBLIC_SUFFIX)}")
    if not allow_list.exists():
        _write_private(allow_list, "# PUBLIC_KEY NODE_ID ROLE: the client keys this cluster's nodes admit\n")
    elif allow_list.stat().st_uid == os.geteuid():
        allow_list.chmod(0o600)  # one an earlier version wrote with the umask's mode (0664 under umask 002)
    if node_id:
        if any(g.node_id == node_id for g in read_allow_list(allow_list).values()):
            raise SecurityError(f"node {node_id!r} is already in {allow_list}")
        public = _write_pair(directory, node_id)
        with allow_list.open("a") as f:
            f.write(f"{public.decode()} {node_id} {role}\n")
        made.append(f"node {node_id} ({role}) key {public.decode()} in {directory / (node_id + PUBLIC_SUFFIX)}")
    return made


# --- binding --------------------------------------------------------------------------------------------


LOCAL_SCHEMES = frozenset({"ipc", "inproc"})  # never leave the host
HOST_SCHEMES = frozenset({"tcp", "ws", "wss"})  # local when their host is a loopback address


def is_local(endpoint: str) -> bool:
    """True for endpoints no other host can reach: ipc, inproc, and tcp or WebSocket on loopback addresses.
    Any other transport ZeroMQ may offer (tipc, udp, pgm, vmci, ...) counts as reachable from other hosts."""
    scheme, _, address = endpoint.partition("://")
    if scheme in LOCAL_SCHEMES:
        return True
    if scheme not in HOST_SCHEMES:
        return False
    host = address.split("/", 1)[0].rsplit(":", 1)[0].strip("[]")  # a WebSocket address may end in a path
    if host in ("*", ""):
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_bind(endpoint: str, *, signed: bool, curve: bool, insecure: bool) -> None:
    """Refuse (:class:`SecurityError`) to bind ``endpoint`` where other hosts reach it with no protection on."""
    if is_local(endpoint) or signed or curve or insecure:
        return
    raise SecurityError(
        f"refusing to bind {endpoint}: other hosts could reach it and nothing authenticates them; set "
        "security.secret (or $REFBUS_SECRET) to sign, security.curve_dir to encrypt and authenticate, or "
        "security.insecure = true to bind it anyway"
    )


# --- ZAP ------------------------------------------------------------------------------------------------


class ZapHandler:
    """The node's ZAP handler (RFC 27) on its context: admits a CURVE client key only when the allow-list
    grants it, and names the connection with the grant's node id (its ``User-Id``). A refused peer is counted
    in :attr:`refused` and logged; it never gets a connection.

    Bound at construction (before any CURVE socket binds, so no handshake finds no handler); answers on its
    own daemon thread until :meth:`close`.
    """

    def __init__(self, ctx: zmq.Context, allowed: dict[bytes, Grant]) -> None:
        self.allowed = {z85.decode(key): grant for key, grant in allowed.items()}
        self.refused: Counter[str] = Counter()
        self.admitted = 0
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="refbus-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(100):
                    self._sock.send_multipart(self._answer(self._sock.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        finally:
            self._sock.close()

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism, *credentials = request
        grant = self.allowed.get(credentials[0]) if mechanism == b"CURVE" and credentials else None
        if grant is None:
            reason = "unknown-key" if mechanism == b"CURVE" else "no-curve"
            self.refused[reason] += 1
            key = z85.encode(credentials[0]).decode() if mechanism == b"CURVE" and credentials else ""
            log.warning("security.peer_refused", reason=reason, address=address.decode("ascii", "replace"),
                        key=key, domain=domain.decode("ascii", "replace"))
            return [version, request_id, b"400", reason.encode(), b"", b""]
        self.admitted += 1
        return [version, request_id, b"200", b"OK", grant.node_id.encode(), b""]

    def close(self) -> None:
        """Stop answering and close the socket (before the context terminates)."""
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join()
