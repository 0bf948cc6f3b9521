"""`refbus up [CONFIG]`: a whole cluster on this host, running a real asynchronous RL loop.

Starts, each as its own ``refbus node <role>`` process and in dependency order: the broker, the ps-manager,
``up.ps_workers`` ps-workers, ``up.trainers`` trainer ranks (torch.distributed, gloo, rendezvous through a
file), ``up.rollouts`` rollout workers and, once the trainers have published version 0 of the weights (before
that no rollout worker could serve a run), ``up.env_servers`` env servers (replicas of one source) and, last,
the orchestrator (dispatching runs): the stores just before it, so that a relaunch's durable stores, which
give the holders they find gone ``node.restart_grace_s`` from their start, see the orchestrator back well
within it (:func:`_start_nodes`). Every child gets the same cluster config file (the effective config,
written to the run directory), so one TOML describes the run.

While the trainers work, a watcher on the event stream prints one line per version (:mod:`.progress`: step,
reward, episodes per second, samples dropped since the previous line and why, fetch time, bytes held per
store, time elapsed and left). A node that dies is named with its exit status; one that halted the run on
purpose (``halting.HALTED_STATUS``: the orchestrator's halts) ends it, named with its reason; otherwise env
servers, rollout workers, ps-workers, the ps-manager, the orchestrator and the broker are restarted under the
same node id (:mod:`.supervisor`: a restart budget, a backoff; the broker and the ps-manager on the addresses
the first one bound, so the nodes find them again). The trainer ranks checkpoint every ``up.checkpoint_every``
steps (into ``checkpoints/<run>/`` of the run directory, ``<run>`` being ``store.run``: fresh per run unless given, so a
run directory given again starts from step 0): a dead rank stops its world and the whole world is restarted
(a fresh rendezvous file), resuming from the newest checkpoint every rank has (with ``up.checkpoint_every`` 0 a
dead rank ends the run); ``--chaos SECONDS`` kills a random restartable node every SECONDS. When the
trainers have run ``up.steps`` steps (or on Ctrl-C / SIGTERM) the nodes are stopped in order, each group
within ``node.shutdown_timeout_s`` (holders first: the orchestrator, then trainer ranks and rollout workers,
so their deletes reach the stores; env servers last among the data plane: they delete whatever is left; the
PS; the broker last, so every final event reaches the stream), and the summary is printed, and written as
JSON (``--summary-out``) and as a PNG (``--plot-out``, matplotlib).

Accounting: the watcher folds the whole stream into a :class:`~refbus.nodes.ledger.Ledger` live, from the first
event (never from the broker's ring, which keeps only ``bus.ring_events`` events). Once the holders (orchestrator,
trainers, rollouts) have stopped, the launcher restarts at once every env server whose restart is still due (one
that died in the run's last seconds, within its backoff) and waits for it, asks every env server for its own
counters and reconciles them with the fold, publishes ``run-end``, then stops the env servers and folds their last
deletes. The steps and versions the summary counts are the ``version-bump`` events of the node the broker reported
up as the ps-manager; any other sender's are refused (``version_bumps_refused``, the first logged
``up.version_bump_refused``), and one from a sender not reported up yet is held until the broker says which role
it is. The summary's ``kept = deleted + held + lost`` is exact at any run length; what it cannot vouch for is
listed as unaccounted, and so is an env server whose counters could not be read (it did not answer, or is missing
from the registry, or the broker gave no registry): the run is then not ok.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import itertools
import json
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
from array import array
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog

from ..bus.reqrep import RetryPolicy
from ..bus.runtime import NodeRuntime, on_signals
from ..protocol.envelope import Message
from ..protocol.messages import Delete, EpisodeFinished, FetchAck, NodeDown, NodeUp, RunEnd, VersionBump
from .config import Config, ConfigError, to_toml
from .launch import NodeProcess, NodeStartError, StartCancelled, raise_if_exited
from .ledger import LOST, Ledger, LedgerReport, Reconciled, reconcile_stores
from .payload.prompts import TASK_PREFIX
from .progress import FILTERED, Snapshot, progress_line, seconds_left, shares
from .settings import BusSettings
from .store.durable import gc
from .supervisor import BROKER, ENV_PREFIX, ORCHESTRATOR, Chaos, Liveness, Supervisor

log = structlog.get_logger(__name__)

MiB = 1 << 20
POLL_INTERVAL_S = 0.1  # the launcher's main loop: deaths, restarts, chaos, progress lines
STOP_GRACE_FACTOR = 2.0  # a node still running this many node.shutdown_timeout_s after SIGTERM gets SIGKILL
SETTLE_S = 0.05  # how long the launcher lets the watcher fold before it looks again
MANAGER_ROLE = "ps-manager"  # the only role whose ``version-bump`` the summary takes
# ``version-bump`` events from nodes the broker has not reported up yet, held until it says whether each is the
# ps-manager, at most: past it the oldest is dropped (a genuine one comes after its sender's node-up but for
# the rare reordering of two publishers; a flood from unknown senders costs no more).
UNCONFIRMED_BUMPS_MAX = 256
STAT_STARTTIME = 19  # in /proc/PID/stat after the command's ")": field 22, the process's start time
RUN_DIR_LOCK = "up.lock"  # in the run directory: held by the launcher using it and its nodes (:func:`hold_run_dir`)
RUN_DIR_POLL_S = 0.05  # how often a launcher looks whether a killed launcher's nodes have let the run directory go


def _doubles() -> array[float]:
    return array("d")


@dataclasses.dataclass
class RunRecord:
    """What the watcher saw, folded as it arrives: the whole stream goes through :attr:`ledger` (under
    :attr:`lock`, since the launcher's thread reconciles and reads it while the watcher's folds)."""

    started: float = dataclasses.field(default_factory=time.monotonic)
    # Rewards by policy version, as C doubles: 8 bytes an episode, not a float object's 32, since a long run's
    # launcher keeps every one (the summary's start and end fifth, the curve).
    rewards: dict[int, array[float]] = dataclasses.field(default_factory=lambda: defaultdict(_doubles))
    eval_rewards: dict[int, array[float]] = dataclasses.field(default_factory=lambda: defaultdict(_doubles))
    kept_bytes: int = 0
    fetched_bytes: int = 0
    fetch_seconds: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> slowest rank
    failed_micro_batches: int = 0
    versions: list[int] = dataclasses.field(default_factory=list)
    version_seconds: list[float] = dataclasses.field(default_factory=list)
    episodes: int = 0
    # Samples deleted while each version was the latest, by reason (the plot's filtered share per step).
    deleted_by_version: dict[int, Counter[str]] = dataclasses.field(default_factory=lambda: defaultdict(Counter))
    # The prompt source's numbers (the orchestrator's ``task_`` status), as each progress line read them.
    task_by_version: list[tuple[int, dict[str, float]]] = dataclasses.field(default_factory=list)
    ledger: Ledger = dataclasses.field(default_factory=Ledger)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # The broker's node-up/node-down reports, for the supervisor (which takes them on the launcher's thread),
    # each naming the incarnation (pid, start time) of the node's latest node-up.
    liveness: deque[Liveness] = dataclasses.field(default_factory=deque)
    joined: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    # Node ids the broker reported up as the ps-manager (kept once down: a restart keeps the id, and a bump
    # may come after its sender's node-down), and the bumps of senders it has not reported up yet, with when
    # each came, oldest first.
    managers: set[str] = dataclasses.field(default_factory=set)
    unconfirmed_bumps: deque[tuple[str, int, float]] = dataclasses.field(default_factory=deque)
    refused_bumps: int = 0

    def on_event(self, message: Message) -> None:
        with self.lock:
            self.ledger.apply_message(message)
        body = message.body
        if isinstance(body, (NodeUp, NodeDown)) and message.header.src == BROKER:  # the broker's word only
            if isinstance(body, NodeUp):
                node = body.node
                self.joined[node.node_id] = (node.pid, node.started)
                self.liveness.append(Liveness(node.node_id, up=True, pid=node.pid, started=node.started))
                self._confirm_bumps(node.node_id, node.role)
            else:
                pid, started = self.joined.get(body.node_id, (0, 0.0))
                self.liveness.append(Liveness(body.node_id, up=False, pid=pid, started=started, reason=body.reason))
        elif isinstance(body, EpisodeFinished) and not body.again:  # a repeat's episode may have counted already
            self.episodes += 1
            reward = float(body.info.get("reward", 0.0))
            target = self.eval_rewards if body.info.get("eval") else self.rewards
            target[body.policy_version].append(reward)
            self.kept_bytes += sum(ref.nbytes for ref in body.refs)
        elif isinstance(body, FetchAck):
            self.fetched_bytes += body.nbytes
            self.fetch_seconds[body.step] = max(self.fetch_seconds.get(body.step, 0.0), body.seconds)
            self.failed_micro_batches += body.failed
        elif isinstance(body, Delete) and body.reason != LOST:  # a store's mirror of its own removal
            self.deleted_by_version[max(self.versions, default=0)][body.reason] += len(body.blob_ids)
        elif isinstance(body, VersionBump):
            self._on_bump(message.header.src, body.version, time.monotonic() - self.started)

    def _on_bump(self, src: str, version: int, at_s: float) -> None:
        """A ``version-bump`` from ``src``: taken when the broker reported ``src`` up as the ps-manager, refused
        (:meth:`_refuse_bump`) when it reported it up as another role, else held until it does either."""
        if src in self.managers:
            self.versions.append(version)
            self.version_seconds.append(at_s)
        elif src in self.joined:
            self._refuse_bump(src, version)
        else:
            self.unconfirmed_bumps.append((src, version, at_s))
            if len(self.unconfirmed_bumps) > UNCONFIRMED_BUMPS_MAX:
                self._refuse_bump(*self.unconfirmed_bumps.popleft()[:2])

    def _confirm_bumps(self, node_id: str, role: str) -> None:
        """The broker reported ``node_id`` up as ``role``: its held bumps are taken (the ps-manager) or refused."""
        if role == MANAGER_ROLE:
            self.managers.add(node_id)
        held = [bump for bump in self.unconfirmed_bumps if bump[0] == node_id]
        if held:
            self.unconfirmed_bumps = deque(bump for bump in self.unconfirmed_bumps if bump[0] != node_id)
            for src, version, at_s in held:
                self._on_bump(src, version, at_s)

    def _refuse_bump(self, src: str, version: int) -> None:
        """Count a ``version-bump`` not from the ps-manager; the first of each run is logged, naming its sender (a
        sender that floods costs one line)."""
        self.refused_bumps += 1
        if self.refused_bumps == 1:
            log.warning("up.version_bump_refused", src=src, version=version,
                        detail="only the ps-manager's version-bump counts; later ones are counted, not logged")

    def take_liveness(self) -> list[Liveness]:
        """The node-up/node-down reports since the last call, in stream order."""
        taken = []
        while self.liveness:
            taken.append(self.liveness.popleft())
        return taken

    def reconcile(self, node_id: str, incarnation: str, account: Any, *, final: bool) -> Reconciled:
        with self.lock:
            return self.ledger.reconcile(node_id, incarnation, account, final=final)

    def report(self) -> LedgerReport:
        with self.lock:
            return self.ledger.report()

    def saw(self, condition: Callable[[Ledger], bool]) -> bool:
        with self.lock:
            return condition(self.ledger)

    def reward_curve(self) -> list[tuple[int, float]]:
        return [(v, statistics.fmean(r)) for v, r in sorted(self.rewards.items()) if r]

    def snapshot(self) -> Snapshot:
        with self.lock:
            deleted = self.ledger.report().totals()["deleted"]
        return Snapshot(at_s=time.monotonic() - self.started, version=max(self.versions, default=0),
                        episodes=self.episodes, deleted=deleted)

    def seconds_per_step(self) -> list[float]:
        """The time between consecutive versions (one step each)."""
        times = self.version_seconds
        return [round(b - a, 3) for a, b in itertools.pairwise(times)]

    def filtered_share_by_version(self) -> list[tuple[int, float]]:
        """Per version: the share of the samples deleted meanwhile that were ``filtered``."""
        return [(v, counts[FILTERED] / counts.total()) for v, counts in sorted(self.deleted_by_version.items())
                if counts.total()]


class LocalCluster:
    """The processes of one local cluster, started in dependency order and stopped in reverse."""

    def __init__(self, config: Config, workdir: Path, *, cancelled: Callable[[], bool] = lambda: False,
                 inherit: Sequence[int] = ()) -> None:
        self.config = config
        self.cancelled = cancelled
        self.inherit = tuple(inherit)  # file descriptors every node keeps open: the run directory's lock
        self.workdir = workdir
        self.config_file = workdir / "cluster.toml"
        self._write_config()
        self.nodes: list[NodeProcess] = []
        self.worlds = 0  # trainer worlds started before the current one
        self._commands: dict[str, tuple[str, ...]] = {}

    def pin(self, section: str, **values: Any) -> None:
        """Fix config values learned from a started node (its bound endpoint when the config said port 0),
        so the nodes started after it find it."""
        setattr(self.config, section, dataclasses.replace(getattr(self.config, section), **values))
        self._write_config()

    def _write_config(self) -> None:
        """The nodes' config file, secret included, readable by its owner only, and replaced whole: a node
        starting meanwhile reads the old file or the new one, never a truncated one (which would load as all
        defaults)."""
        staged = self.config_file.with_name(f".{self.config_file.name}.new")
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(to_toml(self.config, secrets=True))
        os.replace(staged, self.config_file)

    def start(self, name: str, *command: str, wait: bool = True) -> NodeProcess:
        """Start a node (and wait until it is ready); :class:`StartCancelled` once the run is being stopped."""
        if self.cancelled():
            raise StartCancelled(name)
        self._commands[name] = command
        node = self._spawn(name)
        self.nodes.append(node)
        if wait:
            self.wait_ready(node, self.config.node.connect_timeout_s * 2)
        return node

    def restart(self, dead: NodeProcess) -> NodeProcess:
        """Start an exited node again, same command and node id, in its place in :attr:`nodes` (so the stop
        order holds); does not wait for it to be ready."""
        dead.stop()
        node = self._spawn(dead.name)
        self.nodes[self.nodes.index(dead)] = node
        return node

    def restart_world(self) -> list[NodeProcess]:
        """Stop every trainer rank still running, then start all of them again (same commands and node ids, in
        their places in :attr:`nodes`) on a fresh rendezvous file; does not wait for them to be ready."""
        ranks = self.by_role("trainer")
        self.stop(ranks)
        self.worlds += 1
        self.pin("trainer", init_method=rendezvous(self.workdir, self.config.store.run, self.worlds))
        started = []
        for dead in ranks:
            dead.stop()
            node = self._spawn(dead.name)
            self.nodes[self.nodes.index(dead)] = node
            started.append(node)
        return started

    def _spawn(self, name: str) -> NodeProcess:
        return NodeProcess([*self._commands[name], "--config", str(self.config_file), "--node-id", name],
                           workdir=self.workdir, name=name, pass_fds=self.inherit)

    def wait_ready(self, node: NodeProcess, timeout: float) -> None:
        """Wait for ``node`` to be ready (start-up only: nothing is restarted yet); :class:`NodeStartError` as soon
        as it or any node started before it has exited, naming that one."""
        node.wait_ready(timeout, cancelled=self.cancelled, needs=[other for other in self.nodes if other is not node])

    def by_role(self, prefix: str) -> list[NodeProcess]:
        return [node for node in self.nodes if node.name.startswith(prefix)]

    def stop(self, nodes: Iterable[NodeProcess]) -> None:
        """SIGTERM to all of ``nodes`` at once, then wait for each: each is gone within
        ``node.shutdown_timeout_s``; one still running at twice that gets SIGKILL."""
        nodes = [node for node in nodes if node.proc.poll() is None]
        for node in nodes:
            node.signal(signal.SIGTERM)
        grace = self.config.node.shutdown_timeout_s * STOP_GRACE_FACTOR
        deadline = time.monotonic() + grace
        for node in nodes:
            node.stop(max(0.0, deadline - time.monotonic()))

    def stop_all(self) -> None:
        """Orchestrator, then trainers and rollouts, then env servers, then the PS, the broker last."""
        for prefix in ("orchestrator", "trainer", "rollout", "env", "ps-worker", "ps-manager"):
            self.stop(self.by_role(prefix))
        self.stop(self.by_role("bus"))  # the broker: last, so every node's final events reach the watcher


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse (:class:`ConfigError`) before anything starts what the end of the run could not do: a
    ``--plot-out`` without matplotlib (the ``plot`` extra), a ``--summary-out`` or ``--plot-out`` in a
    directory that does not exist or cannot be written, or naming a directory or a file that cannot be written.
    Found only at the end, the run would be lost to a traceback."""
    for flag, path in (("--summary-out", args.summary_out), ("--plot-out", args.plot_out)):
        if path is None:
            continue
        target = Path(path).absolute()
        directory = target.parent
        if not directory.is_dir():
            raise ConfigError(f"{flag} {path}: no directory {directory}")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {path}: directory {directory} is not writable")
        if target.is_dir():
            raise ConfigError(f"{flag} {path} is a directory: name the file to write")
        if target.exists() and not os.access(target, os.W_OK):
            raise ConfigError(f"{flag} {path}: the file is not writable")
    if args.plot_out is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError(f"--plot-out {args.plot_out} needs matplotlib: install the plot extra "
                              "(pip install 'refbus[plot]')") from None


