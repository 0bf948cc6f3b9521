"""Every cluster config key, declared once: one frozen dataclass per TOML section, each key's help as metadata.

The TOML of ``refbus config show``, the ``--section-key`` flags and the README's configuration reference are
all generated from these classes (:mod:`refbus.nodes.config`). A role takes its section object as it is
(``OrchestratorSettings``, ``EnvServerSettings``, ``TrainerSettings``, ``PsSettings``); what is not user
config (internal knobs, test hooks) stays a keyword parameter of the role's constructor.

A leaf module: it imports no role and nothing outside the standard library, so every process can load the
config without loading another role's code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def key(default: Any, help: str) -> Any:
    """A config key: its default and its help (the TOML comment, the flag's help, the README's meaning)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ClusterSettings:
    """``[cluster]``: the cluster's identity."""

    name: str = key("local", "Cluster name, shown in logs and by `refbus top`.")


@dataclass(frozen=True)
class BusSettings:
    """``[bus]``: the broker (translated to ``BrokerSettings`` and the nodes' heartbeat in ``Config``)."""

    control: str = key("tcp://127.0.0.1:7770", "Broker control endpoint (ROUTER): every node connects here first.")
    events_in: str = key("tcp://127.0.0.1:7771", "Broker endpoint where nodes publish events (XSUB).")
    events_out: str = key("tcp://127.0.0.1:7772", "Broker endpoint where subscribers receive events (XPUB).")
    ring_events: int = key(
        65_536, "Messages kept in the broker's replay ring (an event, or a batch of one node's events).")
    ring_bytes: int = key(256 << 20, "Bytes kept in the broker's replay ring (each frame of a message of several "
                          "counted 256 more).")
    event_batch: int = key(
        64,
        "Events a node may send in one message: what it publishes in one turn of its loop goes out together "
        "(protocol 2.2's batch form), one ZeroMQ message per burst instead of one per event. 1: one event a "
        "message, for subscribers older than 2.2 (they refuse a batch as malformed). The broker tells every "
        "node at join.",
    )
    heartbeat_interval_s: float = key(1.0, "Seconds between node heartbeats.")
    node_timeout_s: float = key(5.0, "Seconds without a heartbeat before the broker declares a node down.")
    max_nodes: int = key(
        4096,
        "Nodes the broker registers at most, live or still joining (far above any real cluster): a hello of a new "
        "node id past it is refused registry-full (counted in refbus_requests_rejected_total), and the node "
        "reports it; those registered are not disturbed.",
    )
    metrics_port: int = key(
        7779,
        "Port of the broker's Prometheus endpoint, used by the broker instead of "
        "node.metrics_port; it also serves /sd (every node's endpoint, for Prometheus's "
        "http_sd_configs), so it is fixed for a scrape config to name. 0: a free one, -1: none.",
    )


@dataclass(frozen=True)
class NodeSettings:
    """``[node]``: what every node process shares (translated to ``RuntimeSettings`` in ``Config``)."""

    host: str = key("", "Host name advertised for wildcard binds (default: this machine's host name).")
    connect_timeout_s: float = key(15.0, "Seconds a starting node waits for the broker.")
    restart_grace_s: float = key(
        10.0,
        "Seconds a node reported down has to come back (re-register under the same id) before peers act on "
        "it: stores delete what a dead holder held (holder-down), the orchestrator drops references to a dead "
        "store's blobs (lost).",
    )
    shutdown_timeout_s: float = key(
        5.0,
        "Seconds from SIGTERM (or a stop) until a node process is gone, its final events (shutdown deletes, bye) "
        "included: shutdown hooks that would take longer are cut off, and a node still alive then exits.",
    )
    metrics_host: str = key("127.0.0.1", "Address of each node's Prometheus endpoint.")
    metrics_port: int = key(0, "Port of the Prometheus endpoint: 0 picks a free one, -1 disables it.")
    log_level: str = key("info", "Log level: debug, info, warning, error.")
    log_format: str = key("auto", "Log format: auto (JSON unless stderr is a terminal), json, console.")


@dataclass(frozen=True)
class RequestsSettings:
    """``[requests]``: the retry policy of every request (``RetryPolicy``, built in ``Config.retry``)."""

    timeout_s: float = key(2.0, "Seconds to wait for a reply before retrying.")
    attempts: int = key(3, "Attempts per request, the first included.")
    backoff: float = key(2.0, "Factor applied to the timeout after each attempt.")
    max_timeout_s: float = key(10.0, "Upper bound of the per-attempt timeout.")


