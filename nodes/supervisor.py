"""What `refbus up` does when a node process dies: name it, restart it when its role allows, or end the run.

Restartable are the roles whose restarted process re-joins under the same node id and rebuilds what it
needs from its peers or its durable store: env servers and ps-workers (they re-adopt the blobs and shards
they committed, docs/STORE.md; without ``store.durable`` what a dead one held is lost), the ps-manager (it
replays its journal of committed versions and the workers register again listing their shards; each rank
of a push in flight starts its push over once the manager is back, unless a rank's shard of it had been
recorded by the dead process: that version cannot commit, the world's next push fails, and the world restarts
from its checkpoint as after a rank's death), rollout workers,
the orchestrator (it takes the step from the trainer ranks and claims back from the env servers what it held)
and the broker (it binds the addresses the first one bound: every node re-joins at its next heartbeat and the
registry is rebuilt from those re-joins; the events the dead one held in flight are lost, and counted where
subscribers see the gap; requests between nodes go on meanwhile).
With trainer checkpoints on (``world_restarts``), the trainer ranks are restarted too, as a world: a rank
that dies (exits non-zero) stops its world (the other ranks exit on their own once the bus reports it down:
they have ``world_exit_s``, then the rest are stopped), and after the backoff every rank starts again
together (``cluster.restart_world``: a fresh rendezvous), resuming from the newest checkpoint every rank
has. A world restart counts as one restart, named after the rank that died first; the other ranks' exits
meanwhile are part of it. Without world restarts a trainer rank's death ends the run, naming it (a trainer rank
that exits 0 has finished its steps). Restarts come out of one budget per run
(``up.restart_budget``; the deaths ``--chaos`` causes are not charged to it), each after a backoff
(``up.restart_backoff_s``, doubled for every earlier restart of the same node, or of the world, up to
:data:`MAX_BACKOFF_FACTOR` times). The doubling guards against crash loops, so it starts over for a node that
ran :data:`STABLE_FACTOR` times the longest backoff before it died: a node that crashes once an hour is
restarted as promptly as after its first crash. The orchestrator's backoff is at most half
``node.restart_grace_s``: its stores reclaim what it held once the grace ends, and its restarted process needs
the other half to start and claim it back (a later restart would lose all of it). An env server's likewise: the
orchestrator declares a store's blobs lost once it has been down that grace, though a durable store's restarted
process would have served them. The broker's is at most half ``bus.node_timeout_s``: while it is down no death is
reported, no node joins, registry lookups fail (a run that ends then cannot read its stores' counters) and every
node holds its events, so a broker that keeps dying is restarted within a node timeout all the same (each restart
still spends the budget, which ends a true crash loop). At the run's end, once the holders have stopped, an env
server's restart still due is made at once (:meth:`Supervisor.restart_now`): the accounting reads its counters;
then the orchestrator's, which is stopped at once: its shutdown claims back what its dead predecessor held and
deletes it.

A node that exits :data:`~.halting.HALTED_STATUS` (the orchestrator's final halts: budgets that cannot hold a
step, a step batch no message can carry) decided that the run cannot go on, and one that exits
:data:`~.halting.CONFIG_STATUS` (2: argparse's usage errors, a config refused at load or by its role, a durable
store that cannot be used as found, a node id the broker finds another live process holding) cannot run as
configured; a restart would only decide it again (and measure again for as long as the budget lasts), so neither
is ever restarted, whatever its role: the run ends at once, named after the node and the reason its last words
give (:func:`~.halting.final_reason`), its death reported ``exit 4, halted`` or ``exit 2, config``. What can clear
by itself (a store lock its predecessor, not yet dead, still holds; an address it still binds; user code an entry
point names that raised while imported or built, :class:`~.entry_points.UserCodeFailed`) exits 1, as a crash:
restarted.

:class:`Chaos` (``refbus up --chaos SECONDS``) kills a random running restartable node with SIGKILL every
SECONDS (trainer ranks included when worlds are restarted; the broker never: each of its deaths costs the
stream the events it held, which a run's ledger may then be unable to vouch for), so a deployment can be
tried against crashes the way the tests do.

A node can also hang: its process alive, its loop stuck (a deadlock, SIGSTOP). The broker then reports it down
(``node-down``, reason ``timeout``), and the launcher's watcher hands such reports (and every ``node-up``) to
:meth:`Supervisor.heard`. A restartable node the broker reported down that has not re-joined within
``hung_grace_s`` (a node merely late with its heartbeats re-joins at its next one) and whose process still runs
is killed with SIGKILL (logged ``up.node_hung``) and restarted as if it had crashed, charged to the budget. Only
the incarnation the report names (pid and start time), once; never on ``bye``, never a node that is already
exiting or due to restart, never while the cluster is being stopped (:func:`kill_hung` decides).
"""

