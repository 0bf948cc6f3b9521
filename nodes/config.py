"""Cluster configuration: one TOML file per cluster, an embedded default, every key a CLI flag.

Precedence, lowest first: the defaults below (the embedded config; ``refbus config show`` prints it as
TOML), the file given with ``--config`` (or ``$REFBUS_CONFIG``), then flags. Every key ``section.key``
has the flag ``--section-key`` (underscores become dashes). Unknown sections or keys in a file are errors,
so a typo never silently falls back to a default. ``$REFBUS_SECRET`` overrides ``security.secret``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from ..bus.broker import BrokerSettings
from ..bus.reqrep import MIN_TIMEOUT_S, RetryPolicy
from ..bus.runtime import RuntimeSettings
from ..bus.sockets import ENDPOINT_SCHEMES, endpoint_problem, host_problem
from ..protocol.envelope import ONE_FRAME_OVERHEAD, Limits, largest_frame
from ..protocol.errors import shown
from ..protocol.messages import plain_name, run_id_problem
from .settings import (
    BusSettings,
    ClusterSettings,
    EnvServerSettings,
    LimitsSettings,
    NodeSettings,
    OrchestratorSettings,
    PsSettings,
    RequestsSettings,
    RlSettings,
    RolloutSettings,
    SecuritySettings,
    StoreSettings,
    TrainerSettings,
    UpSettings,
)


@dataclass
class Config:
    """The effective cluster config: one frozen section per TOML table (declared in :mod:`.settings`)."""

    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    bus: BusSettings = field(default_factory=BusSettings)
    node: NodeSettings = field(default_factory=NodeSettings)
    requests: RequestsSettings = field(default_factory=RequestsSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    env_server: EnvServerSettings = field(default_factory=EnvServerSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    orchestrator: OrchestratorSettings = field(default_factory=OrchestratorSettings)
    rl: RlSettings = field(default_factory=RlSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    up: UpSettings = field(default_factory=UpSettings)
    ps: PsSettings = field(default_factory=PsSettings)

    def retry(self) -> RetryPolicy:
        """The retry policy of every request (``[requests]``)."""
        requests = self.requests
        return RetryPolicy(requests.timeout_s, requests.attempts, requests.backoff, requests.max_timeout_s)

    def runtime(self, *, node_id: str = "", ready_file: str = "") -> RuntimeSettings:
        """What the node runtime needs from this config."""
        extra = {"host": self.node.host} if self.node.host else {}
        return RuntimeSettings(
            bus=self.bus.control,
            node_id=node_id,
            secret=self.security.secret.encode(),
            heartbeat_interval_s=self.bus.heartbeat_interval_s,
            connect_timeout_s=self.node.connect_timeout_s,
            shutdown_timeout_s=self.node.shutdown_timeout_s,
            metrics_host=self.node.metrics_host,
            metrics_port=self.node.metrics_port,
            ready_file=ready_file,
            limits=Limits(self.limits.max_body_bytes, self.limits.max_message_bytes, self.limits.max_depth,
                          self.limits.max_items),
            retry=self.retry(),
            max_frame_bytes=self.limits.max_frame_bytes,
            curve_dir=self.security.curve_dir,
            curve_key=self.security.curve_key,
            insecure=self.security.insecure,
            **extra,
        )

    def store_run(self) -> str:
        """The run the durable stores of this cluster's nodes belong to: ``store.run``, else one per cluster
        name and broker endpoint, so every node of a cluster (env servers, ps-workers, the ps-manager) finds its
        own store of that run after a restart."""
        return self.store.run or f"{self.cluster.name}-{self.bus.control}"

    def broker(self) -> BrokerSettings:
        return BrokerSettings(
            control=self.bus.control,
            events_in=self.bus.events_in,
            events_out=self.bus.events_out,
            ring_events=self.bus.ring_events,
            ring_bytes=self.bus.ring_bytes,
            event_batch=self.bus.event_batch,
            node_timeout_s=self.bus.node_timeout_s,
            cluster=self.cluster.name,
            max_nodes=self.bus.max_nodes,
        )


class ConfigError(ValueError):
    """A config file, flag or combination of keys that cannot be used; the message names the keys."""


# --- relations between keys ----------------------------------------------------------------------------

RETRY_SCHEDULE = "requests.*"
"""In a relation: the request retry schedule, the sum of every attempt's timeout (``Config.retry``)."""