@dataclass(frozen=True)
class LimitsSettings:
    """``[limits]``: what a node accepts from the wire (``Limits``, built in ``Config.runtime``)."""

    max_body_bytes: int = key(16 << 20, "Largest msgpack body accepted.")
    max_message_bytes: int = key(8 << 30, "Largest message (all frames) accepted.")
    max_frame_bytes: int = key(-1, "ZeroMQ per-frame cap (MAXMSGSIZE): a larger frame is dropped unread (an array "
                                   "frame too); -1: none, else at least max_body_bytes + 4357, or max_message_bytes "
                                   "where that is smaller.")
    max_depth: int = key(32, "Deepest nesting of lists and maps accepted in a body.")
    max_items: int = key(1 << 20, "Most list elements and map entries accepted in one body, all together.")


@dataclass(frozen=True)
class SecuritySettings:
    """``[security]``: message signing, CURVE encryption and authentication, and what a node may bind."""

    secret: str = key("", "Shared secret that signs every message (HMAC-SHA256); empty: unsigned.")
    curve_dir: str = key(
        "",
        "Key directory made by `refbus keys generate`: with it every socket is CURVE-encrypted and a node admits "
        "only the client keys of its allow-list, each as the one node id it names; empty: no CURVE.",
    )
    curve_key: str = key("", "This node's secret key file (default: <curve_dir>/<node id>.key_secret).")
    insecure: bool = key(
        False,
        "Let a node bind an address other hosts reach with neither `secret` nor `curve_dir` set (otherwise it "
        "refuses to start).",
    )


@dataclass(frozen=True)
class PsSettings:
    """``[ps]``: the parameter server; both ``PsManager`` and ``PsWorker`` take it."""

    manager: str = key("tcp://127.0.0.1:7780", "ps-manager endpoint (ROUTER): workers and clients connect here.")
    worker: str = key("tcp://127.0.0.1:0", "ps-worker data endpoint to bind (port 0: ephemeral, advertised).")
    retain_versions: int = key(2, "Committed versions the ps-manager keeps readable; older ones are freed unread.")
    lease_ttl_s: float = key(10.0, "Seconds a push or pull lease lives without renewal.")
    push_timeout_s: float = key(300.0, "Seconds every rank of a version has to commit its shard before it is aborted.")
    shm_dir: str = key("/dev/shm", "Directory (tmpfs) of the ps-workers' shared-memory segments without "
                       "store.durable (with it, each worker's store directory under store.directory holds them).")
    shm_prefix: str = key("refbus-ps", "File name prefix of the shared-memory segments.")
    pin_memory: bool = key(True, "Page-lock segments for device copies when CUDA is available.")
    max_free_segments: int = key(4, "Freed segments a ps-worker keeps mapped for reuse.")
    max_open_bytes: int = key(0, "Bytes of segments a ps-worker holds for pushes not yet sealed, all together: a "
                                 "further `ps-shard-open` is refused `open-limit`. 0: half the size of the filesystem "
                                 "holding its segments. A broadcast init the ps-manager planned is not counted: it "
                                 "needs the room free on that filesystem, checked first (`no-room`).")
    eta: int = key(1, "Staleness bound: a trajectory trains at most eta versions after its policy version.")
    batch_size: int = key(64, "Trajectories per training batch in the staleness inventory.")
    chunk_bytes: int = key(8 << 20, "Bytes per chunk of the broadcast-init stream.")
    ack_timeout_s: float = key(10.0, "Seconds a broadcast-init peer has to acknowledge a message; a header, which it "
                                     "answers once it made its segment, that plus 1 s a GiB of the checkpoint.")
    init_timeout_s: float = key(600.0, "Seconds a broadcast init may take before it fails.")
    replicas: int = key(2, "Copies of every pushed shard, each on its own ps-worker (capped to the live workers): a "
                           "version commits once every copy is verified, so it survives the death of replicas - 1 "
                           "workers.")
    transport: str = key("frames", "How pulls from ps-workers on other hosts travel: `frames` (ZeroMQ) or `nixl` "
                         "(NIXL READs; needs the `nixl` extra: `pip install --no-deps nixl-cu12==1.5.1`).")