def run_up(config: Config, args: argparse.Namespace) -> int:
    """Run the local cluster (module docstring); the exit status: 0 when the run is ok, 1 when not (or a node
    failed to start), 130 when interrupted; :class:`ConfigError` before anything starts for outputs the run
    could not write (:func:`check_outputs`). A temporary run directory (no ``--run-dir``) is removed at the end
    whatever happened, unless ``--keep-logs`` (then its path is printed): it holds the secret. A run directory
    another launcher uses is a :class:`ConfigError` too (:func:`hold_run_dir`); one whose launcher was killed is
    taken once that launcher's nodes are gone (at most twice node.shutdown_timeout_s)."""
    check_outputs(args)
    workdir = Path(args.run_dir).absolute() if args.run_dir else Path(tempfile.mkdtemp(prefix="refbus-up-"))
    try:
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file of that name, a parent that is one, no permission
            raise ConfigError(f"--run-dir {workdir}: cannot be made a directory: {exc}") from None
        with hold_run_dir(workdir, config.node.shutdown_timeout_s * STOP_GRACE_FACTOR) as lock:
            return _run(config, args, workdir, lock)
    finally:
        if not args.run_dir and args.keep_logs:  # a given run directory is kept (and may be given again)
            print(f"refbus up: run directory kept: {workdir}", flush=True)
        elif not args.run_dir:
            shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def hold_run_dir(workdir: Path, orphans_s: float = 0.0) -> Iterator[int]:
    """Hold the run directory ``workdir`` for this launcher while the block runs: an exclusive ``flock`` on its
    :data:`RUN_DIR_LOCK`, which names the launcher's pid and start time (:func:`_stamp`: a pid the kernel gave to
    another process since is told from the launcher); yields the lock's file descriptor, for every node the
    launcher starts to inherit (:class:`LocalCluster`): the kernel drops the lock once the last process holding it
    is gone, so a killed launcher's run directory stays held until its nodes, which outlive it by up to
    node.shutdown_timeout_s (their parent-death signal's shutdown) still binding its ports and serving its stores,
    are gone too. A lock held although the launcher it names is gone is such nodes': waited for, at most
    ``orphans_s``. :class:`ConfigError` (before anything is written there) when a live launcher holds it, naming
    that one's pid, when a dead one's nodes still hold it after ``orphans_s``, or when the lock file cannot be
    used. Two launchers on one run directory would each rewrite ``cluster.toml``, which the other's restarted
    nodes read (another run id, so a durable store restarts empty, and another broker), and remove each other's
    ready files; a launcher started while a killed one's nodes still exit would fail to start its own on the
    addresses and stores they hold."""
    path = workdir / RUN_DIR_LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:  # a symlink (ELOOP), a directory, no permission
        raise ConfigError(f"--run-dir {workdir}: cannot use its lock file {path}: {exc}") from None
    try:
        _lock_run_dir(fd, workdir, orphans_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{_stamp(os.getpid())}\n".encode(), 0)
        yield fd
    finally:
        os.close(fd)


def _lock_run_dir(fd: int, workdir: Path, orphans_s: float) -> None:
    """Take the run directory's lock ``fd`` (:func:`hold_run_dir`): at once, or once the nodes of a launcher that
    is gone let it go, within ``orphans_s``; :class:`ConfigError` otherwise."""
    deadline = time.monotonic() + orphans_s
    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            stamp = os.pread(fd, 64, 0).decode(errors="replace").strip()
        holder = stamp.split(" ")[0]
        if not holder.isdigit() or _running(stamp):
            raise ConfigError(f"--run-dir {workdir} is in use by another refbus up (pid "
                              f"{holder if holder.isdigit() else '?'}): one launcher per run directory; wait "
                              "for it to end, or give another --run-dir")
        if time.monotonic() >= deadline:
            raise ConfigError(f"--run-dir {workdir} is still held by nodes of a refbus up that is gone (pid "
                              f"{holder}) after {orphans_s:g} s: find them with `pgrep -af {workdir}` and stop "
                              "them, or give another --run-dir")
        if not waiting:
            waiting = True
            print(f"refbus up: nodes of an earlier refbus up (pid {holder}, gone) still hold --run-dir {workdir}; "
                  f"waiting for them to exit (at most {orphans_s:g} s)", flush=True)
        time.sleep(RUN_DIR_POLL_S)


def _state_and_start(pid: int | str) -> tuple[str, str] | None:
    """Process ``pid``'s state and start time (clock ticks after boot) from ``/proc/PID/stat``, read past the
    command's ")" (a command may hold spaces and parentheses); None when there is no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], fields[STAT_STARTTIME]
    except (OSError, IndexError):
        return None


def _stamp(pid: int) -> str:
    """``PID STARTTIME`` of process ``pid``: what tells it from a later process the kernel gives the same pid; the
    pid alone when it cannot be read."""
    found = _state_and_start(pid)
    return str(pid) if found is None else f"{pid} {found[1]}"


def _running(stamp: str) -> bool:
    """Whether the process a lock file's ``stamp`` (:func:`_stamp`; a bare pid, as older launchers wrote) names
    exists and has not exited (a zombie, not yet reaped by its parent, has): a live process that has its pid but
    started at another time is another process, the launcher being gone."""
    pid, _, started = stamp.partition(" ")
    found = _state_and_start(pid)
    return found is not None and found[0] not in ("Z", "X") and started in ("", found[1])


def _run(config: Config, args: argparse.Namespace, workdir: Path, lock: int) -> int:
    up = config.up
    config = _cluster_config(config, workdir)
    stop = _StopFlag()
    cluster = LocalCluster(config, workdir, cancelled=lambda: stop.requested, inherit=(lock,))
    record = RunRecord(ledger=Ledger(max_count=config.limits.max_items))
    # The watcher's loop runs in its own thread (heartbeats go on while this thread starts processes);
    # registry queries and the stores' counters use a second, non-registering runtime owned by this thread.
    watcher: NodeRuntime | None = None
    probe: NodeRuntime | None = None
    summary: dict[str, Any] = {}
    stopping = False  # set when the main loop ends: the cluster's own shutdown kills nothing as hung
    # A node the broker reports down has a node timeout to re-join (one merely late with its heartbeats does,
    # at its next one) before it is killed as hung.
    supervisor = Supervisor(cluster, budget=up.restart_budget, backoff_s=up.restart_backoff_s,
                            world_restarts=config.trainer.checkpoint_every > 0,
                            world_exit_s=2 * config.bus.node_timeout_s, hung_grace_s=config.bus.node_timeout_s,
                            holder_grace_s=config.node.restart_grace_s, node_timeout_s=config.bus.node_timeout_s,
                            stopping=lambda: stopping or stop.requested)
    print(f"refbus up: {up.steps} steps; logs and config in {workdir}", flush=True)
    # The handlers stay installed until the launcher is done: a second SIGINT/SIGTERM during the shutdown only
    # sets the flag again, so the ordered stop, the accounting, the stores' gc and the summary still happen.
    with stop.on_signals():
        try:
            try:
                bus = cluster.start("bus", "node", "bus")
                cluster.pin("bus", **bound_addresses(cluster.config.bus, bus.info))
                watcher = _watcher(cluster.config, record)
                probe = NodeRuntime("up", cluster.config.runtime(node_id="up"), register=False)
                watcher.start_background()
                _start_nodes(cluster, up, record, stop)
                progress = _Progress(probe, record, up.steps, config.bus.heartbeat_interval_s)
                chaos = (Chaos(cluster, args.chaos, args.chaos_seed, worlds=supervisor.world_restarts,
                               on_kill=supervisor.expect_death) if args.chaos else None)
                while not stop.requested:
                    # The broker's reports first (a node it reported down may hang and is killed, then restarted);
                    # the supervisor sees every exit before the loop asks whether the trainers are all gone:
                    # ranks that failed together start a world restart, not the end of the run.
                    supervisor.heard(record.take_liveness())
                    if supervisor.poll() is not None:
                        break
                    if not supervisor.world_pending and all(t.proc.poll() is not None
                                                            for t in cluster.by_role("trainer")):
                        break
                    if chaos is not None:
                        chaos.poll()
                    progress.poll()
                    stop.wait(POLL_INTERVAL_S)
                progress.poll()
            except StartCancelled:
                pass  # Ctrl-C while starting: account for what ran, then stop it
            stopping = True  # from here on, nothing is killed as hung: the nodes are being stopped
            if watcher is not None and probe is not None:  # else stopped before the broker was up: nothing ran
                print("refbus up: stopping the cluster"
                      + (" (interrupted)" if stop.requested else ""), flush=True)
                # A rank that failed as the last one finished ended the loop before the supervisor saw it.
                failed = [*supervisor.fatal, *(t.name for t in cluster.by_role("trainer")
                                              if t.proc.poll() not in (0, None) and t.name not in supervisor.fatal)]
                peak_rss = max((_peak_rss(node.pid) for node in cluster.by_role("orchestrator")), default=0)
                stop_the_holders(cluster, supervisor, stop)
                problems = _account(cluster, watcher, probe, record, "interrupted" if stop.requested else
                                    "failed" if failed else "done")
                summary = _summary(record, peak_rss, config, interrupted=stop.requested, failed=failed,
                                   problems=problems)
                summary.update(supervisor.report())
        except NodeStartError as exc:
            print(f"refbus up: a node failed to start: {exc}", flush=True)
            return 1
        finally:
            if watcher is not None:
                watcher.join(timeout=10)
            if probe is not None:
                probe.close()
            cluster.stop_all()
            if config.store.durable:  # what nodes that died at the end (or were killed) left behind
                gc(config.store.directory, config.store.run)
        _report(summary, args)
    if stop.requested:
        return 130
    return 0 if summary["ok"] else 1


def bound_addresses(bus: BusSettings, info: dict[str, Any]) -> dict[str, Any]:
    """The broker's config with each ephemeral port (``:0``) replaced by the one the started broker bound (from
    its registry entry ``info``), so a restarted broker binds the same addresses and the nodes find it there.
    Hosts stay as configured (a wildcard bind stays one)."""
    endpoints = info["endpoints"]
    pinned: dict[str, Any] = {}
    for name in ("control", "events_in", "events_out"):
        configured = getattr(bus, name)
        if configured.startswith("tcp://") and configured.endswith(":0"):
            pinned[name] = configured[:-1] + endpoints[name].rsplit(":", 1)[1]
    if bus.metrics_port == 0 and info.get("metrics"):
        pinned["metrics_port"] = urlsplit(info["metrics"]).port
    return pinned


def _watcher(config: Config, record: RunRecord) -> NodeRuntime:
    """The launcher's view of the run: every event from the first (the ledger needs them all), folded into
    ``record``."""
    watcher = NodeRuntime("monitor", config.runtime(node_id="up-watcher"))
    watcher.subscribe(record.on_event, since=0)
    return watcher


def stop_the_holders(cluster: LocalCluster, supervisor: Supervisor, stop: _StopFlag) -> None:
    """The run's end, before its accounting: stop the orchestrator, the trainer ranks and the rollout workers, then
    make at once the restarts still due of the env servers (whose counters the accounting reads) and of the
    orchestrator (stopped as soon as it is ready: its shutdown claims back what its dead predecessor held and
    deletes it). Each exit is noted before the launcher's own stop of that node could cause one: the orchestrator's
    before the stops, the env servers' after them (they run on until the accounting, so one that dies while the
    others stop is restarted too). An orchestrator still starting (restarted in the run's last seconds) is waited
    for before it is stopped, as a restart made here is. Interrupted (``stop``), nothing is restarted or waited
    for."""
    if not stop.requested:
        supervisor.note_exits(ORCHESTRATOR)
        # One restarted in the run's last seconds and still starting would end at the stop before its recovery
        # claimed back what its dead predecessor held (left to the stores' shutdown, reported held at the end).
        _wait_ready(cluster, cluster.by_role(ORCHESTRATOR), stop)
    for prefix in (ORCHESTRATOR, "trainer", "rollout"):
        cluster.stop(cluster.by_role(prefix))
    if not stop.requested:
        supervisor.note_exits(ENV_PREFIX)
    _back_for_the_end(cluster, supervisor, stop, ENV_PREFIX)
    cluster.stop(_back_for_the_end(cluster, supervisor, stop, ORCHESTRATOR))


def _back_for_the_end(cluster: LocalCluster, supervisor: Supervisor, stop: _StopFlag, prefix: str) -> list[NodeProcess]:
    """Restart at once every node named ``prefix``... whose restart is still due (one that died in the run's last
    seconds, within its backoff), and wait for each to be ready (at most twice the connect timeout, until a stop);
    returns them. The env servers: the accounting reads every store's counters, and a store still dead when it does
    is unaccounted though nothing was lost (a durable store's restarted process holds what the dead one kept). The
    orchestrator, once they are back: what it held when it died would be left to the stores' shutdown and reported
    held at the run's end; its restarted process claims it back as it stops. One that does not start is left to the
    accounting, which names what it held."""
    if stop.requested:
        return []  # interrupted: what runs is accounted for and stopped, nothing is started
    started = supervisor.restart_now(prefix)
    _wait_ready(cluster, started, stop)
    return started


def _wait_ready(cluster: LocalCluster, nodes: list[NodeProcess], stop: _StopFlag) -> None:
    """Wait for each of ``nodes`` still running to be ready (at once for one that is), at most twice the connect
    timeout each, until a stop; one that exits or does not get ready meanwhile is left to the accounting."""
    for node in nodes:
        if node.proc.poll() is None:
            with contextlib.suppress(NodeStartError, StartCancelled):
                node.wait_ready(cluster.config.node.connect_timeout_s * 2, cancelled=lambda: stop.requested)


def _account(cluster: LocalCluster, watcher: NodeRuntime, probe: NodeRuntime, record: RunRecord,
             reason: str) -> list[str]:
    """The end of the run's accounting, once the holders have stopped: reconcile the live fold with every env
    server's counters, publish ``run-end``, stop the env servers and fold their last deletes (until the
    broker reports each of them down: bounded by the stop grace plus a node timeout). Returns what could not
    be reconciled: a store that did not answer, or is not in the registry (given a node timeout to re-join a
    restarted broker), or a registry the broker did not give."""
    stores = {s.name for s in cluster.by_role("env")}
    problems = reconcile_stores(probe, record.reconcile, lambda: time.sleep(SETTLE_S), expected=stores,
                                wait_s=cluster.config.bus.node_timeout_s)
    steps = max(record.versions, default=0)
    watcher.call_soon(lambda: watcher.publish(RunEnd(reason=reason, steps=steps)))
    # The end is marked in the fold before a store deletes what holders left behind (``shutdown``).
    _wait_until(record, lambda ledger: ledger.ended, cluster.config.bus.node_timeout_s)
    cluster.stop(cluster.by_role("env"))
    _wait_until(record, lambda ledger: stores <= ledger.down, cluster.config.bus.node_timeout_s * 2 + 1.0)
    watcher.join(timeout=10)
    return problems


class _StopFlag:
    """SIGINT/SIGTERM set it (the launcher then stops the cluster in order); waits wake at once."""

    def __init__(self) -> None:
        self._event = threading.Event()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> None:
        self._event.wait(seconds)

    def on_signals(self) -> contextlib.AbstractContextManager[None]:
        return on_signals(self._event.set)


def _cluster_config(config: Config, workdir: Path) -> Config:
    """The run's config: the given one with the RL loop switched on, and the checkpoints and the rendezvous of
    world 0 in the run dir, keyed by the run id (:func:`checkpoint_dir`, :func:`rendezvous`)."""
    config = dataclasses.replace(config)
    up = config.up
    # A fresh run id: a new run never re-adopts what crashed nodes of an earlier one left in their stores, nor
    # resumes from an earlier run's checkpoints (a run directory may be given again).
    run = config.store.run or f"up-{os.urandom(6).hex()}"
    config.store = dataclasses.replace(config.store, run=run)
    config.orchestrator = dataclasses.replace(config.orchestrator, dispatch=True, trainers=up.trainers,
                                              max_steps=up.steps)
    config.trainer = dataclasses.replace(config.trainer, steps=up.steps, world_size=up.trainers,
                                         init_method=rendezvous(workdir, run, 0), checkpoint_every=up.checkpoint_every,
                                         checkpoint_dir=str(checkpoint_dir(workdir, run)))
    config.env_server = dataclasses.replace(config.env_server, source=config.env_server.source or "env")
    return config


def checkpoint_dir(workdir: Path, run: str) -> Path:
    """Where the trainer ranks of run ``run`` (``store.run``) write their checkpoints: ``checkpoints/<run>`` of
    the run directory. Only a world of the same run resumes from them; each run's stay for inspection."""
    return workdir / "checkpoints" / run


def rendezvous(workdir: Path, run: str, world: int) -> str:
    """The init method of trainer world ``world`` (counted from 0) of run ``run``: the file
    ``gloo-rendezvous-<run>-<world>`` of the run directory, which no earlier world touched. A file already
    there was left by a world of an earlier launcher given the same ``store.run`` (a world's file can outlive
    it): it is removed, since ranks that read it would try to connect to that world's ranks, long gone."""
    # Absolute: in ``file://run/...`` torch would read ``run`` as a host name and the rest as the path.
    path = (workdir / f"gloo-rendezvous-{run}-{world}").absolute()
    path.unlink(missing_ok=True)
    return f"file://{path}"


def _start_nodes(cluster: LocalCluster, up: Any, record: RunRecord, stop: _StopFlag) -> None:
    """Everything after the broker. The orchestrator comes last, once version 0 of the weights exists:
    before that no rollout worker could serve a run. The env servers come just before it, after every slow
    start (trainer ranks' rendezvous and resume, rollout workers' torch import, version 0): a relaunch's durable
    store gives the holders it finds gone (the killed orchestrator) ``node.restart_grace_s`` from its own start to
    come back and claim what they held, and the orchestrator started seconds after it would find it reclaimed."""
    manager = cluster.start("ps-manager", "node", "ps-manager")
    cluster.pin("ps", manager=manager.info["endpoints"]["ps"])
    for i in range(up.ps_workers):
        cluster.start(f"ps-worker-{i}", "node", "ps-worker")
    # Ranks rendezvous with each other before they are ready: start them all, then wait.
    ranks = [cluster.start(f"trainer-{r}", "node", "trainer", "--trainer-rank", str(r), wait=False)
             for r in range(up.trainers)]
    for rank in ranks:
        cluster.wait_ready(rank, cluster.config.node.connect_timeout_s * 4)
    for i in range(up.rollouts):
        cluster.start(f"rollout-{i}", "node", "rollout")
    wait_first_version(cluster, record, stop)
    for i in range(up.env_servers):
        cluster.start(f"env-{i}", "node", "env-server")
    cluster.start("orchestrator", "node", "orchestrator")


def wait_first_version(cluster: LocalCluster, record: RunRecord, stop: _StopFlag) -> None:
    """Wait, at most four connect timeouts, for the trainers' version 0 of the weights. Raises
    :class:`NodeStartError` when it does not come, or at once, naming it with its log tail, when a node started
    so far exits meanwhile (a ps-worker the trainers push to, a rank: waiting on would only time out, unnamed);
    :class:`StartCancelled` on a stop."""
    deadline = time.monotonic() + cluster.config.node.connect_timeout_s * 4
    while not (record.versions or stop.requested or time.monotonic() > deadline):
        raise_if_exited(cluster.nodes, "the trainers published version 0 of the weights")
        stop.wait(0.05)
    if stop.requested:
        raise StartCancelled("orchestrator")
    if not record.versions:
        raise NodeStartError("the trainers did not publish version 0 of the weights in time")


def _wait_until(record: RunRecord, condition: Callable[[Ledger], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not record.saw(condition) and time.monotonic() < deadline:
        time.sleep(SETTLE_S)


def _peak_rss(pid: int) -> int:
    """Peak resident set size of a live process (Linux VmHWM), in bytes; 0 when unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _Progress:
    """One line per new version (:func:`~.progress.progress_line`): the pace, the drops and their reasons since
    the previous line, the fetch time and what each store holds."""

    def __init__(self, probe: NodeRuntime, record: RunRecord, steps: int, lookup_s: float) -> None:
        self.probe = probe
        self.record = record
        self.steps = steps
        self.last = record.snapshot()
        self.lookup_policy = RetryPolicy(timeout_s=lookup_s, attempts=1)

    def poll(self) -> None:
        record = self.record
        # A snapshot folds the ledger's whole report under the watcher's lock: once per new version, not on
        # every turn of the launcher's loop.
        if max(record.versions, default=0) == self.last.version:
            return
        now = record.snapshot()
        recent = [r for v in sorted(record.rewards)[-3:] for r in record.rewards[v]]
        # One short try: a broker that is down (and being restarted) must not hold up the launcher's loop.
        nodes = self.probe.lookup(policy=self.lookup_policy) or []
        held = sorted((n.node_id, n.status["bytes_held"]) for n in nodes if "bytes_held" in n.status)
        task = {name.removeprefix(TASK_PREFIX): value for n in nodes if n.role == "orchestrator"
                for name, value in sorted(n.status.items()) if name.startswith(TASK_PREFIX)}
        if task:
            record.task_by_version.append((now.version, task))
        print(progress_line(self.last, now, steps=self.steps, reward=statistics.fmean(recent) if recent else None,
                            fetch_s=record.fetch_seconds.get(now.version - 1), held=held,
                            left_s=seconds_left(record.version_seconds, now.version, self.steps), task=task),
              flush=True)
        self.last = now


def _summary(record: RunRecord, peak_rss: int, config: Config, *, interrupted: bool, failed: list[str],
             problems: list[str]) -> dict[str, Any]:
    curve = record.reward_curve()
    rewards = [r for _, rs in sorted(record.rewards.items()) for r in rs]
    fifth = max(1, len(rewards) // 5)
    start, end = (statistics.fmean(rewards[:fifth]), statistics.fmean(rewards[-fifth:])) if rewards else (0.0, 0.0)
    report = record.report()
    totals = report.totals()
    fetch = [record.fetch_seconds[s] for s in sorted(record.fetch_seconds)]
    steps = max(record.versions, default=0)
    # The run's correctness: every step trained, every blob accounted for. Learning is reported apart
    # (reward_rose): a few steps of RL need not improve, and that is no failure of the data plane.
    not_ok = [why for why, bad in (
        ("interrupted", interrupted), (f"failed: {', '.join(failed)}", failed),
        (f"{steps} of {config.up.steps} steps", steps < config.up.steps),
        (f"{len(report.violations)} violation findings", report.violations),
        (f"{len(report.unaccounted)} unaccounted", report.unaccounted),
        (f"stores' counters not read ({'; '.join(problems)})", problems),
        (f"lost {dict(report.lost)}", report.lost.total()), (f"leaked {dict(report.leaked)}", report.leaked.total()),
        (f"held at run end {dict(report.held_at_end)}", report.held_at_end.total()),
        (f"{totals['held']} blobs still held", totals["held"])) if bad]
    return {
        "ok": not not_ok,
        "not_ok": not_ok,
        "reward_rose": end > start,
        "interrupted": interrupted,
        "failed_nodes": failed,
        "steps": steps,
        "seconds": round(time.monotonic() - record.started, 1),
        "reward": {"start": round(start, 4), "end": round(end, 4),
                   "by_version": [[v, round(r, 4)] for v, r in curve]},
        "eval_reward": {str(v): round(statistics.fmean(r), 4) for v, r in sorted(record.eval_rewards.items())},
        "bytes": {"by_reference_fetched": record.fetched_bytes, "inline_through_orchestrator": record.kept_bytes},
        "orchestrator_peak_rss_bytes": peak_rss,
        "fetch_seconds_per_step": [round(s, 5) for s in fetch],
        "seconds_per_step": record.seconds_per_step(),
        "deleted_shares": shares(totals["deleted"]),
        "filtered_share_by_version": [[v, round(share, 4)] for v, share in record.filtered_share_by_version()],
        "task_by_version": [[v, task] for v, task in record.task_by_version],
        "blobs": totals,
        "accounting": {"lost": dict(report.lost), "leaked": dict(report.leaked),
                       "held_at_end": dict(report.held_at_end), "inherited": dict(report.inherited),
                       "reconciled": report.reconciled,
                       "unaccounted": report.unaccounted, "stores_unread": problems},
        "violations": report.violations[:50],
        "dropped_micro_batches": record.failed_micro_batches,
        "ps_versions": sorted(set(record.versions)),
        # Not from the ps-manager, or from a sender the broker never reported up: counted in no version.
        "version_bumps_refused": record.refused_bumps + len(record.unconfirmed_bumps),
    }


def _report(summary: dict[str, Any], args: argparse.Namespace) -> None:
    if not summary:
        return
    blobs = summary["blobs"]
    fetch = summary["fetch_seconds_per_step"]
    print("\nsummary")
    print(f"  steps                 {summary['steps']} in {summary['seconds']} s"
          + ("  (interrupted)" if summary["interrupted"] else ""))
    print(f"  reward                start {summary['reward']['start']:.3f} -> end {summary['reward']['end']:.3f}"
          + ("" if summary["reward_rose"] else "  (did not rise)"))
    print(f"  by reference          {summary['bytes']['by_reference_fetched'] / MiB:.2f} MiB fetched by trainers; "
          f"inline would have pushed {summary['bytes']['inline_through_orchestrator'] / MiB:.2f} MiB "
          "through the orchestrator")
    print(f"  orchestrator peak RSS {summary['orchestrator_peak_rss_bytes'] / MiB:.1f} MiB")
    if fetch:
        print(f"  fetch per step        mean {statistics.fmean(fetch) * 1000:.1f} ms, max {max(fetch) * 1000:.1f} ms")
    accounting = summary["accounting"]
    print(f"  blobs                 kept {blobs['kept']} = deleted {blobs['deleted_total']} {blobs['deleted']} "
          f"+ held {blobs['held']} + lost {blobs['lost']} {accounting['lost']}; leaked {blobs['leaked']} "
          f"{accounting['leaked']}")
    stores = ", ".join(f"{s} {r}" for s, r in sorted(accounting["reconciled"].items())) or "none read"
    print(f"  stores' counters      {stores}")
    for line in accounting["unaccounted"]:
        print(f"  unaccounted           {line}")
    for line in accounting["stores_unread"]:
        print(f"  not reconciled        {line}")
    deleted_shares = ", ".join(f"{reason} {share:.1%}" for reason, share in
                               sorted(summary["deleted_shares"].items(), key=lambda item: -item[1]))
    print(f"  why samples left      {deleted_shares or '-'}")
    if task := summary["task_by_version"]:
        print(f"  task                  {_numbers(task[0][1])} at version {task[0][0]} -> {_numbers(task[-1][1])} "
              f"at version {task[-1][0]}")
    print(f"  ownership violations  {blobs['violations']}")
    print(f"  dropped micro batches {summary['dropped_micro_batches']}")
    deaths = ", ".join(f"{d['node']} ({d['exit']}{'' if d['restarted'] else ', not restarted'})"
                       for d in summary["deaths"])
    print(f"  node deaths           {len(summary['deaths'])}{': ' + deaths if deaths else ''}; "
          f"restarts {summary['restarts']}")
    if summary["world_restarts"]:
        print(f"  trainer worlds        restarted {len(summary['world_restarts'])} times from checkpoints "
              f"(after the death of {', '.join(summary['world_restarts'])})")
    print(f"  ps versions           {len(summary['ps_versions'])} (last {max(summary['ps_versions'], default=-1)})")
    print(f"  result                {'ok' if summary['ok'] else 'NOT ok: ' + '; '.join(summary['not_ok'])}",
          flush=True)
    if args.summary_out:
        Path(args.summary_out).write_text(json.dumps(summary, indent=2) + "\n")
    if args.plot_out:
        _plot(summary, Path(args.plot_out))


def _numbers(values: dict[str, float]) -> str:
    return " ".join(f"{name}={value:g}" for name, value in values.items())


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((reward_ax, fetch_ax), (filtered_ax, pace_ax)) = plt.subplots(2, 2, figsize=(10, 7))
    curve = summary["reward"]["by_version"]
    reward_ax.plot([v for v, _ in curve], [r for _, r in curve], marker=".")
    reward_ax.set(title="mean reward by policy version", xlabel="policy version", ylabel="reward")
    fetch = summary["fetch_seconds_per_step"]
    fetch_ax.plot(range(len(fetch)), [s * 1000 for s in fetch], marker=".")
    fetch_ax.set(title="payload fetch per step (slowest rank)", xlabel="step", ylabel="ms")
    filtered = summary["filtered_share_by_version"]
    filtered_ax.plot([v for v, _ in filtered], [share * 100 for _, share in filtered], marker=".")
    filtered_ax.set(title="samples filtered (zero advantage)", xlabel="policy version", ylabel="% of deleted")
    pace = summary["seconds_per_step"]
    pace_ax.plot(range(1, len(pace) + 1), pace, marker=".")
    pace_ax.set(title="time per step", xlabel="step", ylabel="s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