from __future__ import annotations

import dataclasses
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import structlog

from .halting import FINAL_STATUSES, HALTED_STATUS, final_reason
from .launch import NodeProcess

log = structlog.get_logger(__name__)

BROKER = "bus"  # the broker's node name in `refbus up`
ORCHESTRATOR = "orchestrator"
ENV_PREFIX = "env-"
RESTARTABLE_PREFIXES = (ENV_PREFIX, "rollout-", "ps-worker-", "ps-manager", ORCHESTRATOR, BROKER)
"""Node names (as `refbus up` gives them) of the roles that are restarted under the same id."""
TRAINER_PREFIX = "trainer-"
WORLD = "trainer world"  # the name the world's restart is due under
MAX_BACKOFF_FACTOR = 16
STABLE_FACTOR = 4  # a node that ran this many longest backoffs before it died was in no crash loop
HALT_TAIL_LINES = 20  # of a node's log that exited final, searched for why: a halt's words, a thread may log after


class Cluster(Protocol):
    """What the supervisor needs from the launcher's cluster."""

    nodes: list[NodeProcess]

    def restart(self, node: NodeProcess) -> NodeProcess: ...

    def restart_world(self) -> list[NodeProcess]: ...


Incarnation = tuple[int, float]
"""One process: its pid and the wall-clock time just before it was started (``NodeProcess.spawned``)."""


def incarnation(node: NodeProcess) -> Incarnation:
    """What tells ``node``'s process from a later one that gets the same pid."""
    return node.pid, node.spawned


def restartable(name: str, *, worlds: bool = False) -> bool:
    """Whether a node of this name is restarted; ``worlds``: trainer ranks are (as a world)."""
    return name.startswith(RESTARTABLE_PREFIXES) or (worlds and name.startswith(TRAINER_PREFIX))