@dataclass(frozen=True)
class EnvServerSettings:
    """``[env_server]``: ``EnvServer`` (blobs) and ``EpisodeRunner`` (runs) take it."""

    endpoint: str = key(
        "tcp://127.0.0.1:0",
        "env-server blob endpoint (ROUTER: keep, claim, fetch, delete); port 0: ephemeral, advertised.",
    )
    source: str = key("", "Source name in blob references; replicas of one source share it (default: the node id).")
    budget_bytes: int = key(16 << 30, "Bytes an env server may hold: each blob's array bytes in whole pages "
                                      "plus 4 KiB, and each held episode's info; a keep beyond it is refused with "
                                      "a retry-after (never evicts); a run's keep waits for room.")
    high_water: float = key(0.8, "Share of budget_bytes from which the env server reports itself full (heartbeat "
                                 "status `full`): the orchestrator sends it no new runs until it drains below.")
    handover_lease_s: float = key(60.0, "Seconds a kept blob may stay unclaimed before it is deleted as undelivered.")
    tombstone_s: float = key(300.0, "Seconds a deleted blob id is remembered: a second delete or a fetch of it "
                                    "meanwhile is an ownership violation, later the id reads as unknown.")
    score: str = key(
        "refbus.nodes.toy.task:score",
        "Entry point 'module:function' scoring an episode: score(prompt, completion) -> reward. Must not import torch.",
    )
    max_new_tokens: int = key(6, "Tokens a rollout worker generates per episode.")
    generate_timeout_s: float = key(30.0, "Seconds a run may take on the env server (its generation, its score, "
                                          "then waiting for room to keep it) before it fails.")


@dataclass(frozen=True)
class StoreSettings:
    """``[store]``: the durable stores of env servers (blobs) and ps-workers (shards) that outlive their
    processes."""

    durable: bool = key(True, "Keep env-server blobs, ps-worker shards and the ps-manager's journal of committed "
                              "versions in files on a tmpfs that outlive the process: a restart under the same node "
                              "id re-adopts them (docs/STORE.md); false: blobs in process memory, shards in "
                              "ps.shm_dir, versions in the manager's memory, all lost with their process.")
    directory: str = key("/dev/shm", "Directory (tmpfs) of the durable stores, one sub-directory per store per run; "
                                     "its size must cover env_server.budget_bytes.")
    run: str = key("", "Run id naming the store directories: letters, digits, '_' and '-' (default: cluster.name and "
                       "bus.control); `refbus up` sets a fresh one per run and names its trainer checkpoint directory "
                       "and rendezvous files after it too, so a new run never re-adopts an old run's blobs nor resumes "
                       "its checkpoints.")


@dataclass(frozen=True)
class OrchestratorSettings:
    """``[orchestrator]``: the orchestrator node and its decisions (``OrchestratorCore``) read it."""

    seq_len: int = key(2048, "Tokens per micro batch (samples longer than this are truncated).")
    group_size: int = key(4, "Episodes per group (one prompt); advantages are computed within a group, so a group "
                             "of one (advantage 0, always filtered) never trains.")
    groups_per_step: int = key(16, "Complete groups shipped per trainer step.")
    max_staleness: int = key(1, "Versions a sample's policy may lag the weights that train its step (version K "
                                 "trains step K), checked when the step is packed.")
    max_steps: int = key(0, "Steps to ship before deleting everything that arrives (0: the smallest `trainer.steps` "
                            "the trainer ranks advertise; none advertised: no limit).")
    trainers: int = key(1, "Trainer ranks to wait for (from the registry) before the first step.")
    group_timeout_s: float = key(120.0, "Seconds an incomplete group may wait before it is dropped.")
    dispatch: bool = key(
        False,
        "Send runs to the env servers (the RL loop of `refbus up`), from the first committed weights version on; "
        "off: only take the episodes others send.",
    )
    prompt: str = key("refbus.nodes.toy.task:Curriculum",
                      "Entry point of the prompt source: a function f(numpy Generator) -> prompt token ids, or a "
                      "class with make_prompt(rng), optionally observe(prompt, rewards) (each completed group) and "
                      "status() -> {name: number} (shown as task_<name>), built once (a curriculum).")
    seed: int = key(0, "Seed of the prompt stream.")
    max_groups_in_flight: int = key(16, "Groups whose runs may be in flight at once.")
    eval_every: int = key(0, "Steps between eval groups (0: none); eval episodes are scored, never trained.")