@dataclass(frozen=True)
class Relation:
    """``key`` must exceed ``factor`` times the sum of ``bound``: each a ``section.key`` or
    :data:`RETRY_SCHEDULE`. ``why``: what goes wrong otherwise (error message and README)."""

    key: str
    bound: tuple[str, ...]
    why: str
    factor: float = 1.0

    def rule(self) -> str:
        total = " + ".join(_label(name) for name in self.bound)
        if self.factor != 1:
            total = f"{self.factor:g} * ({total})" if len(self.bound) > 1 else f"{self.factor:g} * {total}"
        return f"{_label(self.key)} > {total}"


# Checked by ``load_config``, in this order; adding a rule is one line.
RELATIONS: tuple[Relation, ...] = (
    Relation("bus.node_timeout_s", ("bus.heartbeat_interval_s",), factor=3,
             why="a node that misses two heartbeats in a row (a lost message, a busy host) is not declared down"),
    Relation(RETRY_SCHEDULE, ("bus.node_timeout_s",),
             why="a request never gives up on a peer that the broker still counts as live; a dead peer is "
                 "reported down before requests to it time out"),
    Relation("env_server.handover_lease_s", ("bus.node_timeout_s", "node.restart_grace_s", RETRY_SCHEDULE),
             why="an orchestrator that stalls just short of being declared down, or is restarted within the "
                 "grace, and then needs every retry of its claim still finds the episode's blobs"),
    Relation("orchestrator.group_timeout_s", ("env_server.generate_timeout_s",),
             why="a group is not dropped as incomplete while its runs may still be generating"),
    Relation("trainer.batch_timeout_s", ("orchestrator.group_timeout_s",),
             why="a rank does not fail its step while a group the step needs may still complete"),
    Relation("ps.lease_ttl_s", ("requests.timeout_s",),
             why="a push or pull grant answered again after a lost reply (the reply cache resends it one "
                 "attempt later) is still live when it arrives"),
)


def _label(name: str) -> str:
    return "the request retry schedule (requests.*)" if name == RETRY_SCHEDULE else name


def _quantity(config: Config, name: str) -> Any:
    if name == RETRY_SCHEDULE:
        return sum(config.retry().timeouts())
    section, _, key = name.partition(".")
    return getattr(getattr(config, section), key)


CHOICES: dict[str, tuple[str, ...]] = {
    "ps.transport": ("frames", "nixl"),
    "node.log_level": ("debug", "info", "warning", "error"),
    "node.log_format": ("auto", "json", "console"),
}
"""Keys that take one of a few words."""

ENDPOINTS: tuple[str, ...] = ("bus.control", "bus.events_in", "bus.events_out", "ps.manager", "ps.worker",
                              "env_server.endpoint", "trainer.endpoint", "rollout.endpoint")
"""Keys that take a ZeroMQ endpoint (:func:`~refbus.bus.sockets.endpoint_problem`): checked here, so a typo is an
error naming its key, not a ZeroMQ error (or a wrapped port) in whichever node binds or connects it."""

HOSTS: dict[str, bool] = {"node.host": True, "node.metrics_host": False}
"""Keys that take a host name or IP address (:func:`~refbus.bus.sockets.host_problem`), each with whether it may
be empty (``node.host``: this machine's host name)."""

MAX_PREFIX_CHARS = 128
"""Characters of ``ps.shm_prefix`` at most: a segment's file name adds a token and a number to it."""

