"""Cluster configuration: one TOML file per cluster, an embedded default, every key a CLI flag.

Precedence, lowest first: the defaults below (the embedded config; ``refbus config show`` prints it as
TOML), the file given with ``--config`` (or ``$REFBUS_CONFIG``), then flags. Every key ``section.key``
has the flag ``--section-key`` (underscores become dashes). Unknown sections or keys in a file are errors,
so a typo never silently falls back to a default. ``$REFBUS_SECRET`` overrides ``security.secret``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from ..bus.broker import BrokerSettings
from ..bus.reqrep import RetryPolicy
from ..bus.runtime import RuntimeSettings
from ..protocol.envelope import Limits
from .payload.env_server import EnvServerSettings
from .payload.episodes import EpisodeSettings
from .payload.orchestrator_node import OrchestratorSettings

# Role settings own their defaults; the config sections read them, so the two cannot drift apart.
_ORCHESTRATOR = OrchestratorSettings()
_ENV_SERVER = EnvServerSettings()
_EPISODES = EpisodeSettings()


def _key(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class ClusterSection:
    name: str = _key("local", "Cluster name, shown in logs and by `refbus top`.")


@dataclass
class BusSection:
    control: str = _key("tcp://127.0.0.1:7770", "Broker control endpoint (ROUTER): every node connects here first.")
    events_in: str = _key("tcp://127.0.0.1:7771", "Broker endpoint where nodes publish events (XSUB).")
    events_out: str = _key("tcp://127.0.0.1:7772", "Broker endpoint where subscribers receive events (XPUB).")
    ring_events: int = _key(65_536, "Events kept in the broker's replay ring.")
    ring_bytes: int = _key(256 << 20, "Bytes kept in the broker's replay ring.")
    heartbeat_interval_s: float = _key(1.0, "Seconds between node heartbeats.")
    node_timeout_s: float = _key(5.0, "Seconds without a heartbeat before the broker declares a node down.")
    metrics_port: int = _key(
        7779,
        "Port of the broker's Prometheus endpoint, used by the broker instead of "
        "node.metrics_port; it also serves /sd (every node's endpoint, for Prometheus's "
        "http_sd_configs), so it is fixed for a scrape config to name. 0: a free one, -1: none.",
    )


@dataclass
class NodeSection:
    host: str = _key("", "Host name advertised for wildcard binds (default: this machine's host name).")
    connect_timeout_s: float = _key(15.0, "Seconds a starting node waits for the broker.")
    metrics_host: str = _key("127.0.0.1", "Address of each node's Prometheus endpoint.")
    metrics_port: int = _key(0, "Port of the Prometheus endpoint: 0 picks a free one, -1 disables it.")
    log_level: str = _key("info", "Log level: debug, info, warning, error.")
    log_format: str = _key("auto", "Log format: auto (JSON unless stderr is a terminal), json, console.")


@dataclass
class RequestsSection:
    timeout_s: float = _key(2.0, "Seconds to wait for a reply before retrying.")
    attempts: int = _key(3, "Attempts per request, the first included.")
    backoff: float = _key(2.0, "Factor applied to the timeout after each attempt.")
    max_timeout_s: float = _key(10.0, "Upper bound of the per-attempt timeout.")


@dataclass
class LimitsSection:
    max_body_bytes: int = _key(16 << 20, "Largest msgpack body accepted.")
    max_message_bytes: int = _key(8 << 30, "Largest message (all frames) accepted.")
    max_frame_bytes: int = _key(-1, "ZeroMQ per-frame cap (MAXMSGSIZE); -1: none.")
    max_depth: int = _key(32, "Deepest nesting of lists and maps accepted in a body.")
    max_items: int = _key(1 << 20, "Most list elements and map entries accepted in one body, all together.")


@dataclass
class SecuritySection:
    secret: str = _key("", "Shared secret that signs every message (HMAC-SHA256); empty: unsigned.")


@dataclass
class PsSection:
    manager: str = _key("tcp://127.0.0.1:7780", "ps-manager endpoint (ROUTER): workers and clients connect here.")
    worker: str = _key("tcp://127.0.0.1:0", "ps-worker data endpoint to bind (port 0: ephemeral, advertised).")
    retain_versions: int = _key(2, "Committed versions the ps-manager keeps readable; older ones are freed unread.")
    lease_ttl_s: float = _key(10.0, "Seconds a push or pull lease lives without renewal.")
    push_timeout_s: float = _key(300.0, "Seconds every rank of a version has to commit its shard before it is aborted.")
    shm_dir: str = _key("/dev/shm", "Directory (tmpfs) of the ps-workers' shared-memory segments.")
    shm_prefix: str = _key("refbus-ps", "File name prefix of the shared-memory segments.")
    pin_memory: bool = _key(True, "Page-lock segments for device copies when CUDA is available.")
    max_free_segments: int = _key(4, "Freed segments a ps-worker keeps mapped for reuse.")
    eta: int = _key(1, "Staleness bound: a trajectory trains at most eta versions after its policy version.")
    batch_size: int = _key(64, "Trajectories per training batch in the staleness inventory.")
    chunk_bytes: int = _key(8 << 20, "Bytes per chunk of the broadcast-init stream.")
    ack_timeout_s: float = _key(10.0, "Seconds a broadcast-init peer has to acknowledge a message.")
    init_timeout_s: float = _key(600.0, "Seconds a broadcast init may take before it fails.")


@dataclass
class EnvServerSection:
    endpoint: str = _key(
        _ENV_SERVER.endpoint,
        "env-server blob endpoint (ROUTER: keep, claim, fetch, delete); port 0: ephemeral, advertised.",
    )
    source: str = _key(
        _ENV_SERVER.source, "Source name in blob references; replicas of one source share it (default: the node id)."
    )
    budget_bytes: int = _key(
        _ENV_SERVER.budget_bytes, "Array bytes an env server may hold; a keep beyond it fails (never evicts)."
    )
    handover_lease_s: float = _key(
        _ENV_SERVER.handover_lease_s, "Seconds a kept blob may stay unclaimed before it is deleted as undelivered."
    )
    score: str = _key(
        _EPISODES.score,
        "Entry point 'module:function' scoring an episode: score(prompt, completion) -> reward. Must not import torch.",
    )
    max_new_tokens: int = _key(_EPISODES.max_new_tokens, "Tokens a rollout worker generates per episode.")
    generate_timeout_s: float = _key(
        _EPISODES.generate_timeout_s, "Seconds a run may wait for its generation before it fails."
    )


@dataclass
class OrchestratorSection:
    seq_len: int = _key(_ORCHESTRATOR.seq_len, "Tokens per micro batch (samples longer than this are truncated).")
    group_size: int = _key(
        _ORCHESTRATOR.group_size, "Episodes per group (one prompt); advantages are computed within a group."
    )
    groups_per_step: int = _key(_ORCHESTRATOR.groups_per_step, "Complete groups shipped per trainer step.")
    max_staleness: int = _key(
        _ORCHESTRATOR.max_staleness, "Versions a sample's policy may lag the current one when its step is packed."
    )
    max_steps: int = _key(
        _ORCHESTRATOR.max_steps, "Steps to ship before deleting everything that arrives (0: no limit)."
    )
    trainers: int = _key(_ORCHESTRATOR.trainers, "Trainer ranks to wait for (from the registry) before the first step.")
    group_timeout_s: float = _key(
        _ORCHESTRATOR.group_timeout_s, "Seconds an incomplete group may wait before it is dropped."
    )
    dispatch: bool = _key(
        _ORCHESTRATOR.dispatch,
        "Send runs to the env servers (the RL loop of `refbus up`); off: only take the episodes others send.",
    )
    prompt: str = _key(_ORCHESTRATOR.prompt, "Entry point: f(numpy Generator) -> prompt token ids.")
    seed: int = _key(_ORCHESTRATOR.seed, "Seed of the prompt stream.")
    max_groups_in_flight: int = _key(_ORCHESTRATOR.max_groups_in_flight, "Groups whose runs may be in flight at once.")
    eval_every: int = _key(
        _ORCHESTRATOR.eval_every, "Steps between eval groups (0: none); eval episodes are scored, never trained."
    )


@dataclass
class RlSection:
    policy: str = _key(
        "refbus.nodes.toy.policy:make_policy",
        "Entry point building the policy: f(seed) -> "
        "torch.nn.Module (trainer ranks and rollout workers build the same one).",
    )
    generate: str = _key(
        "refbus.nodes.toy.policy:generate",
        "Entry point generating completions: f(model, prompts "
        "[1, P], max_new_tokens, temperature=, top_k_logprobs=, sampling_top_k=) -> [rollout with "
        ".tokens and .branch()].",
    )
    optimizer: str = _key("refbus.nodes.toy.train:make_optimizer", "Entry point: f(model, lr) -> optimizer.")
    train_step: str = _key(
        "refbus.nodes.toy.train:train_step",
        "Entry point: f(model, optimizer, micro_batches, "
        "temperature=) -> metrics dict (see refbus.nodes.toy.train for the batch keys).",
    )
    seed: int = _key(0, "Seed of the initial weights and of the rollout workers' sampling.")
    lr: float = _key(5e-3, "Learning rate.")
    temperature: float = _key(1.0, "Sampling temperature (the train step divides logits by it too).")
    top_k_logprobs: int = _key(4, "Width of the sampler's recorded top-k logprob heads.")
    sampling_top_k: int = _key(4, "Top-k sampling filter (recorded as the sampling mask).")
    torch_threads: int = _key(1, "torch intra-op threads per process (many processes share few cores).")


@dataclass
class TrainerSection:
    endpoint: str = _key("tcp://127.0.0.1:0", "Trainer rank endpoint (ROUTER: step-batch); port 0: ephemeral.")
    rank: int = _key(-1, "torch.distributed rank (-1: $RANK, as torchrun sets it).")
    world_size: int = _key(-1, "torch.distributed world size (-1: $WORLD_SIZE).")
    init_method: str = _key("env://", "torch.distributed init method (env:// reads $MASTER_ADDR/$MASTER_PORT).")
    steps: int = _key(20, "Steps to train before the rank exits.")
    batch_timeout_s: float = _key(300.0, "Seconds a rank waits for its step batch before failing the step.")


@dataclass
class RolloutSection:
    endpoint: str = _key("tcp://127.0.0.1:0", "Rollout worker endpoint (ROUTER: generate); port 0: ephemeral.")


@dataclass
class UpSection:
    steps: int = _key(80, "Trainer steps `refbus up` runs before it stops the cluster.")
    env_servers: int = _key(2, "Env-server processes (replicas of one source).")
    trainers: int = _key(2, "Trainer ranks (torch.distributed world size).")
    rollouts: int = _key(2, "Rollout worker processes.")
    ps_workers: int = _key(2, "Parameter-server worker processes.")


@dataclass
class Config:
    cluster: ClusterSection = field(default_factory=ClusterSection)
    bus: BusSection = field(default_factory=BusSection)
    node: NodeSection = field(default_factory=NodeSection)
    requests: RequestsSection = field(default_factory=RequestsSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    env_server: EnvServerSection = field(default_factory=EnvServerSection)
    orchestrator: OrchestratorSection = field(default_factory=OrchestratorSection)
    rl: RlSection = field(default_factory=RlSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    up: UpSection = field(default_factory=UpSection)
    ps: PsSection = field(default_factory=PsSection)

    def runtime(self, *, node_id: str = "", ready_file: str = "") -> RuntimeSettings:
        """What the node runtime needs from this config."""
        extra = {"host": self.node.host} if self.node.host else {}
        return RuntimeSettings(
            bus=self.bus.control,
            node_id=node_id,
            secret=self.security.secret.encode(),
            heartbeat_interval_s=self.bus.heartbeat_interval_s,
            connect_timeout_s=self.node.connect_timeout_s,
            metrics_host=self.node.metrics_host,
            metrics_port=self.node.metrics_port,
            ready_file=ready_file,
            limits=Limits(self.limits.max_body_bytes, self.limits.max_message_bytes, self.limits.max_depth,
                          self.limits.max_items),
            retry=RetryPolicy(
                self.requests.timeout_s, self.requests.attempts, self.requests.backoff, self.requests.max_timeout_s
            ),
            max_frame_bytes=self.limits.max_frame_bytes,
            **extra,
        )

    def broker(self) -> BrokerSettings:
        return BrokerSettings(
            control=self.bus.control,
            events_in=self.bus.events_in,
            events_out=self.bus.events_out,
            ring_events=self.bus.ring_events,
            ring_bytes=self.bus.ring_bytes,
            node_timeout_s=self.bus.node_timeout_s,
            cluster=self.cluster.name,
        )


class ConfigError(ValueError):
    """A config file or flag that cannot be used; the message names the file, key and problem."""


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
    """The effective config: defaults, then the file, then flags, then ``$REFBUS_SECRET``."""
    config = Config()
    path = getattr(args, "config", None) or os.environ.get("REFBUS_CONFIG")
    if path:
        try:
            with open(path, "rb") as f:
                _apply(config, tomllib.load(f), path)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
    for name, value in vars(args).items():
        if name.startswith("cfg__") and value is not None:
            _, section, key = name.split("__")
            setattr(getattr(config, section), key, value)
    if "REFBUS_SECRET" in os.environ:
        config.security.secret = os.environ["REFBUS_SECRET"]
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
                value = float(value)
            if type(value) is not expected:
                raise ConfigError(
                    f"{path}: {section_name}.{key} must be {expected.__name__}, got {type(value).__name__}"
                )
            setattr(section, key, value)


def to_toml(config: Config) -> str:
    """The config as a TOML document, each key preceded by its help text."""
    lines: list[str] = []
    for section_name, section in _sections(config):
        lines.append(f"[{section_name}]")
        for key in dataclasses.fields(section):
            lines.append(f"# {key.metadata['help']}")
            lines.append(f"{key.name} = {_toml_value(getattr(section, key.name))}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)