def describe_exit(code: int) -> str:
    """``SIGKILL`` for a process killed by a signal, ``exit 1`` for one that exited."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


@dataclasses.dataclass(frozen=True)
class Liveness:
    """What the broker said about one node process: ``node-up`` (``up``) or ``node-down`` (with its reason). The
    incarnation (pid and wall-clock start) is the one the node registered with (its latest ``node-up``); pid 0
    when no ``node-up`` of it was seen."""

    node: str
    up: bool
    pid: int = 0
    started: float = 0.0  # the node's wall-clock start (NodeInfo.started)
    reason: str = ""  # node-down: "bye", "timeout", "replaced"


@dataclasses.dataclass(frozen=True)
class Watched:
    """The supervised process a report names, as the supervisor sees it when it decides."""

    name: str
    pid: int
    spawned: float  # wall-clock time just before the process was started
    running: bool  # it has not exited
    exiting: bool  # dead and due to restart, killed on purpose (chaos), or its trainer world is restarting
    killed: bool  # already killed as hung


HUNG = "timeout"  # the node-down reason that can mean a hung process (not "bye", not "replaced")


def kill_hung(down: Liveness, process: Watched | None, *, stopping: bool, worlds: bool = False) -> bool:
    """Whether the node-down ``down`` means that ``process`` hangs and must be killed (then restarted):
    a missed-heartbeats report about this very incarnation of a restartable node whose process still runs,
    not yet killed for it, while the cluster is not being stopped."""
    return (not stopping and not down.up and down.reason == HUNG and process is not None
            and restartable(process.name, worlds=worlds)
            and down.pid == process.pid and down.started >= process.spawned  # this incarnation, not a reused pid
            and process.running and not process.exiting and not process.killed)


@dataclasses.dataclass(frozen=True)
class Death:
    """One node process that ended while the run went on."""

    node: str
    pid: int
    exit: str  # describe_exit()
    at_s: float  # seconds into the run
    restarted: bool  # False: the run ended because of it, or before its restart was due


class Supervisor:
    """Polled by the launcher's main loop (one thread): notices every exit, restarts or gives up.

    The supervisor owns the decision; the cluster owns the processes (``cluster.restart`` starts a node
    again under its name and replaces it in ``cluster.nodes``). ``say`` prints a progress line."""

    def __init__(self, cluster: Cluster, *, budget: int, backoff_s: float, say: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic, world_restarts: bool = False,
                 world_exit_s: float = 0.0, hung_grace_s: float = 0.0, holder_grace_s: float = 0.0,
                 node_timeout_s: float = 0.0, stopping: Callable[[], bool] = lambda: False) -> None:
        self.cluster = cluster
        self.world_restarts = world_restarts
        self.world_exit_s = world_exit_s  # how long the other ranks of a broken world have to exit on their own
        self.world_restarted: list[str] = []  # per world restart made, the rank whose death caused it
        self.budget = budget
        self.backoff_s = backoff_s
        self.holder_grace_s = holder_grace_s  # node.restart_grace_s: the orchestrator's backoff stays within half
        self.node_timeout_s = node_timeout_s  # bus.node_timeout_s: the broker's backoff stays within half
        self.say = say
        self.clock = clock
        self.started = clock()
        self.deaths: list[Death] = []
        self.fatal: list[str] = []  # nodes whose death ended the run
        self.restarts = 0  # restarts made (not those still due when the run ended)
        self.charged = 0  # restarts out of the budget: deaths nobody caused on purpose
        # Processes killed on purpose (chaos), by incarnation: their restarts are not charged. Not by pid alone:
        # a later process may get a dead one's pid.
        self._deliberate: set[Incarnation] = set()
        self._per_node: Counter[str] = Counter()
        self._running_since: dict[str, float] = {}  # name (or WORLD) -> when it was last restarted
        # name -> (restart time, the dead process, its death's index in deaths)
        self._due: dict[str, tuple[float, NodeProcess, int]] = {}
        self.hung_grace_s = hung_grace_s  # how long a node reported down has to re-join before it is killed
        self.stopping = stopping  # the cluster is being stopped: nothing is killed as hung
        self._suspect: dict[str, tuple[float, Liveness]] = {}  # name -> (kill time, the node-down)
        self._hung: set[Incarnation] = set()  # processes killed as hung (once per incarnation)

    def expect_death(self, node: NodeProcess) -> None:
        """``node`` is being killed on purpose (``--chaos``): its restart does not come out of the budget,
        which guards against crash loops, not against the deaths a user asked for."""
        self._deliberate.add(incarnation(node))

    @property
    def world_pending(self) -> bool:
        """A trainer world is down and due to start again: the run is not over although no rank runs."""
        return WORLD in self._due

    def heard(self, reports: Iterable[Liveness]) -> None:
        """The broker's ``node-up`` and ``node-down`` reports, in stream order: a node reported down that may
        hang becomes suspect (killed at :meth:`poll` once ``hung_grace_s`` passed); its re-join clears it."""
        for report in reports:
            suspect = self._suspect.get(report.node)
            if report.up:
                if suspect is not None and (suspect[1].pid, suspect[1].started) == (report.pid, report.started):
                    del self._suspect[report.node]  # it was late, not hung: it re-joined
            elif self._may_hang(report):
                self._suspect[report.node] = (self.clock() + self.hung_grace_s, report)

    def _watched(self, name: str) -> tuple[NodeProcess, Watched] | None:
        node = next((n for n in self.cluster.nodes if n.name == name), None)
        if node is None:
            return None
        trainer = name.startswith(TRAINER_PREFIX)
        exiting = name in self._due or incarnation(node) in self._deliberate or (trainer and self.world_pending)
        return node, Watched(name, node.pid, node.spawned, node.proc.poll() is None, exiting,
                             incarnation(node) in self._hung)

    def _may_hang(self, down: Liveness) -> bool:
        watched = self._watched(down.node)
        return kill_hung(down, watched and watched[1], stopping=self.stopping(), worlds=self.world_restarts)

    def _kill_hung(self, now: float) -> None:
        for name, (due, down) in list(self._suspect.items()):
            if due > now:
                continue
            del self._suspect[name]
            watched = self._watched(name)
            if watched is None or not kill_hung(down, watched[1], stopping=self.stopping(),
                                                worlds=self.world_restarts):
                continue
            node = watched[0]
            why = f"the broker reports it down ({down.reason}: missed heartbeats) while its process runs"
            self._hung.add(incarnation(node))
            log.warning("up.node_hung", node=name, pid=node.pid, reason=down.reason, detail=why)
            self.say(f"refbus up: {name} (pid {node.pid}) hangs: {why}; killing it (SIGKILL)")
            node.signal(signal.SIGKILL)

    def _world_killed_on_purpose(self) -> bool:
        """Whether a rank of the trainer world was killed on purpose (chaos) and is dead: then a partner's exit
        follows from that kill (their collective broke), whichever of the two deaths a poll finds first."""
        for rank in self.cluster.nodes:
            if (rank.name.startswith(TRAINER_PREFIX) and incarnation(rank) in self._deliberate
                    and rank.proc.poll() is not None):
                self._deliberate.discard(incarnation(rank))
                return True
        return False

    def poll(self) -> str | None:
        """Kill the nodes found hung, handle every node that exited since the last poll and start the restarts
        that are due; the reason the run cannot go on, or None."""
        now = self.clock()
        self._kill_hung(now)
        for node in self.cluster.nodes:
            code = node.proc.poll()
            trainer = node.name.startswith(TRAINER_PREFIX)
            if code is None or node.name in self._due or (trainer and (code == 0 or self.world_pending)):
                continue
            reason = self._on_death(node, code, now)
            if reason:
                return reason
        self._restart([name for name, (due, _, _) in self._due.items() if due <= now], now)
        return None

    def note_exits(self, prefix: str) -> None:
        """At the run's end, before the launcher stops any of them (an exit its stop causes is no death): handle the
        deaths the last poll did not see of the nodes whose names start with ``prefix``."""
        now = self.clock()
        for node in self.cluster.nodes:
            code = node.proc.poll()
            if (node.name.startswith(prefix) and code is not None and node.name not in self._due
                    and node.name not in self.fatal):
                self._on_death(node, code, now)

    def restart_now(self, prefix: str) -> list[NodeProcess]:
        """At the run's end, for the nodes whose names start with ``prefix`` (the env servers, whose counters the
        accounting reads; the orchestrator, whose stop deletes what it held): make every restart of theirs still
        due (:meth:`note_exits` first) at once, not after its backoff (which guards a run that goes on against crash
        loops). A death that ends the run (a final exit, the budget spent) is still not restarted. Returns the
        processes started, not waited for."""
        return self._restart([name for name in self._due if name.startswith(prefix)], self.clock())

    def _restart(self, names: list[str], now: float) -> list[NodeProcess]:
        """Make the restarts due under ``names`` (node names, or WORLD); returns the processes started."""
        started = []
        for name in names:
            _, node, death = self._due.pop(name)
            self._running_since[name] = now
            if name == WORLD:
                ranks = self.cluster.restart_world()
                started.extend(ranks)
                self.world_restarted.append(node.name)
                pids = ", ".join(f"{rank.name} pid {rank.pid}" for rank in ranks)
                self.say(f"refbus up: trainer world restarted from its checkpoint ({pids})")
            else:
                new = self.cluster.restart(node)
                started.append(new)
                self.say(f"refbus up: {name} restarted (pid {new.pid})")
            # Counted once made: a run that ends within a backoff has not restarted the node.
            self.restarts += 1
            self.deaths[death] = dataclasses.replace(self.deaths[death], restarted=True)
        return started

    def _on_death(self, node: NodeProcess, code: int, now: float) -> str | None:
        process = incarnation(node)
        hung, deliberate = process in self._hung, process in self._deliberate
        # A death is handled once: what was noted about this process is not needed again.
        self._hung.discard(process)
        self._deliberate.discard(process)
        final = FINAL_STATUSES.get(code, "")
        exit_text = describe_exit(code) + (", hung" if hung else f", {final}" if final else "")
        at_s = round(now - self.started, 1)
        world = self.world_restarts and node.name.startswith(TRAINER_PREFIX)
        deliberate = deliberate or (world and self._world_killed_on_purpose())
        if final:  # it halted the run, or cannot run as configured: a restart would decide it again
            what = "halted the run" if code == HALTED_STATUS else "cannot run as configured"
            why = f"{node.name} {what} ({exit_text}): {final_reason(code, node.log_tail(HALT_TAIL_LINES))}"
        elif not restartable(node.name, worlds=self.world_restarts):
            why = f"{node.name} died ({exit_text}); it is not restartable: the run cannot go on"
        elif not deliberate and self.charged >= self.budget:
            why = f"{node.name} died ({exit_text}); the restart budget ({self.budget}) is spent: the run ends"
        else:
            key = WORLD if world else node.name
            delay = self._backoff_s(key, node.name, now)
            if world:
                delay = max(delay, self.world_exit_s)
            self.charged += not deliberate  # out of the budget now: the restart is due, whenever it is made
            self._per_node[key] += 1
            self._due[key] = (now + delay, node, len(self.deaths))
            self.deaths.append(Death(node.name, node.pid, exit_text, at_s, restarted=False))
            count = "chaos, not charged" if deliberate else f"restart {self.charged}/{self.budget}"
            if world:
                self.say(f"refbus up: {node.name} died ({exit_text}); stopping its trainer world and restarting "
                         f"it from the last checkpoint in {delay:.1f} s ({count})")
            else:
                self.say(f"refbus up: {node.name} died ({exit_text}); restarting it in {delay:.1f} s ({count})")
            return None
        self.deaths.append(Death(node.name, node.pid, exit_text, at_s, restarted=False))
        self.fatal.append(node.name)
        self.say(f"refbus up: {why}\n{node.log_tail(10)}")
        return why

    def _backoff_s(self, key: str, name: str, now: float) -> float:
        """How long the restart of ``key`` (a node's name, or WORLD) waits after the death of ``name``."""
        if now - self._running_since.get(key, self.started) >= STABLE_FACTOR * self.backoff_s * MAX_BACKOFF_FACTOR:
            self._per_node[key] = 0  # it ran long enough: this death is no crash loop
        delay = self.backoff_s * min(2 ** self._per_node[key], MAX_BACKOFF_FACTOR)
        if (name == ORCHESTRATOR or name.startswith(ENV_PREFIX)) and self.holder_grace_s > 0:
            delay = min(delay, self.holder_grace_s / 2)
        if name == BROKER and self.node_timeout_s > 0:
            delay = min(delay, self.node_timeout_s / 2)
        return delay

    def report(self) -> dict[str, Any]:
        """The summary's part: every death (node, pid, exit, when, restarted: False for one whose restart was
        still due), the restarts made and the trainer worlds restarted."""
        return {"restarts": self.restarts, "deaths": [dataclasses.asdict(d) for d in self.deaths],
                "world_restarts": list(self.world_restarted)}


class Chaos:
    """Every ``interval_s``, SIGKILL one running restartable node, chosen by a generator seeded with ``seed``
    (the same seed and interval pick the same sequence of names). Trainer ranks are chosen only with
    ``worlds`` (checkpoints on: the supervisor restarts their world)."""

    def __init__(self, cluster: Cluster, interval_s: float, seed: int, *, say: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic, worlds: bool = False,
                 on_kill: Callable[[NodeProcess], None] = lambda node: None) -> None:
        self.worlds = worlds
        self.on_kill = on_kill
        if not interval_s > 0:
            raise ValueError(f"the chaos interval must be positive, not {interval_s}")
        self.cluster = cluster
        self.interval_s = interval_s
        self.rng = random.Random(seed)
        self.say = say
        self.clock = clock
        self.due = clock() + interval_s
        self.killed: list[str] = []

    def poll(self) -> None:
        now = self.clock()
        if now < self.due:
            return
        self.due = now + self.interval_s
        running = sorted((n for n in self.cluster.nodes if n.name != BROKER
                          and restartable(n.name, worlds=self.worlds) and n.proc.poll() is None),
                         key=lambda n: n.name)
        if not running:
            return
        victim = self.rng.choice(running)
        self.killed.append(victim.name)
        self.on_kill(victim)
        self.say(f"refbus up: chaos: SIGKILL to {victim.name} (pid {victim.pid})")
        victim.signal(signal.SIGKILL)