RANGES: dict[str, tuple[float, float | None]] = {
    "bus.event_batch": (1, 65_535),
    "bus.ring_events": (1, 1 << 30),
    "bus.ring_bytes": (1, None),
    "bus.max_nodes": (1, None),
    "bus.metrics_port": (-1, 65_535),
    "node.metrics_port": (-1, 65_535),
    "requests.attempts": (1, 1_000),
    "requests.backoff": (1, None),
    "limits.max_body_bytes": (1, None),
    "limits.max_message_bytes": (1, None),
    "limits.max_frame_bytes": (-1, None),
    "limits.max_depth": (1, None),
    "limits.max_items": (1, None),
    "env_server.budget_bytes": (1, None),
    "env_server.max_new_tokens": (1, None),
    "orchestrator.seq_len": (1, None),
    "orchestrator.group_size": (1, None),
    "orchestrator.groups_per_step": (1, None),
    "orchestrator.max_staleness": (0, None),
    "orchestrator.max_steps": (0, None),
    "orchestrator.trainers": (1, None),
    "orchestrator.seed": (0, None),
    "orchestrator.max_groups_in_flight": (1, None),
    "orchestrator.eval_every": (0, None),
    "rl.top_k_logprobs": (1, None),
    "rl.sampling_top_k": (1, None),
    "rl.torch_threads": (1, None),
    "trainer.rank": (-1, None),
    "trainer.world_size": (-1, None),
    "trainer.steps": (0, None),
    "trainer.skip_limit": (0, None),
    "trainer.checkpoint_every": (0, None),
    "up.steps": (1, None),
    "up.env_servers": (1, None),
    "up.trainers": (1, None),
    "up.rollouts": (1, None),
    "up.ps_workers": (1, None),
    "up.restart_budget": (0, 1 << 30),
    "up.checkpoint_every": (0, None),
    "ps.retain_versions": (1, None),
    "ps.max_free_segments": (0, None),
    "ps.max_open_bytes": (0, None),
    "ps.eta": (0, None),
    "ps.batch_size": (1, None),
    "ps.chunk_bytes": (1, None),
    "ps.replicas": (1, None),
}
"""Keys that take a number within bounds (inclusive; None: no upper bound): every whole number but the weights'
seed, and the retry backoff (below 1 each attempt would wait less than the one before, down to no wait at all).
A count below its floor need not fail where it is read, but misleads elsewhere: with ``up.checkpoint_every = -1``
the ranks would checkpoint every step while the launcher, taking it for "off", would end the run at a rank's
death."""

POSITIVE: dict[str, float | None] = {
    "rl.lr": None,
    "rl.temperature": None,
    "env_server.high_water": 1.0,
}
"""Real numbers that must be above 0 (and at most the bound given; None: no upper bound): a learning rate of 0
trains nothing, a temperature of 0 divides the logits by 0, an env server full at 0 or never full above 1 is
refused where it starts."""

MAY_BE_ZERO: frozenset[str] = frozenset({"node.restart_grace_s", "up.restart_backoff_s"})
"""Durations for which 0 means "none" (no grace, no backoff); every other ``*_s`` key must be at least
:data:`MIN_DURATION_S`."""

MIN_DURATION_S = MIN_TIMEOUT_S
"""The shortest duration (any ``*_s`` key but 0 where :data:`MAY_BE_ZERO`), one millisecond: a shorter interval
spins a node's timers as a zero one would, a shorter timeout is over before a reply can arrive, and a request
timeout below it is refused by :class:`~refbus.bus.reqrep.RetryPolicy`."""

MAX_DURATION_S = 365 * 24 * 3600.0
"""The longest duration (any ``*_s`` key): longer is a typo, and far longer overflows where a node converts
it (a ``timedelta``, a thread's wait)."""


def _durations() -> list[str]:
    return [f"{section_name}.{key.name}" for section_name, section in _sections(Config())
            for key in dataclasses.fields(section) if key.name.endswith("_s")]


def _floats() -> list[str]:
    return [f"{section_name}.{key.name}" for section_name, section in _sections(Config())
            for key in dataclasses.fields(section) if isinstance(getattr(section, key.name), float)]


