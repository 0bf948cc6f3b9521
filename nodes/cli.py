"""The `refbus` command line: run node roles, watch the event stream, inspect the registry and config."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence

import msgspec

from ..bus.broker import Broker
from ..bus.logs import configure_logging
from ..bus.runtime import BusUnavailable, ExitWatchdog, NodeIdInUse, NodeRuntime, NodeStopped
from ..bus.security import SecurityError, generate
from ..bus.sockets import BindRefused, CannotBind
from ..protocol.messages import id_problem
from .config import Config, ConfigError, add_config_flags, load_config, to_toml
from .halting import CONFIG_STATUS, Transient

DESCRIPTION = """\
refbus: the data plane for asynchronous RL. Per-token training arrays stay on the env servers that made
them and travel by reference; weights go through a parameter server; everything is events and requests
over ZeroMQ between node processes.

Every command but `keys` reads the cluster config: built-in defaults, then --config FILE (or
$REFBUS_CONFIG), then flags (every key has one: `refbus node bus --help` lists them)."""


def run_bus(config: Config, args: argparse.Namespace) -> int:
    settings = config.runtime(node_id=args.node_id or "bus", ready_file=args.ready_file)
    # The broker's endpoint is the cluster's service discovery: its own, fixed port (bus.metrics_port).
    runtime = NodeRuntime("bus", dataclasses.replace(settings, metrics_port=config.bus.metrics_port), register=False)
    Broker(runtime, config.broker())
    runtime.run()
    return 0


# role -> (summary, "module:function"). Modules are imported only for the role that runs, so a process
# never loads what another role needs (an env server must never import torch); the other commands' modules
# are imported when their command runs, for the same reason.
ROLES: dict[str, tuple[str, str]] = {
    "bus": ("the broker: event forwarding, node registry, replay ring", "refbus.nodes.cli:run_bus"),
    "ps-manager": ("parameter-server control plane: versions, manifests, leases, staleness inventory, init",
                   "refbus.nodes.ps.manager:run"),
    "ps-worker": ("parameter-server data plane: shards in shared memory, push/pull, broadcast init",
                  "refbus.nodes.ps.worker:run"),
    "trainer": ("one trainer rank: fetch by reference, train with router replay, push weights",
                "refbus.nodes.rl.trainer:run"),
    "rollout": ("a rollout worker: generate with the latest pulled weights, record per-token arrays",
                "refbus.nodes.rl.rollout:run"),
    "orchestrator": ("groups episodes, ships steps to trainer ranks by reference, deletes what it drops",
                     "refbus.nodes.payload.orchestrator:run"),
    "env-server": ("keeps episode arrays and serves them by reference (keep, claim, fetch, delete)",
                   "refbus.nodes.payload.env_server:run"),
}


def role_entry(role: str) -> Callable[[Config, argparse.Namespace], int]:
    """The entry of ``refbus node <role>``; imports that role's modules and nothing else's."""
    module, _, function = ROLES[role][1].partition(":")
    return getattr(importlib.import_module(module), function)


def _node_id(text: str) -> str:
    """``--node-id``: empty (the default id) or a node id (:func:`~refbus.protocol.messages.id_problem`). One that
    is none is refused here, exit 2, before it names a file of this node's; the broker would refuse it too, at
    every restart."""
    if text and (problem := id_problem(text)):
        raise argparse.ArgumentTypeError(problem)
    return text


def _node_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node-id", default="", type=_node_id,
                        help="node id (default: <role>-<host>-<pid>, or with security.curve_dir set the id its key "
                        "is granted; 'bus' for the broker, trainer-<rank> for a trainer rank)")
    parser.add_argument("--ready-file", default="", metavar="PATH",
                        help="write this node's registry entry as JSON here once it is ready; removed at exit")
    add_config_flags(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refbus", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    node = commands.add_parser("node", help="run one node role in this process",
                               description="Run one node role in this process until SIGINT/SIGTERM.")
    roles = node.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role, (summary, _) in ROLES.items():
        _node_flags(roles.add_parser(role, help=summary, description=f"refbus node {role}: {summary}."))

    monitor = commands.add_parser(
        "monitor", help="print the live event stream",
        description="Subscribe to the event stream and print one line per event. Exits 0 after --count, "
                    "--duration or Ctrl-C, 141 once its reader goes away (`refbus monitor | head`), as a "
                    "tool SIGPIPE killed would, 1 when the output cannot be written otherwise.")
    monitor.add_argument("--json", action="store_true",
                         help="one JSON object per line: type, src, seq, ts, id and the body's fields")
    monitor.add_argument("--since", type=int, default=None, metavar="SEQ",
                         help="first replay the broker's ring: every source's events with seq >= SEQ")
    monitor.add_argument("--kind", action="append", default=[], metavar="KIND",
                         help="only events of this kind (repeatable)")
    monitor.add_argument("--count", type=int, default=0, metavar="N", help="exit after N events")
    monitor.add_argument("--duration", type=float, default=0.0, metavar="SECONDS", help="exit after SECONDS")
    _node_flags(monitor)

    ledger = commands.add_parser(
        "ledger", help="account for every kept blob from the event stream",
        description="Per source and in total: blobs kept, deleted by reason, still held (by whom), leaked (held by "
                    "a node that is gone), lost (named with the node whose death lost them), ownership violations "
                    "(counted in blob ids) and what it could not account for. Reads a `refbus monitor --json` "
                    "file, or the live stream (replayed from the broker's ring) until the launcher's run-end event "
                    "or --duration seconds, then reconciles with every live env server's own counters; Ctrl-C or "
                    "SIGTERM stops it there and prints what it read, not reconciled. Exits 0 when every blob is "
                    "accounted for, 1 when not, 2 when the file cannot be read (missing, unreadable, not "
                    "`refbus monitor --json` records) or the config is refused.")
    ledger.add_argument("file", nargs="?", default=None, help="events file from `refbus monitor --json` ('-': stdin)")
    ledger.add_argument("--json", action="store_true", help="print the report as JSON")
    ledger.add_argument("--duration", type=float, default=0.0, metavar="SECONDS",
                        help="live mode: stop after SECONDS, then reconcile (default: until the run-end event or "
                        "Ctrl-C)")
    _node_flags(ledger)

    up = commands.add_parser(
        "up", help="run a whole cluster on this host: a real async RL loop on a tiny MoE policy",
        description="Start a local cluster (broker, parameter server, env servers, orchestrator, trainer ranks, "
                    "rollout workers; each its own process) from the config, run up.steps steps of asynchronous "
                    "RL with router replay, show progress, stop everything and print a summary. Ctrl-C stops "
                    "the cluster cleanly at any moment.")
    up.add_argument("config_file", nargs="?", default=None, metavar="CONFIG",
                    help="cluster TOML (as --config, which is then not to be given too; default: built-in)")
    up.add_argument("--summary-out", metavar="PATH", help="write the summary as JSON here (a file, not a directory, "
                    "writable, in a directory that exists: checked before anything starts)")
    up.add_argument("--plot-out", metavar="PATH", help="write a PNG plot of reward and fetch time per step here; "
                    "needs matplotlib, the `plot` extra (pip install 'refbus[plot]'): checked before anything "
                    "starts")
    up.add_argument("--keep-logs", action="store_true", help="keep the temporary run directory (logs, config with "
                    "the secret) afterwards, and print its path")
    up.add_argument("--run-dir", metavar="DIR", help="run directory (logs, config, ready files, trainer checkpoints "
                    "in checkpoints/<store.run>; kept, and may be given again: a new run resumes nothing of an "
                    "earlier one unless given its store.run; one launcher at a time: a run directory another refbus "
                    "up is using is refused, exit 2, and one whose launcher was killed is taken once that "
                    "launcher's nodes are gone); default: a temporary one, removed at the end unless --keep-logs")
    up.add_argument("--chaos", type=_positive_seconds, default=0.0, metavar="SECONDS",
                    help="every SECONDS, kill (SIGKILL) a random running env server, rollout worker, ps-worker, "
                    "the ps-manager, the orchestrator or, when world restarts are on (up.checkpoint_every > 0, "
                    "the default), a trainer rank: the supervisor restarts it (a trainer rank's whole world, from "
                    "the last checkpoint), as after any crash. The broker is never killed: it restarts, but each "
                    "of its deaths loses the events it held in flight")
    up.add_argument("--chaos-seed", type=int, default=0, metavar="N",
                    help="seed of the chaos victims' choice: the same seed picks the same sequence (default: 0)")
    add_config_flags(up)

    top = commands.add_parser(
        "top", help="a live table of the nodes: role, host, blobs and bytes held, version, lag, heartbeat age",
        description="Show the broker's registry as a table, refreshed every --interval seconds (redrawn in place "
                    "on a terminal) until Ctrl-C. With no flags it watches the cluster `refbus up` starts. VERSION is "
                    "a node's version (a trainer's: the step it trains); LAG is how many versions it is behind "
                    "the newest version any node reports (0: current; a trainer's step counts as none).")
    top.add_argument("--once", action="store_true", help="print one table and exit")
    top.add_argument("--json", action="store_true",
                     help='print each refresh as one JSON object (one line): {"nodes": [...], "omitted": N}, N the '
                     'live nodes left out of a registry answer cut to the body limit; a refresh that fails: '
                     '{"error": "..."}')
    top.add_argument("--interval", type=_positive_seconds, default=1.0, metavar="SECONDS",
                     help="seconds between refreshes (positive)")
    add_config_flags(top)

    nodes = commands.add_parser("nodes", help="list the live nodes in the broker's registry",
                                description="List the live nodes in the broker's registry. Exit status: 0; 1 when "
                                            "the broker does not answer; 3 when it had to cut its answer to fit its "
                                            "body limit (the nodes that came are listed, the count left out is said "
                                            "on stderr).")
    nodes.add_argument("--role", default="", help="only nodes of this role")
    nodes.add_argument("--json", action="store_true", help="print a JSON array")
    add_config_flags(nodes)

    keys = commands.add_parser("keys", help="make CURVE key pairs and the allow-list of a cluster",
                               description="Manage a CURVE key directory (security.curve_dir).")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    generate_keys = keys_commands.add_parser(
        "generate", help="make the cluster key pair and, with --node-id, one node's key pair",
        description="Make DIR and its cluster server key pair (cluster.key, cluster.key_secret) when missing; DIR "
                    "ends mode 0700 (one another user owns is refused). With --node-id and --role, also make "
                    "that node's key pair (<node-id>.key, <node-id>.key_secret) and add its public key to "
                    "DIR/allow-list as that node id and role. The node ids 'cluster' and 'allow-list' are reserved. "
                    "Secret files are mode 0600 and never printed; existing keys are never replaced.")
    generate_keys.add_argument("dir", metavar="DIR", help="key directory (every host of the cluster reads it)")
    generate_keys.add_argument("--node-id", default="", help="the node id the new key may act as")
    generate_keys.add_argument("--role", default="", help="the role that node runs (bus, env-server, trainer, ...)")

    shm = commands.add_parser("shm", help="manage the durable stores' tmpfs directories",
                              description="Manage the durable stores under store.directory.")
    shm_commands = shm.add_subparsers(dest="shm_command", required=True, metavar="ACTION")
    shm_gc = shm_commands.add_parser(
        "gc", help="remove the store directories no live process holds",
        description="Remove every store directory under store.directory (of --run only, when given) whose lock no "
                    "live process holds: what crashed nodes of ended runs left. A store in use is never touched.")
    shm_gc.add_argument("--run", default="", help="only the stores of this run id (store.run)")
    add_config_flags(shm_gc)

    config = commands.add_parser("config", help="show the effective cluster config",
                                 description="Print the effective config as TOML (defaults, file, flags).")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    add_config_flags(config_commands.add_parser("show", help="print the effective config as TOML"))
    return parser


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


NODES_OMITTED_STATUS = 3
"""``refbus nodes``' exit status when the broker cut its answer to fit its body limit: the nodes that came are
printed, the count left out is said on stderr (a script taking the list for the whole registry must not)."""


def _list_nodes(config: Config, args: argparse.Namespace) -> int:
    runtime = NodeRuntime("cli", config.runtime(), register=False)
    try:
        listed = runtime.listing(args.role)
    finally:
        runtime.close()
    if listed is None:
        raise BusUnavailable(f"no registry from the broker at {config.bus.control}")
    nodes = listed.nodes
    from .top import json_safe, printable

    if args.json:  # strict JSON: a NaN status number is null
        print(json.dumps(json_safe(msgspec.to_builtins(nodes)), indent=2, allow_nan=False))
    else:  # what nodes report is shown escaped: a registry entry cannot drive the terminal
        for info in nodes:
            endpoints = printable(" ".join(f"{k}={v}" for k, v in info.endpoints.items()))
            print(f"{printable(info.node_id):<32} {printable(info.role):<12} {printable(info.host)}:{info.pid:<8} "
                  f"{endpoints}")
    if listed.omitted:
        print(f"refbus: {listed.omitted} nodes left out: the broker cut its answer to the body limit "
              f"(limits.max_body_bytes)", file=sys.stderr)
        return NODES_OMITTED_STATUS
    return 0


def run_ledger(config: Config, args: argparse.Namespace) -> int:
    from .ledger import Ledger, format_report, read_records, reconcile_stores

    ledger = Ledger(max_count=config.limits.max_items)
    unread: list[str] = []  # stores whose counters could not be read: the report cannot vouch for them
    if args.file is not None:
        try:
            with open(args.file) if args.file != "-" else contextlib.nullcontext(sys.stdin) as lines:
                for record in read_records(lines):
                    ledger.apply(record)
        except (OSError, ValueError) as exc:  # missing, a directory, unreadable, not UTF-8, not event records
            print(f"refbus: cannot read the events file {args.file}: {exc}", file=sys.stderr)
            return 2
    else:
        runtime = NodeRuntime("ledger", config.runtime(node_id=args.node_id, ready_file=args.ready_file))
        runtime.subscribe(ledger.apply_message, since=0)
        deadline = time.monotonic() + args.duration if args.duration > 0 else math.inf
        with runtime.stop_on_signals():
            try:
                runtime.start()
                runtime.loop(until=lambda: ledger.ended or time.monotonic() >= deadline)
                if not runtime.stopping:  # the run ended (or the duration passed): ask the stores
                    def settle() -> None:
                        until = time.monotonic() + 0.05
                        runtime.loop(until=lambda: time.monotonic() >= until)

                    unread = reconcile_stores(runtime, ledger.reconcile, settle)
            except NodeStopped:
                pass  # stopped while it joined: what it read (nothing) is reported, as after any stop
            finally:
                runtime.close()
    report = ledger.report()
    report.unaccounted += unread
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1


def _keep_descriptors_to_self() -> None:
    """Make every descriptor this process inherited beyond stdio close-on-exec, as Python makes those it opens:
    what the launcher passed a node (the run directory's lock, held for as long as a process of the run lives)
    stays open in the node, and no process the node or its user code execs inherits it (a helper that outlived
    the run would hold the run directory for good). A child forked without exec is still a copy of the node."""
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            if int(name) > 2 and os.get_inheritable(int(name)):
                os.set_inheritable(int(name), False)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "node":
        _keep_descriptors_to_self()
    if args.command == "keys":
        try:
            print("\n".join(generate(args.dir, args.node_id, args.role)) or "nothing to make: the keys exist")
        except (SecurityError, OSError) as exc:
            print(f"refbus: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        config = load_config(args)
    except ConfigError as exc:
        print(f"refbus: {exc}", file=sys.stderr)
        return CONFIG_STATUS
    # Commands a person runs in a terminal log warnings only: their output is the point, not the log.
    level = config.node.log_level if args.command == "node" else "warning"
    configure_logging(level, config.node.log_format,  # type: ignore[arg-type]
                      cluster=config.cluster.name, role=args.role if args.command == "node" else args.command)
    if args.command == "node":
        # A node process is gone node.shutdown_timeout_s after its stop, whatever runs; it ends as soon as the
        # role is done, without waiting for the interpreter's exit.
        ExitWatchdog.install(failure_status)
        ExitWatchdog.run(lambda: _command(config, args))
    return _command(config, args)


def _held_elsewhere(config: Config, args: argparse.Namespace, exc: Transient) -> int:
    """The exit status of a command that failed on ``exc``: something of its own another process holds (a node's
    durable store), as its predecessor not yet dead may, status 1 (restarted until it exits). Unless the broker
    finds the node's id held by another live process (:meth:`~..bus.runtime.NodeRuntime.check_id`): two processes
    started under one id on one host, which a restart would only find again, :data:`~.halting.CONFIG_STATUS`."""
    held: NodeIdInUse | None = None
    if args.command == "node":
        runtime = NodeRuntime(args.role, config.runtime(node_id=args.node_id), register=False)
        try:
            with contextlib.suppress(BusUnavailable):  # no verdict: the holder may be dying, as status 1 says
                runtime.check_id()
        except NodeIdInUse as refused:
            held = refused
        finally:
            runtime.close()  # before the last words: its log lines must not follow them
    print(f"refbus: {exc}" + (f"; {held}" if held else ""), file=sys.stderr)
    return 1 if held is None else CONFIG_STATUS


def _command(config: Config, args: argparse.Namespace) -> int:
    """Run the command ``args`` names; its exit status. A bus that cannot be reached, an address the operating
    system refuses for a reason that can clear by itself (another process holds it, it is not yet this
    machine's) or a :class:`~.halting.Transient` failure (a durable store its predecessor still holds) is a
    message and status 1 (restartable), config a role finds unusable (a trainer rank without ``$RANK``, an env
    server's entry point that cannot be loaded), an address the operating system refuses for good
    (:class:`~..bus.sockets.BindRefused`: an ipc directory missing, a privileged port), security refuses (a key
    file, an unprotected address other hosts reach) or a node id another live process holds
    (:class:`~..bus.runtime.NodeIdInUse`) a message and :data:`~.halting.CONFIG_STATUS` (as at load:
    final), Ctrl-C status 130, an output whose reader went away (a pipe to ``head``) status 141 (128 + SIGPIPE, as a
    shell reports a tool SIGPIPE killed), a stop that came while the node was starting (:class:`NodeStopped`) 0
    (:func:`failure_status` maps each)."""
    try:
        if args.command == "node":
            return role_entry(args.role)(config, args)
        if args.command == "monitor":
            from .monitor import run_monitor

            return run_monitor(config.runtime(node_id=args.node_id, ready_file=args.ready_file), as_json=args.json,
                               kinds=tuple(args.kind), since=args.since, count=args.count, duration=args.duration)
        if args.command == "ledger":
            return run_ledger(config, args)
        if args.command == "up":
            from .up import run_up

            return run_up(config, args)
        if args.command == "nodes":
            return _list_nodes(config, args)
        if args.command == "top":
            from .top import run_top

            return run_top(config, args)
        if args.command == "shm":
            from .store.durable import gc

            for path in gc(config.store.directory, args.run):
                print(f"removed {path}")
            return 0
        print(to_toml(config), end="")
        return 0
    except Transient as exc:
        return _held_elsewhere(config, args, exc)
    except BrokenPipeError:  # its reader went away (`refbus top --json | head -1`): done, as a SIGPIPE would end it
        from .monitor import reader_gone

        return reader_gone()
    except BaseException as exc:
        status = failure_status(exc)
        if status is None:  # a crash: the traceback says it
            raise
        if not isinstance(exc, KeyboardInterrupt | NodeStopped):  # asked for: nothing to say
            print(f"refbus: {exc}", file=sys.stderr)
        return status


def failure_status(exc: BaseException) -> int | None:
    """The exit status a command ends with when ``exc`` ends it (see :func:`_command`); None for an exception it does
    not map (a crash: status 1, after its traceback). The one mapping: the exit watchdog ends a node process that
    hung after such a failure with the same status (``ExitWatchdog.install``), so a final failure is never turned
    into a restartable one by the hang. A :class:`~.halting.Transient` failure is 1 here; :func:`_command` may make
    it :data:`~.halting.CONFIG_STATUS` once the broker said who holds the node's id (:func:`_held_elsewhere`)."""
    # Before CannotBind: a BindRefused is one.
    if isinstance(exc, ConfigError | SecurityError | BindRefused | NodeIdInUse):
        return CONFIG_STATUS
    if isinstance(exc, Transient | BusUnavailable | CannotBind):
        return 1
    if isinstance(exc, NodeStopped):
        # A stop that came before the node ever joined ends it as a stop of the running node does (0): it was asked
        # for and done, and a node that never ran holds nothing and owes no final events (its bye is said if the
        # broker had welcomed it), so nothing is lost. Whoever stopped it (a launcher tearing a cluster down,
        # Ctrl-C, a scheduler) reads the status it reads for any node it stopped; 1 would report a broker that
        # could not be reached, a failure a supervisor restarts and a person chases, for a wait the stop cut short.
        return 0
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, BrokenPipeError):
        from .monitor import BROKEN_PIPE_STATUS

        return BROKEN_PIPE_STATUS
    return None


if __name__ == "__main__":
    sys.exit(main())
