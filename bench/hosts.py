"""Many hosts on one machine, for tests that must cross hosts: network namespaces joined by a bridge.

Each host of a :class:`Hosts` cluster has its own network namespace (a veth to a bridge that lives in a
namespace of its own; an address from 198.18.0.0/15, the range reserved for benchmarking), its own host
name (UTS namespace), its own ``/dev/shm`` (a tmpfs bind-mounted over it in a private mount namespace: every
process of one host sees the same one, other hosts and the root namespace never see it) and an ``/etc/hosts``
naming every host of the cluster. Only the hosts' namespaces and their loopback carry traffic: the root
namespace is not attached to the bridge, so nothing reaches any other network.

Processes enter a host with ``nsenter --net`` (not ``ip netns exec``, which mounts a fresh ``/sys`` and so
hides the cgroup hierarchy from daemons that check it) and ``unshare --uts --mount``; :meth:`Host.argv`
wraps a command line so, and :meth:`Host.popen` starts it. :meth:`Host.link` takes a host's bridge port down
and up again: a partition, as a failed switch port looks to the host. Nothing is left behind:
:meth:`Hosts.down` kills every process inside the cluster's namespaces, deletes the namespaces (which removes
the veths and the bridge), unmounts the tmpfs mounts and removes the state directory, each step whatever
the others did, and then fails naming anything of the cluster still there; it runs from the test fixture's
finalizer, at interpreter exit and on SIGTERM (which then exits with status 143 by raising SystemExit, so
the interrupted code's ``finally`` blocks still run). Names carry the owner: its pid and its start time
(``rbt<pid>-<start>-<n>``, the start in clock ticks since boot), so concurrent runs never collide, nor does a
later process that reuses the pid of one that kept a cluster; every :func:`build` first sweeps what a killed
run left behind (clusters whose owner, that pid with that start time, is gone). A :func:`build` never touches
a cluster it did not create: should its name exist already, it fails and leaves that cluster as it is.

Needs root, iproute2 and util-linux (nsenter, unshare). From the command line (as root)::

    python -m bench.hosts up 3                  # prints the cluster's name and hosts; kept until `down`
    python -m bench.hosts exec CLUSTER hostB -- hostname
    python -m bench.hosts down [CLUSTER ...]    # no name: every kept cluster and every stale one

``down CLUSTER ...`` removes those clusters only and prints their names; a name that is not a cluster's
(:data:`CLUSTER_NAME`, ``rbt<pid>-<start>-<n>``) is refused (exit status 2) before anything is removed.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

STATE_ROOT = Path("/run/refbus-hosts")
NETNS_DIR = Path("/run/netns")
SUBNET = ipaddress.ip_network("198.18.0.0/24")  # inside 198.18.0.0/15, reserved for benchmarking
MAX_HOSTS = 200
CLUSTER_NAME = re.compile(r"^rbt(\d+)-(\d+)-(\d+)$")  # owner's pid, owner's start time, sequence number
CLUSTER_OF_NETNS = re.compile(r"^(rbt\d+-\d+-\d+)-")
HOST_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,30}$")
BRIDGE = "bridge"
KEEP_MARKER = "keep"  # in a cluster's state dir: made from the command line, not swept
STOP_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_S = 10.0
REAP_POLL_S = 0.02
CAP_LATENCY_MS = 20  # how long a packet may wait in a capped link's queue before it is dropped

# In the entered host, before exec: the host name, the host's /dev/shm and hosts file. "$0" is the host
# name, "$1" the shm directory, "$2" the hosts file; the command follows.
_ENTER = 'hostname "$0" && mount --bind "$1" /dev/shm && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'

_live: dict[str, Hosts] = {}
# Reentrant: the SIGTERM handler runs _down_all on the main thread, possibly while that thread holds it.
_live_lock = threading.RLock()
_sequence = iter(range(1 << 30))


def default_host_names(count: int) -> list[str]:
    """The names of ``count`` hosts when none are given: hostA .. hostZ, then hostAA, hostAB, .. hostZZ, ...
    (letters counted as spreadsheet columns are), each a valid host name (:data:`HOST_NAME`) and all distinct."""
    names = []
    for number in range(1, count + 1):
        letters = ""
        while number:
            number, digit = divmod(number - 1, 26)
            letters = chr(ord("A") + digit) + letters
        names.append(f"host{letters}")
    return names


class HostsUnavailable(RuntimeError):
    """This machine or user cannot build namespace hosts (the message says why)."""


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a setup command (bounded in time); its stderr is in the error when it fails."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22); None when there
    is no such process. With the pid it names one process for good: a pid is reused, a (pid, start) pair not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone (or going: a read of an exiting process's stat can fail with ESRCH)
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # after "pid (comm)": field 3 is index 0


def _this_owner() -> str:
    """The prefix of this process's clusters' names: ``rbt<pid>-<start>`` (:data:`CLUSTER_NAME`)."""
    return f"rbt{os.getpid()}-{_start_time(os.getpid())}"


def _new_cluster_name() -> str:
    return f"{_this_owner()}-{next(_sequence)}"


def _probe_name(owner: str) -> str:
    """The namespace :func:`unsupported` tries: named as a host of a cluster of ``owner``'s (a
    :func:`_this_owner` prefix), so a run killed between its ``add`` and ``del`` leaves one the next
    :func:`sweep` removes."""
    return f"{owner}-{next(_sequence)}-probe"


def unsupported() -> str | None:
    """Why namespace hosts cannot be built here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "namespace hosts need Linux"
    if os.geteuid() != 0:
        return "namespace hosts need root (network, mount and UTS namespaces)"
    missing = [tool for tool in ("ip", "nsenter", "unshare", "mount", "umount") if shutil.which(tool) is None]
    if missing:
        return f"namespace hosts need {', '.join(missing)} (iproute2, util-linux)"
    probe = _probe_name(_this_owner())
    try:
        result = _sh("ip", "netns", "add", probe, check=False)
    finally:
        _sh("ip", "netns", "del", probe, check=False)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip()}"
    return None