def check_relations(config: Config) -> None:
    """Raise :class:`ConfigError` naming the first key of :data:`CHOICES` set to another word, the first of
    :data:`ENDPOINTS` that is no endpoint and of :data:`HOSTS` that is no host, a ``store.run`` that is no run id
    (:func:`~refbus.protocol.messages.run_id_problem`: it names directories) or a ``ps.shm_prefix`` that is no part
    of one file name, the first number that is not
    finite (nan, inf), the first duration (every ``*_s`` key) below :data:`MIN_DURATION_S` (but 0 where
    :data:`MAY_BE_ZERO`) or above :data:`MAX_DURATION_S`, the first of :data:`RANGES` or :data:`POSITIVE` out of
    bounds, a frame cap (``limits.max_frame_bytes``) below :func:`~refbus.protocol.envelope.largest_frame`, or
    both sides of the first relation in :data:`RELATIONS` that fails. A zero or near-zero interval would spin a
    node's timers without end; a zero or negative timeout would fail or kill at once; nan passes every
    comparison (a backoff of nan seconds never ends) and inf overflows where a node converts it."""
    for name, words in CHOICES.items():
        if (value := _quantity(config, name)) not in words:
            raise ConfigError(f"{name} must be one of {', '.join(words)}, got {value!r}")
    for name in ENDPOINTS:
        if problem := endpoint_problem(_quantity(config, name)):
            raise ConfigError(f"{name}: {problem}")
    for name, may_be_empty in HOSTS.items():
        value = _quantity(config, name)
        if not (may_be_empty and value == "") and (problem := host_problem(value)):
            raise ConfigError(f"{name}: {problem}")
    if config.store.run and (problem := run_id_problem(config.store.run)):
        raise ConfigError(f"store.run: {problem}")
    if not (len(prefix := config.ps.shm_prefix) <= MAX_PREFIX_CHARS and plain_name(prefix)):
        raise ConfigError(f"ps.shm_prefix must be 1 to {MAX_PREFIX_CHARS} characters of one file name (no '/' or NUL, "
                          f"not '.' or '..'), got {shown(prefix)}: the segments are <ps.shm_dir>/<prefix>.*")
    for name in _floats():
        if not math.isfinite(value := _quantity(config, name)):
            raise ConfigError(f"{name} must be a finite number, got {value!r}")
    for name in _durations():
        value = _quantity(config, name)
        if value < MIN_DURATION_S and not (value == 0 and name in MAY_BE_ZERO):
            floor = f"0 or at least {MIN_DURATION_S:g}" if name in MAY_BE_ZERO else f"at least {MIN_DURATION_S:g}"
            raise ConfigError(f"{name} must be {floor} seconds, got {value!r}")
        if value > MAX_DURATION_S:
            raise ConfigError(f"{name} must be at most {MAX_DURATION_S:.0f} seconds (a year), got {value!r}")
    for name, (low, high) in RANGES.items():
        value = _quantity(config, name)
        if high is None and not low <= value:
            raise ConfigError(f"{name} must be {low} or more, got {value!r}")
        if high is not None and not low <= value <= high:
            raise ConfigError(f"{name} must be from {low} to {high}, got {value!r}")
    frame = config.limits.max_frame_bytes
    if frame != -1 and frame < (largest := largest_frame(config.limits.max_body_bytes,
                                                         config.limits.max_message_bytes)):
        raise ConfigError(f"limits.max_frame_bytes must be -1 (no cap) or at least limits.max_body_bytes + "
                          f"{ONE_FRAME_OVERHEAD} (the rest of a message in one frame), or limits.max_message_bytes "
                          f"where that is smaller (no frame is larger) = {largest}, got {frame}: ZeroMQ drops a "
                          "larger frame without a word, so messages the limits admit would never arrive")
    for name, high in POSITIVE.items():
        value = _quantity(config, name)
        if not (value > 0 and (high is None or value <= high)):
            raise ConfigError(f"{name} must be above 0{'' if high is None else f' and at most {high:g}'}, "
                              f"got {value!r}")
    for relation in RELATIONS:
        value = _quantity(config, relation.key)
        bound = relation.factor * sum(_quantity(config, name) for name in relation.bound)
        if not value > bound:
            raise ConfigError(f"{relation.rule()} does not hold: {value:g} is not above {bound:g}; "
                              f"it must be, so that {relation.why}")