@dataclass(frozen=True)
class RlSettings:
    """``[rl]``: the user code of the RL loop (entry points) and its hyperparameters."""

    policy: str = key(
        "refbus.nodes.toy.policy:make_policy",
        "Entry point building the policy: f(seed) -> "
        "torch.nn.Module (trainer ranks and rollout workers build the same one).",
    )
    generate: str = key(
        "refbus.nodes.toy.policy:generate",
        "Entry point generating completions: f(model, prompts "
        "[1, P], max_new_tokens, temperature=, top_k_logprobs=, sampling_top_k=) -> [rollout with "
        ".tokens and .branch()].",
    )
    optimizer: str = key("refbus.nodes.toy.train:make_optimizer", "Entry point: f(model, lr) -> optimizer.")
    train_step: str = key(
        "refbus.nodes.toy.train:train_step",
        "Entry point: f(model, optimizer, micro_batches, "
        "temperature=) -> metrics dict (see refbus.nodes.toy.train for the batch keys).",
    )
    seed: int = key(0, "Seed of the initial weights and of the rollout workers' sampling.")
    lr: float = key(5e-3, "Learning rate.")
    temperature: float = key(1.0, "Sampling temperature (the train step divides logits by it too).")
    top_k_logprobs: int = key(4, "Width of the sampler's recorded top-k logprob heads.")
    sampling_top_k: int = key(4, "Top-k sampling filter (recorded as the sampling mask).")
    torch_threads: int = key(1, "torch intra-op threads per process (many processes share few cores).")


@dataclass(frozen=True)
class TrainerSettings:
    """``[trainer]``: one trainer rank; ``TrainerRank`` takes it."""

    endpoint: str = key("tcp://127.0.0.1:0", "Trainer rank endpoint (ROUTER: step-batch); port 0: ephemeral.")
    rank: int = key(-1, "torch.distributed rank (-1: $RANK, as torchrun sets it).")
    world_size: int = key(-1, "torch.distributed world size (-1: $WORLD_SIZE).")
    init_method: str = key("env://", "torch.distributed init method (env:// reads $MASTER_ADDR/$MASTER_PORT).")
    steps: int = key(20, "Steps to train before the rank exits.")
    batch_timeout_s: float = key(300.0, "Seconds a rank waits for its step batch before failing the step.")
    skip_limit: int = key(
        3,
        "Steps in a row every rank may skip (none of their micro batches fetched on any rank, a data rank "
        "unable to stand in for its dropped ones, or a restarted orchestrator's fill of a step its earlier "
        "incarnation delivered to only some ranks): the world trains on with the same weights. One more ends "
        "the world with an error, since the cause persists (stores gone for good, blobs failing verification "
        "everywhere). 0: never skip, every such step ends the world.",
    )
    checkpoint_every: int = key(
        0,
        "Steps between checkpoints (weights, optimizer state, step: one safetensors file per rank); a world "
        "started again resumes from the last step every rank has. 0: none (`refbus up` turns them on).",
    )
    checkpoint_dir: str = key("trainer-checkpoints", "Directory of the ranks' checkpoints (relative: to the "
                                                     "working directory).")


@dataclass(frozen=True)
class RolloutSettings:
    """``[rollout]``: one rollout worker."""

    endpoint: str = key("tcp://127.0.0.1:0", "Rollout worker endpoint (ROUTER: generate); port 0: ephemeral.")


@dataclass(frozen=True)
class UpSettings:
    """``[up]``: the local cluster of ``refbus up``."""

    steps: int = key(80, "Trainer steps `refbus up` runs before it stops the cluster.")
    env_servers: int = key(2, "Env-server processes (replicas of one source).")
    trainers: int = key(2, "Trainer ranks (torch.distributed world size).")
    rollouts: int = key(2, "Rollout worker processes.")
    ps_workers: int = key(2, "Parameter-server worker processes.")
    restart_budget: int = key(
        20,
        "Restarts of crashed nodes `refbus up` may make in one run (env servers, rollout workers, ps-workers, "
        "the ps-manager, the orchestrator, the broker, trainer worlds; --chaos kills are not charged); a crash "
        "beyond it, or of a trainer rank without checkpoints, ends the run.",
    )
    restart_backoff_s: float = key(
        0.5, "Seconds before a crashed node is restarted, doubled for each earlier restart of that node (at most "
        "16x; from 1x again once a node ran 64x it before it died); the orchestrator's and env servers' at most "
        "half node.restart_grace_s, so the orchestrator's restart claims back what it held and a durable env "
        "server's is back before its blobs are declared lost; the broker's at most half bus.node_timeout_s, so the "
        "registry is back within a node timeout."
    )
    checkpoint_every: int = key(
        3,
        "trainer.checkpoint_every of the run (checkpoints in `checkpoints/<store.run>` of its run directory): with "
        "checkpoints on, a dead trainer rank stops its world and the whole world restarts from the last "
        "checkpoint. 0: off, a dead rank ends the run.",
    )