class Host:
    """One host of a cluster. Its processes are the cluster's: :meth:`Hosts.down` kills what is left."""

    def __init__(self, cluster: Hosts, name: str, address: str) -> None:
        self.cluster = cluster
        self.name = name  # host name (UTS) and the name every host resolves to ``address``
        self.address = address
        self.netns = f"{cluster.name}-{name}"
        self.shm = cluster.state / name / "shm"  # this host's /dev/shm, as the root namespace sees it

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` wrapped to run inside this host (exec chain: the process keeps one pid)."""
        return ["nsenter", f"--net={NETNS_DIR / self.netns}", "--",
                "unshare", "--uts", "--mount", "--propagation", "private", "--",
                "sh", "-c", _ENTER, self.name, str(self.shm), str(self.cluster.hosts_file), *command]

    def popen(self, command: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``command`` inside this host (``subprocess.Popen`` arguments pass through). The caller
        stops and reaps it; whatever still runs at :meth:`Hosts.down` is killed and reaped there."""
        proc = subprocess.Popen(self.argv(command), **kwargs)
        self.cluster.processes.append(proc)
        return proc

    def python(self) -> str:
        """An executable that runs this machine's Python (``sys.executable``, so the same environment) inside
        this host with the arguments it is given: what ``multiprocessing``'s ``set_executable`` takes to
        spawn processes there. A shell script in the cluster's state directory, made on first use."""
        launcher = self.cluster.state / self.name / "python"
        if not launcher.exists():
            if os.statvfs(launcher.parent).f_flag & os.ST_NOEXEC:
                raise HostsUnavailable(f"{STATE_ROOT} is mounted noexec: cannot run a Python launcher from it")
            launcher.write_text(f'#!/bin/sh\nexec {shlex.join(self.argv([sys.executable]))} "$@"\n')
            launcher.chmod(0o755)
        return str(launcher)

    def cap(self, rate_bit: int) -> None:
        """Cap this host's link at ``rate_bit`` bits per second each way, as a NIC of that speed would: a
        token bucket (``tc`` tbf) on its interface (what it sends) and on its bridge port (what it receives).
        Replaces an earlier cap; :meth:`uncap` removes it, and deleting the namespaces removes it too."""
        burst = max(rate_bit // 8 // 100, 256 << 10)  # 10 ms of traffic, and never below a few TSO packets
        tbf = ["root", "tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "latency", f"{CAP_LATENCY_MS}ms"]
        for netns, dev in self._link_ends():
            _sh("tc", "-n", netns, "qdisc", "replace", "dev", dev, *tbf)

    def uncap(self) -> None:
        """Remove the cap of :meth:`cap` (nothing to remove is fine)."""
        for netns, dev in self._link_ends():
            _sh("tc", "-n", netns, "qdisc", "del", "dev", dev, "root", check=False)

    def caps(self) -> list[str]:
        """The token-bucket qdiscs on this host's link, as ``tc qdisc show`` prints them (empty: uncapped)."""
        shown = [_sh("tc", "-n", netns, "qdisc", "show", "dev", dev).stdout
                 for netns, dev in self._link_ends()]
        return [line for text in shown for line in text.splitlines() if " tbf " in f" {line} "]

    def _link_ends(self) -> list[tuple[str, str]]:
        return [(self.netns, "eth0"), (self.cluster.bridge_netns, f"v{self.cluster.hosts.index(self)}")]

    def link(self, up: bool) -> None:
        """Bring this host's bridge port up or down: down, nothing reaches or leaves the host (its own
        interface, addresses and routes stay as they are, so its processes see no error, only silence)."""
        port = f"v{self.cluster.hosts.index(self)}"
        _sh("ip", "-n", self.cluster.bridge_netns, "link", "set", port, "up" if up else "down")

    def run(self, command: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run ``command`` inside this host to completion (text output captured); raises on timeout."""
        return subprocess.run(self.argv(command), capture_output=True, text=True, timeout=timeout, check=False)

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address}, netns={self.netns})"


class Hosts:
    """A cluster of namespace hosts built by :func:`build`; :meth:`down` removes all of it (idempotent)."""

    def __init__(self, name: str, host_names: Sequence[str]) -> None:
        self.name = name
        self.state = STATE_ROOT / name
        self.hosts_file = self.state / "hosts"
        self.bridge_netns = f"{name}-{BRIDGE}"
        addresses = list(SUBNET.hosts())
        self.hosts = [Host(self, host, str(addresses[i])) for i, host in enumerate(host_names)]
        self.processes: list[subprocess.Popen[Any]] = []

    def __getitem__(self, key: int | str) -> Host:
        if isinstance(key, int):
            return self.hosts[key]
        for host in self.hosts:
            if host.name == key:
                return host
        raise KeyError(key)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def namespaces(self) -> list[str]:
        return [host.netns for host in self.hosts] + [self.bridge_netns]

    def _up(self, shm_size: str) -> None:
        """Build the cluster into its state directory, which :func:`build` created (claiming the name)."""
        lines = ["127.0.0.1 localhost", "::1 localhost"] + [f"{h.address} {h.name}" for h in self.hosts]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        _sh("ip", "netns", "add", self.bridge_netns)
        _sh("ip", "-n", self.bridge_netns, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge_netns, "link", "set", "br0", "up")
        for index, host in enumerate(self.hosts):
            host.shm.mkdir(parents=True)
            _sh("mount", "-t", "tmpfs", "-o", f"size={shm_size},mode=1777", "tmpfs", str(host.shm))
            _sh("ip", "netns", "add", host.netns)
            port = f"v{index}"
            # Both ends are created inside their namespaces: no name ever appears in the root namespace.
            _sh("ip", "link", "add", "eth0", "netns", host.netns, "type", "veth", "peer", "name", port,
                "netns", self.bridge_netns)
            _sh("ip", "-n", self.bridge_netns, "link", "set", port, "master", "br0", "up")
            _sh("ip", "-n", host.netns, "addr", "add", f"{host.address}/{SUBNET.prefixlen}", "dev", "eth0")
            _sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
            _sh("ip", "-n", host.netns, "link", "set", "lo", "up")

    def down(self) -> None:
        """Kill every process inside the cluster, delete its namespaces, mounts and state directory; raises
        when anything of it is left (:func:`_teardown`), after trying every step."""
        try:
            for proc in self.processes:
                _stop(proc)
        finally:
            _teardown(self.name)  # whatever stopping did: it SIGKILLs what is left in the namespaces itself
        with _live_lock:
            _live.pop(self.name, None)


def _stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL, each waited for ``STOP_TIMEOUT_S``; one that outlives both is left to teardown
    (which kills every process of the namespaces and fails naming any that survive)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_TIMEOUT_S)


def _pids_in(inodes: set[int]) -> list[int]:
    """Processes whose network namespace is one of ``inodes``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(entry / "ns" / "net").st_ino in inodes:
                    pids.append(int(entry.name))
    return pids


def _reap_children(pids: Sequence[int]) -> None:
    """Collect those of ``pids`` (processes just killed inside a namespace) that are exited children of this
    process. Only those: any other child's exit status belongs to whoever started it (its ``Popen.wait``)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):  # not our child, or already collected
            os.waitpid(pid, os.WNOHANG)


def _teardown(cluster: str) -> None:
    """Remove everything named ``cluster`` (also what a killed run left): processes, namespaces, mounts, dir.

    Every step runs whatever the steps before it did (a command that fails or times out stops none of the
    rest) and tolerates what is already gone; the state directory is removed only once nothing is mounted
    under it (a host's tmpfs still mounted is left whole, not emptied). Then anything of the cluster still
    there (:func:`leftovers`), or a process that survived SIGKILL for ``STOP_TIMEOUT_S`` (stuck in the kernel,
    its namespace would outlive the cluster), is a RuntimeError naming it and what failed.
    """
    netns = sorted(p for p in NETNS_DIR.glob(f"{cluster}-*")) if NETNS_DIR.is_dir() else []
    inodes = set()
    for path in netns:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(path).st_ino)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    survivors = _pids_in(inodes)
    while survivors and time.monotonic() < deadline:
        for pid in survivors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(REAP_POLL_S)
        _reap_children(survivors)
        survivors = _pids_in(inodes)
    failed: list[str] = []

    def step(*argv: str) -> None:
        try:
            result = _sh(*argv, check=False)
        except subprocess.TimeoutExpired:
            failed.append(f"{' '.join(argv)} timed out")
            return
        if result.returncode != 0:
            failed.append(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")

    for path in netns:
        step("ip", "netns", "del", path.name)
    state = STATE_ROOT / cluster
    for mountpoint in sorted(_mounts_under(state), key=len, reverse=True):
        step("umount", "-l", mountpoint)
    if not _mounts_under(state):
        shutil.rmtree(state, ignore_errors=True)  # what it cannot remove, leftovers() names below
    left = leftovers(cluster)
    if survivors or left:
        raise RuntimeError(f"teardown of {cluster} left {left or 'nothing'}, processes {survivors} survived "
                           f"SIGKILL; {'; '.join(failed) or 'no command failed'}")


def _mounts_under(directory: Path) -> list[str]:
    prefix = f"{directory}/"
    with open("/proc/self/mountinfo") as mountinfo:
        points = [line.split()[4] for line in mountinfo]
    return [p for p in points if p.startswith(prefix)]


def leftovers(cluster: str) -> list[str]:
    """What of ``cluster`` still exists (namespaces, mounts, state directory); empty after a clean down."""
    found = [f"netns {p.name}" for p in sorted(NETNS_DIR.glob(f"{cluster}-*"))] if NETNS_DIR.is_dir() else []
    found += [f"mount {m}" for m in _mounts_under(STATE_ROOT / cluster)]
    if (STATE_ROOT / cluster).exists():
        found.append(f"dir {STATE_ROOT / cluster}")
    return found


def _owner_alive(cluster: str) -> bool:
    """Whether the process that built ``cluster`` still runs: its pid, with the start time its name carries (a
    later process that reuses the pid is not the owner)."""
    match = CLUSTER_NAME.match(cluster)
    assert match is not None, cluster
    pid, start = int(match.group(1)), int(match.group(2))
    return _start_time(pid) == start


def _known_clusters() -> set[str]:
    names = {p.name for p in STATE_ROOT.iterdir()} if STATE_ROOT.is_dir() else set()
    if NETNS_DIR.is_dir():
        names |= {m.group(1) for p in NETNS_DIR.iterdir() if (m := CLUSTER_OF_NETNS.match(p.name))}
    return {name for name in names if CLUSTER_NAME.match(name)}


def sweep() -> list[str]:
    """Tear down the clusters whose owner process is gone and that were not made to be kept; returns them.

    One that cannot be torn down is a warning (RuntimeWarning) and stays: it is someone else's leftover, so
    it must not fail the build (or the test) that happened to sweep; the next sweep tries again.

    A live owner keeps its clusters (the owner is the pid with the start time the name carries, so a process
    that reuses the pid is none): the sweep only ever removes what nobody can still be using.
    """
    swept = []
    for name in sorted(_known_clusters()):
        kept = (STATE_ROOT / name / KEEP_MARKER).exists()
        if kept or _owner_alive(name) or name in _live:
            continue
        try:
            _teardown(name)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            warnings.warn(f"cannot sweep {name}, left by a process that is gone: {exc}", RuntimeWarning,
                          stacklevel=2)
            continue
        swept.append(name)
    return swept


def _down_all() -> None:
    with _live_lock:
        clusters = list(_live.values())
    for cluster in clusters:
        with contextlib.suppress(Exception):
            cluster.down()


def _on_sigterm(signum: int, frame: object) -> None:
    """Take this process's clusters down, then exit with status 128 + SIGTERM by raising SystemExit where
    the main thread was: the stack unwinds, so the interrupted code's ``finally`` blocks and context managers
    (temporary directories, work directories) still clean up."""
    _down_all()
    raise SystemExit(128 + signum)


_cleanup_installed = False


def _install_cleanup() -> None:
    """At exit and on SIGTERM (when nobody else handles it), take down every cluster of this process; SIGTERM
    then exits (status 143) through SystemExit, unwinding the stack (:func:`_on_sigterm`)."""
    global _cleanup_installed
    if _cleanup_installed:
        return
    _cleanup_installed = True
    atexit.register(_down_all)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def build(count: int, *, names: Sequence[str] | None = None, shm_size: str = "32g", keep: bool = False) -> Hosts:
    """Build ``count`` hosts (named ``names``, default :func:`default_host_names`); the caller calls :meth:`Hosts.down`.

    ``shm_size`` caps each host's tmpfs (a limit, not an allocation): the default leaves room for the default
    ``env_server.budget_bytes`` (16 GiB), which a durable store checks against its tmpfs at start.

    Raises :class:`HostsUnavailable` when this machine or user cannot (see :func:`unsupported`). ``keep``
    marks the cluster as made from the command line: it outlives this process and only ``down`` removes it.
    The cluster is this call's once it created the cluster's state directory: a name that exists already
    fails without touching what is there; any later failure takes down what this call built.
    """
    reason = unsupported()
    if reason:
        raise HostsUnavailable(reason)
    host_names = list(names) if names is not None else default_host_names(count)
    if not 1 <= len(host_names) <= MAX_HOSTS or len(host_names) != count:
        raise ValueError(f"need 1..{MAX_HOSTS} hosts and one name each, got {count} and {host_names}")
    bad = [n for n in host_names if not HOST_NAME.match(n) or n == BRIDGE]
    if bad or len(set(host_names)) != len(host_names):
        raise ValueError(f"host names must be distinct, match {HOST_NAME.pattern} and not be {BRIDGE!r}: {host_names}")
    sweep()
    cluster = Hosts(_new_cluster_name(), host_names)
    try:
        cluster.state.mkdir(parents=True)  # exclusive: from here on the name is this call's
    except FileExistsError:
        raise RuntimeError(f"cluster {cluster.name} exists already: left as it is") from None
    with _live_lock:
        _live[cluster.name] = cluster
    if not keep:
        _install_cleanup()
    try:
        cluster._up(shm_size)
        if keep:
            (cluster.state / KEEP_MARKER).touch()
    except BaseException:
        cluster.down()
        raise
    if keep:
        with _live_lock:
            _live.pop(cluster.name, None)
    return cluster


def attach(name: str) -> Hosts:
    """A cluster built earlier (by the command line, or another process) by its name."""
    state = STATE_ROOT / name
    if not CLUSTER_NAME.match(name) or not state.is_dir():
        raise KeyError(f"no cluster {name!r} under {STATE_ROOT}")
    lines = (state / "hosts").read_text().splitlines()[2:]
    cluster = Hosts(name, [line.split()[1] for line in lines])
    for host, line in zip(cluster.hosts, lines, strict=True):
        host.address = line.split()[0]
    return cluster


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hosts", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="build a cluster that stays until `down`; prints it as JSON")
    up.add_argument("count", type=int)
    up.add_argument("--names", default="", help="comma-separated host names (default hostA .. hostZ, hostAA, ...)")
    run = commands.add_parser("exec", help="run a command inside one host")
    run.add_argument("cluster")
    run.add_argument("host")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    down = commands.add_parser("down", help="remove these clusters (no name: every kept and every stale one)")
    down.add_argument("clusters", nargs="*")
    commands.add_parser("sweep", help="remove the clusters whose owner process is gone")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            names = args.names.split(",") if args.names else None
            cluster = build(args.count, names=names, keep=True)
            print(json.dumps({"cluster": cluster.name,
                              "hosts": {h.name: {"address": h.address, "netns": h.netns} for h in cluster}}))
        elif args.command == "exec":
            command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not command:
                parser.error("exec needs a command")
            host = attach(args.cluster)[args.host]
            os.execvp("nsenter", host.argv(command))
        elif args.command == "down":
            bad = [name for name in args.clusters if not CLUSTER_NAME.match(name)]
            if bad:  # a pattern or a path would reach other namespaces (their processes) or other directories
                parser.error(f"not cluster names (rbt<pid>-<start>-<n>): {', '.join(map(repr, bad))}")
            names = args.clusters or sorted(
                n for n in _known_clusters() if (STATE_ROOT / n / KEEP_MARKER).exists())
            for name in names:
                _teardown(name)
            for name in names if args.clusters else [*names, *sweep()]:
                print(name)
        else:
            for name in sweep():
                print(name)
    except (HostsUnavailable, KeyError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