# --- loading ---------------------------------------------------------------------------------------------


def _sections(config: Config) -> list[tuple[str, Any]]:
    return [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``--config`` plus one flag per key, grouped by section; flags default to "not given"."""
    parser.add_argument("--config", metavar="FILE", help="cluster TOML file (default: $REFBUS_CONFIG or built-in)")
    for section_name, section in _sections(Config()):
        group = parser.add_argument_group(f"[{section_name}] config keys")
        for key in dataclasses.fields(section):
            default = getattr(section, key.name)
            flag = f"--{section_name}-{key.name}".replace("_", "-")
            group.add_argument(
                flag,
                dest=f"cfg__{section_name}__{key.name}",
                type=_parse_bool if isinstance(default, bool) else type(default),
                default=None,
                metavar=type(default).__name__.upper(),
                help=f"{key.metadata['help']} (default: {default!r})",
            )


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def load_config(args: argparse.Namespace) -> Config:
    """The effective config: defaults, then the file (``--config``, or ``refbus up``'s CONFIG, or
    ``$REFBUS_CONFIG``), then flags, then ``$REFBUS_SECRET``; then every relation in :data:`RELATIONS` is
    checked (:class:`ConfigError` names the keys of the first that fails). Also a :class:`ConfigError`: two
    files given (CONFIG and ``--config``: which one was meant?) and a ``$REFBUS_SECRET`` set but empty (it would
    silently replace the file's secret with none, and nodes would run unsigned)."""
    config = Config()
    given = [path for path in (getattr(args, "config_file", None), getattr(args, "config", None)) if path]
    if len(given) > 1:
        raise ConfigError(f"two config files given, {given[0]} (CONFIG) and {given[1]} (--config): give one")
    path = next(iter(given), None) or os.environ.get("REFBUS_CONFIG")
    if path:
        try:
            with open(path, "rb") as f:
                _apply(config, tomllib.load(f), path)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
    flags: dict[str, dict[str, Any]] = {}
    for name, value in vars(args).items():
        if name.startswith("cfg__") and value is not None:
            _, section, key = name.split("__")
            flags.setdefault(section, {})[key] = value
    if "REFBUS_SECRET" in os.environ:
        if not os.environ["REFBUS_SECRET"]:
            raise ConfigError("$REFBUS_SECRET is set but empty: it would replace security.secret with no secret "
                              "(every message unsigned); unset it, or set it to the secret")
        flags.setdefault("security", {})["secret"] = os.environ["REFBUS_SECRET"]
    for section, values in flags.items():
        setattr(config, section, dataclasses.replace(getattr(config, section), **values))
    check_relations(config)
    return config


def _apply(config: Config, data: dict[str, Any], path: str) -> None:
    sections = dict(_sections(config))
    for section_name, values in data.items():
        if section_name not in sections:
            raise ConfigError(f"{path}: unknown section [{section_name}]; known: {', '.join(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: [{section_name}] must be a table")
        section = sections[section_name]
        known = {f.name: f for f in dataclasses.fields(section)}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"{path}: unknown key {section_name}.{key}; known: {', '.join(known)}")
            expected = type(getattr(section, key))
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                values[key] = float(value)
            elif type(value) is not expected:
                raise ConfigError(
                    f"{path}: {section_name}.{key} must be {expected.__name__}, got {type(value).__name__}"
                )
        setattr(config, section_name, dataclasses.replace(section, **values))


# --- rendering -------------------------------------------------------------------------------------------


SECRETS: frozenset[str] = frozenset({"security.secret"})
"""Keys whose value is a credential: shown only where asked for (:func:`to_toml`)."""


def to_toml(config: Config, *, secrets: bool = False) -> str:
    """The config as a TOML document, each key preceded by its help text. A set :data:`SECRETS` key is written
    only with ``secrets`` (a file only its owner reads, for the nodes a launcher starts); otherwise its line is
    a comment saying it is set, so printing a config never shows a credential (and a document loaded from that
    output signs nothing until the secret is given again, e.g. with $REFBUS_SECRET)."""
    lines: list[str] = []
    for section_name, section in _sections(config):
        lines.append(f"[{section_name}]")
        for key in dataclasses.fields(section):
            lines.append(f"# {key.metadata['help']}")
            value = getattr(section, key.name)
            if value and f"{section_name}.{key.name}" in SECRETS and not secrets:
                lines.append(f"# {key.name} = (set, not shown)")
            else:
                lines.append(f"{key.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def reference_tables() -> str:
    """The README's configuration reference, generated: every key (default, help), then every relation."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for section_name, section in _sections(Config()):
        for key in dataclasses.fields(section):
            default = getattr(section, key.name)
            shown = "empty" if default == "" else f"`{_toml_value(default)}`"
            lines.append(f"| `{section_name}.{key.name}` | {shown} | {key.metadata['help']} |")
    schedule = " + ".join(f"{t:g}" for t in Config().retry().timeouts())
    zero = " and ".join(f"`{name}`" for name in sorted(MAY_BE_ZERO))
    bounded = ", ".join(f"`{name}` {low} or more" if high is None else f"`{name}` {low} to {high}"
                        for name, (low, high) in RANGES.items())
    positive = ", ".join(f"`{name}` above 0" + ("" if high is None else f" and at most {high:g}")
                         for name, high in POSITIVE.items())
    words = ", ".join(f"`{name}`" for name in CHOICES)
    endpoints = ", ".join(f"`{name}`" for name in ENDPOINTS)
    hosts = " and ".join(f"`{name}`" for name in HOSTS)
    schemes = ", ".join(f"`{scheme}`" for scheme in ENDPOINT_SCHEMES if scheme not in ("tcp", "ipc"))
    lines += ["", "Checked whenever a config loads: every number is finite (no nan, no inf); every duration "
              f"(`*_s`) is at least {MIN_DURATION_S:g} seconds (0 allowed for {zero}: none) and at most "
              f"{MAX_DURATION_S:.0f} (a year); {bounded}; {positive}; `limits.max_frame_bytes` -1 or at least "
              f"`limits.max_body_bytes` + {ONE_FRAME_OVERHEAD} (the rest of a message in one frame), or "
              "`limits.max_message_bytes` where that is smaller (no frame is larger; ZeroMQ drops a larger frame "
              f"without a word); one of its words for {words}; an endpoint for {endpoints} "
              f"(`tcp://HOST:PORT`, HOST a host name, an IP address, `[IPv6]` or `*`, PORT 0 to 65535 or `*` (0 "
              f"and `*`: ephemeral, for a bind); `ipc://PATH`; {schemes} as tcp, with an optional `/path`); a host "
              f"name or IP address for {hosts} (`node.host` may be empty)"
              "; and the rules below (a violation is an error naming both sides). The request retry "
              "schedule is the sum of every attempt's timeout (`requests.*`; by default "
              f"{schedule} = {sum(Config().retry().timeouts()):g} s).", "", "| rule | so that |", "| --- | --- |"]
    lines += [f"| {relation.rule()} | {relation.why} |" for relation in RELATIONS]
    return "\n".join(lines) + "\n"


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(value: Any) -> str:
    """``value`` as a TOML value; a string as a basic string with every character TOML does not allow there
    escaped (backslash, quote, control characters): a secret from ``base64`` wraps its lines, and one raw
    newline makes the whole file unloadable for every node that reads it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + "".join(_TOML_ESCAPES.get(c) or (f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                             for c in value) + '"'
    return repr(value)
