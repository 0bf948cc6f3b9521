"""The cluster config: one declaration per section, flags and files over the defaults, relations checked."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST_LIVENESS
from refbus.bus.runtime import NodeRuntime, RuntimeSettings
from refbus.nodes.cli import build_parser
from refbus.nodes.config import ENDPOINTS, RANGES, RELATIONS, RETRY_SCHEDULE, Config, ConfigError, load_config, to_toml
from refbus.nodes.up import LocalCluster
from refbus.protocol.envelope import ONE_FRAME_OVERHEAD


def load(*flags: str, config_file: Path | None = None) -> Config:
    extra = ["--config", str(config_file)] if config_file else []
    return load_config(build_parser().parse_args(["config", "show", *extra, *flags]))


def refbus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "refbus.nodes.cli", *args], capture_output=True, text=True,
                          timeout=60)


def test_the_defaults_load_and_satisfy_every_relation() -> None:
    assert load() == Config()


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text('[orchestrator]\nseed = 7\ngroup_size = 8\n[ps]\nlease_ttl_s = 20\n')
    config = load("--orchestrator-seed", "9", config_file=path)
    assert (config.orchestrator.seed, config.orchestrator.group_size, config.ps.lease_ttl_s) == (9, 8, 20.0)
    assert config.trainer == Config().trainer


def test_config_show_reads_back_as_the_same_config(tmp_path: Path) -> None:
    shown = refbus("config", "show", "--trainer-steps", "3", "--orchestrator-dispatch", "true")
    assert shown.returncode == 0, shown.stderr
    path = tmp_path / "shown.toml"
    path.write_text(shown.stdout)
    config = load(config_file=path)
    assert config.trainer.steps == 3 and config.orchestrator.dispatch is True
    assert to_toml(config) == shown.stdout


# Per relation: flags that break it and nothing else. Every relation must have its case here.
BREAKS: dict[tuple[str, tuple[str, ...]], list[str]] = {
    ("bus.node_timeout_s", ("bus.heartbeat_interval_s",)): ["--bus-heartbeat-interval-s", "2.0"],
    (RETRY_SCHEDULE, ("bus.node_timeout_s",)): ["--requests-attempts", "1"],
    ("env_server.handover_lease_s", ("bus.node_timeout_s", "node.restart_grace_s", RETRY_SCHEDULE)):
        ["--env-server-handover-lease-s", "25"],
    ("orchestrator.group_timeout_s", ("env_server.generate_timeout_s",)): ["--env-server-generate-timeout-s", "200"],
    ("trainer.batch_timeout_s", ("orchestrator.group_timeout_s",)): ["--trainer-batch-timeout-s", "100"],
    ("ps.lease_ttl_s", ("requests.timeout_s",)): ["--ps-lease-ttl-s", "1.5"],
}


def test_every_relation_has_a_case() -> None:
    assert set(BREAKS) == {(relation.key, relation.bound) for relation in RELATIONS}


@pytest.mark.parametrize("relation", RELATIONS, ids=lambda relation: relation.key)
def test_a_broken_relation_is_an_error_naming_both_sides(relation) -> None:
    with pytest.raises(ConfigError) as err:
        load(*BREAKS[relation.key, relation.bound])
    message = str(err.value)
    for name in (relation.key, *relation.bound):
        assert name in message
    assert relation.why in message


def test_a_relation_is_checked_on_the_effective_config_not_per_key(tmp_path: Path) -> None:
    # Each value alone is fine; together with the file's node timeout the lease is too short.
    path = tmp_path / "cluster.toml"
    path.write_text("[bus]\nnode_timeout_s = 12.0\n")
    load(config_file=path)
    with pytest.raises(ConfigError, match=r"env_server\.handover_lease_s > bus\.node_timeout_s"):
        load("--env-server-handover-lease-s", "25", config_file=path)
    # Moving the bound with it makes the same lease valid.
    assert load("--env-server-handover-lease-s", "25", "--bus-node-timeout-s", "10",
                "--node-restart-grace-s", "0.5").env_server.handover_lease_s == 25


def test_the_short_timings_the_tests_use_are_consistent() -> None:
    config = load(*FAST_LIVENESS)
    assert config.bus.node_timeout_s == 1.0


@pytest.mark.parametrize(("content", "says"), [
    ("[bus]\nnode_timeout_s = 0.5\n", "does not hold"),
    ("[bus]\nnode_timeout = 5\n", "unknown key bus.node_timeout"),
    ("[buss]\n", "unknown section [buss]"),
    ('[bus]\nnode_timeout_s = "5"\n', "bus.node_timeout_s must be float, got str"),
    ("[bus\n", "cannot read config"),
    ("bus = 3\n", "[bus] must be a table"),
])
def test_a_bad_config_file_is_refused_with_exit_2(tmp_path: Path, content: str, says: str) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(content)
    result = refbus("config", "show", "--config", str(path))
    assert result.returncode == 2 and says in result.stderr and result.stdout == ""


def test_sections_are_frozen_so_a_role_never_sees_its_settings_change() -> None:
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.trainer.steps = 3  # type: ignore[misc]


def test_a_key_of_a_few_words_refuses_any_other() -> None:
    assert load("--ps-transport", "nixl").ps.transport == "nixl"
    with pytest.raises(ConfigError, match=r"ps\.transport must be one of frames, nixl, got 'ucx'"):
        load("--ps-transport", "ucx")


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--node-log-level", "bogus", "node.log_level must be one of debug, info, warning, error, got 'bogus'"),
    ("--node-log-format", "xml", "node.log_format must be one of auto, json, console, got 'xml'"),
    ("--bus-control", "notanendpoint", "bus.control: 'notanendpoint' is not an endpoint transport://address"),
    ("--bus-control", "tcp://127.0.0.1", "bus.control: 'tcp://127.0.0.1' has no port from 0 to 65535"),
    ("--bus-control", "tcp://127.0.0.1:70000", "bus.control: 'tcp://127.0.0.1:70000' has no port from 0 to 65535"),
    ("--bus-events-in", "tcp://127.0.0.1:-1", "bus.events_in: 'tcp://127.0.0.1:-1' has no port"),
    ("--ps-manager", "inproc://manager", "ps.manager: 'inproc://manager' is not an endpoint"),
    ("--env-server-endpoint", "ipc://", "env_server.endpoint: 'ipc://' names no path"),
    ("--trainer-endpoint", "tcp://not a host:0", "trainer.endpoint: 'not a host' is not a host name or IP address"),
    ("--rollout-endpoint", "tcp://[nope]:0", "rollout.endpoint: '[nope]' is not a host name or IP address"),
    ("--node-metrics-host", "not a host", "node.metrics_host: 'not a host' is not a host name or IP address"),
    ("--node-metrics-host", "", "node.metrics_host: '' is not a host name or IP address"),
    ("--node-host", "*", "node.host: '*' is not a host name or IP address"),
])
def test_a_word_endpoint_or_host_no_node_could_use_is_refused_naming_its_key(flag: str, value: str,
                                                                            says: str) -> None:
    """Before, strings went unchecked: an unknown log level was a KeyError in every node, an endpoint without a
    port or transport a ZeroMQ traceback (blamed on security where the node binds it), a port above 65535 was
    used modulo 65536, a metrics host with a space a gaierror, an unknown log format silently the default."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        load(f"{flag}={value}")


def test_every_endpoint_form_a_cluster_uses_is_accepted() -> None:
    config = load("--bus-control", "tcp://*:7770", "--bus-events-in", "tcp://[::1]:0", "--bus-events-out",
                  "ipc:///tmp/refbus-events", "--ps-manager", "tcp://ps.example.com:65535", "--ps-worker",
                  "ws://0.0.0.0:0/refbus", "--node-host", "node-7.cluster.local", "--node-metrics-host", "::",
                  "--node-log-level", "debug", "--node-log-format", "json")
    assert (config.bus.control, config.node.host, config.node.log_level) == ("tcp://*:7770", "node-7.cluster.local",
                                                                            "debug")
    # ZeroMQ's ephemeral-port form (what wildcard_port makes of :0) was refused as having no port.
    config = load("--bus-control", "tcp://127.0.0.1:*", "--bus-events-in", "tcp://*:*")
    assert (config.bus.control, config.bus.events_in) == ("tcp://127.0.0.1:*", "tcp://*:*")
    with pytest.raises(ConfigError, match=re.escape("'tcp://127.0.0.1:**' has no port from 0 to 65535 or *")):
        load("--bus-control", "tcp://127.0.0.1:**")


def test_every_key_that_holds_an_endpoint_is_checked_as_one() -> None:
    """A new endpoint key gets the check when it is declared (its default is a tcp:// endpoint)."""
    defaults = {f"{section}.{key}": value for section, values in dataclasses.asdict(Config()).items()
                for key, value in values.items()}
    assert {key for key, value in defaults.items() if str(value).startswith("tcp://")} == set(ENDPOINTS)


def test_a_node_given_a_bad_endpoint_says_so_and_exits_2() -> None:
    """Before: a ZeroMQ traceback, blaming security (``refusing to bind notanendpoint: other hosts could reach
    it``) where the broker binds it."""
    for flags in (["node", "bus", "--bus-control", "notanendpoint"],
                  ["nodes", "--bus-control", "tcp://127.0.0.1:73306"]):
        result = refbus(*flags)
        assert result.returncode == 2 and result.stderr.startswith("refbus: bus.control: "), result.stderr
        assert "Traceback" not in result.stderr and "security" not in result.stderr


@pytest.mark.parametrize("run", ["../escaped", "/abs", "a/b", "a.b", ".", "..", "-x", "a\nb", "a\0b", "r\u00e9",
                                 "r" * 129])
def test_a_run_id_that_would_name_another_directory_is_refused(run: str) -> None:
    """Before, ``store.run`` went unchecked: ``refbus up`` wrote its trainers' checkpoints in ``checkpoints/<run>``
    (``../escaped`` out of the run directory, ``/abs`` anywhere), and store directories ``refbus-store.<run>.<node>``
    of runs ``a/b`` and ``a_b`` (or run ``a.b``'s node ``c`` and run ``a``'s node ``b.c``) were one: each adopted the
    other's journal. A run id is letters, digits, '_' and '-', so the first '.' ends it."""
    with pytest.raises(ConfigError, match=r"^store\.run: run id .* is not 1 to 128 letters, digits, '_' or '-'"):
        load(f"--store-run={run}")


def test_a_node_given_a_bad_run_id_says_so_and_exits_2_and_a_good_one_loads() -> None:
    result = refbus("config", "show", "--store-run", "../escaped")
    assert result.returncode == 2 and result.stderr.startswith("refbus: store.run: run id '../escaped'"), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    for run in ("up-0a1b2c", "R_" + "9" * 126, ""):
        assert load("--store-run", run).store.run == run


@pytest.mark.parametrize("prefix", ["", "a/b", "../escaped", "/abs", ".", "..", "a\0b", "p" * 129])
def test_a_segment_prefix_that_is_no_part_of_a_file_name_is_refused(prefix: str) -> None:
    """Before, a ps-worker made ``<ps.shm_dir>/<prefix>.<token>.lock``: ``a/b`` died of a bare FileNotFoundError
    traceback (exit 1, restarted into it again) and ``../x`` wrote outside ``ps.shm_dir``."""
    with pytest.raises(ConfigError, match=r"^ps\.shm_prefix must be 1 to 128 characters of one file name"):
        load(f"--ps-shm-prefix={prefix}")


def test_a_ps_worker_given_a_bad_segment_prefix_says_so_and_exits_2(tmp_path: Path) -> None:
    result = refbus("node", "ps-worker", "--ps-shm-prefix", "a/b", "--ps-shm-dir", str(tmp_path),
                    "--store-durable", "false", "--bus-control", "tcp://127.0.0.1:9", "--node-connect-timeout-s", "1")
    assert result.returncode == 2 and result.stderr.startswith("refbus: ps.shm_prefix must be"), result.stderr
    assert "Traceback" not in result.stderr and list(tmp_path.iterdir()) == []
    assert load("--ps-shm-prefix", "refbus-test-x[cluster0]-1.p").ps.shm_prefix == "refbus-test-x[cluster0]-1.p"


def test_the_ring_holds_at_least_one_message() -> None:
    assert load("--bus-ring-events", "1").bus.ring_events == 1
    for bad in ("0", "-5"):
        with pytest.raises(ConfigError, match=r"bus\.ring_events must be from 1 to"):
            load("--bus-ring-events", bad)


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--bus-heartbeat-interval-s", "0", "bus.heartbeat_interval_s must be at least 0.001 seconds, got 0.0"),
    ("--bus-heartbeat-interval-s", "1e-6", "bus.heartbeat_interval_s must be at least 0.001 seconds, got 1e-06"),
    ("--node-shutdown-timeout-s", "-1", "node.shutdown_timeout_s must be at least 0.001 seconds, got -1.0"),
    ("--env-server-generate-timeout-s", "-5", "env_server.generate_timeout_s must be at least 0.001 seconds"),
    ("--up-restart-backoff-s", "-0.5", "up.restart_backoff_s must be 0 or at least 0.001 seconds, got -0.5"),
    ("--up-restart-backoff-s", "1e-9", "up.restart_backoff_s must be 0 or at least 0.001 seconds, got 1e-09"),
    ("--bus-metrics-port", "70000", "bus.metrics_port must be from -1 to 65535, got 70000"),
    ("--requests-attempts", "0", "requests.attempts must be from 1 to 1000, got 0"),
    ("--up-restart-budget", "-1", "up.restart_budget must be from 0 to"),
])
def test_a_duration_count_or_port_that_would_break_a_node_is_refused(flag: str, value: str, says: str) -> None:
    """Before, a zero heartbeat interval passed (its relation only compares keys) and every node that joined spun
    in its timers for good, as it still did at 1e-6 s; a negative shutdown timeout made every stop a kill."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        load(flag, value)


@pytest.mark.parametrize(("key", "value", "says"), [
    ("trainer.batch_timeout_s", "inf", "trainer.batch_timeout_s must be a finite number, got inf"),
    ("up.restart_backoff_s", "nan", "up.restart_backoff_s must be a finite number, got nan"),
    ("node.shutdown_timeout_s", "nan", "node.shutdown_timeout_s must be a finite number, got nan"),
    ("ps.push_timeout_s", "-inf", "ps.push_timeout_s must be a finite number, got -inf"),
    ("rl.lr", "nan", "rl.lr must be a finite number, got nan"),
    ("trainer.batch_timeout_s", "1e300", "trainer.batch_timeout_s must be at most 31536000 seconds (a year)"),
    ("up.checkpoint_every", "-1", "up.checkpoint_every must be 0 or more, got -1"),
    ("trainer.checkpoint_every", "-3", "trainer.checkpoint_every must be 0 or more, got -3"),
    ("up.trainers", "0", "up.trainers must be 1 or more, got 0"),
    ("up.steps", "-5", "up.steps must be 1 or more, got -5"),
    ("up.env_servers", "-1", "up.env_servers must be 1 or more, got -1"),
    ("orchestrator.seed", "-1", "orchestrator.seed must be 0 or more, got -1"),
    ("ps.replicas", "0", "ps.replicas must be 1 or more, got 0"),
])
def test_a_number_no_node_could_use_is_refused_from_a_file_and_from_a_flag(tmp_path: Path, key: str, value: str,
                                                                           says: str) -> None:
    """Before, nan passed every check (``nan < 0`` is false: a restart backoff of nan never ended), inf and
    huge durations overflowed in a node (a trainer's process group timeout), and whole numbers outside
    :data:`RANGES` went unchecked (``up.checkpoint_every = -1`` had the ranks checkpoint every step while the
    launcher took checkpoints for off)."""
    section, name = key.split(".")
    path = tmp_path / "cluster.toml"
    path.write_text(f"[{section}]\n{name} = {value}\n")  # TOML spells nan, inf and -inf as Python does
    with pytest.raises(ConfigError, match=re.escape(says)):
        load(config_file=path)
    with pytest.raises(ConfigError, match=re.escape(says)):
        load(f"--{section}-{name}".replace("_", "-") + f"={value}")  # "=": a flag's value may start with "-"


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--requests-backoff", "0", "requests.backoff must be 1 or more, got 0.0"),
    ("--requests-backoff", "1e-9", "requests.backoff must be 1 or more, got 1e-09"),
    ("--requests-backoff", "0.5", "requests.backoff must be 1 or more, got 0.5"),
    ("--rl-temperature", "0", "rl.temperature must be above 0, got 0.0"),
    ("--rl-temperature", "-1", "rl.temperature must be above 0, got -1.0"),
    ("--rl-lr", "-1", "rl.lr must be above 0, got -1.0"),
    ("--rl-lr", "0", "rl.lr must be above 0, got 0.0"),
    ("--env-server-high-water", "7", "env_server.high_water must be above 0 and at most 1, got 7.0"),
    ("--env-server-high-water", "0", "env_server.high_water must be above 0 and at most 1, got 0.0"),
])
def test_a_real_number_no_node_could_use_is_refused(flag: str, value: str, says: str) -> None:
    """Before, only whole numbers and durations had bounds: a backoff of 0 killed the orchestrator at start
    (a division by the zero last timeout of its retry schedule) and 1e-9 had it build a schedule of 1e19
    attempts; a temperature of 0 or a high water of 7 passed the config and failed in the node."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        load(f"{flag}={value}")


def test_the_real_number_bounds_admit_their_edges() -> None:
    config = load("--requests-backoff", "1", "--env-server-high-water", "1", "--rl-temperature", "1e-3",
                  "--bus-heartbeat-interval-s", "0.001")
    assert (config.requests.backoff, config.env_server.high_water) == (1.0, 1.0)


def test_a_frame_cap_must_admit_the_largest_body_the_limits_admit() -> None:
    """Before, ``limits.max_frame_bytes = 0`` (or any cap under a body) passed the range check, and ZeroMQ then
    dropped every larger frame without a word: a broker started with it answered no one."""
    least = Config().limits.max_body_bytes + ONE_FRAME_OVERHEAD
    for bad in (0, 1, least - 1):
        with pytest.raises(ConfigError, match=r"limits\.max_frame_bytes must be -1 \(no cap\) or at least "
                                              rf"limits\.max_body_bytes \+ 4357 .* = {least}, got {bad}"):
            load("--limits-max-frame-bytes", str(bad))
    assert load("--limits-max-frame-bytes", str(least)).limits.max_frame_bytes == least
    # Checked against the effective body limit: a larger body needs a larger cap.
    with pytest.raises(ConfigError, match=r"limits\.max_body_bytes"):
        load("--limits-max-frame-bytes", str(least), "--limits-max-body-bytes", str(least))
    # No frame is larger than a whole message: a smaller max_message_bytes is the floor (it was refused).
    message = 1 << 20
    assert load("--limits-max-message-bytes", str(message), "--limits-max-frame-bytes",
                str(message)).limits.max_frame_bytes == message
    with pytest.raises(ConfigError, match=rf"or limits\.max_message_bytes where that is smaller .* = {message}, "
                                          rf"got {message - 1}"):
        load("--limits-max-message-bytes", str(message), "--limits-max-frame-bytes", str(message - 1))
    (field,) = [f for f in dataclasses.fields(Config().limits) if f.name == "max_frame_bytes"]
    assert str(ONE_FRAME_OVERHEAD) in field.metadata["help"]  # the settings module imports no envelope


def test_every_whole_number_key_has_a_range_but_the_seed_of_the_weights() -> None:
    """A new count gets its bounds when it is declared; the weights' seed is any integer torch takes."""
    whole = {f"{section}.{key.name}" for section, values in dataclasses.asdict(Config()).items()
             for key in dataclasses.fields(getattr(Config(), section)) if type(values[key.name]) is int}
    assert whole - set(RANGES) == {"rl.seed"}


def test_zero_means_none_for_a_grace_or_a_backoff() -> None:
    config = load("--up-restart-backoff-s", "0", "--node-restart-grace-s", "0",
                  "--env-server-handover-lease-s", "100")
    assert (config.up.restart_backoff_s, config.node.restart_grace_s) == (0.0, 0.0)


def test_the_secret_is_never_shown_and_only_its_owner_reads_the_nodes_config(tmp_path: Path) -> None:
    shown = subprocess.run([sys.executable, "-m", "refbus.nodes.cli", "config", "show"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "REFBUS_SECRET": "hunter2-topsecret"})
    assert shown.returncode == 0, shown.stderr
    assert "hunter2" not in shown.stdout and "# secret = (set, not shown)" in shown.stdout
    path = tmp_path / "shown.toml"
    path.write_text(shown.stdout)
    assert load(config_file=path).security.secret == ""  # signs nothing until the secret is given again

    config = Config()
    config.security = dataclasses.replace(config.security, secret="hunter2-topsecret")
    (workdir := tmp_path / "run").mkdir()
    cluster = LocalCluster(config, workdir)
    assert cluster.config_file.stat().st_mode & 0o777 == 0o600
    assert load(config_file=cluster.config_file).security.secret == "hunter2-topsecret"
    cluster.pin("trainer", steps=3)  # replaced whole, still private
    assert cluster.config_file.stat().st_mode & 0o777 == 0o600 and list(workdir.iterdir()) == [cluster.config_file]
    assert load(config_file=cluster.config_file).trainer.steps == 3


def test_every_string_reads_back_from_the_toml_written_for_it(tmp_path: Path) -> None:
    """Before, only backslash and quote were escaped: a secret from ``base64`` (wrapped at 76 characters) or
    any other value with a control character was written as invalid TOML, and every node ``refbus up``
    started failed to load its cluster.toml."""
    every_control = "".join(chr(c) for c in [*range(0x20), 0x7F])
    for text in (every_control, "a\\b\"c\\u0041\"\"\"", "é ☃ \U0001F600", "QUFB" * 19 + "\nQUFB"):
        config = Config()
        config.cluster = dataclasses.replace(config.cluster, name=text)
        config.security = dataclasses.replace(config.security, secret=text)
        path = tmp_path / "cluster.toml"
        path.write_text(to_toml(config, secrets=True))
        loaded = load(config_file=path)
        assert (loaded.cluster.name, loaded.security.secret) == (text, text)
    (workdir := tmp_path / "run").mkdir()
    assert load(config_file=LocalCluster(config, workdir).config_file).security.secret == text


def test_an_empty_secret_in_the_environment_is_refused_not_taken_for_none(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, ``REFBUS_SECRET=`` silently replaced the file's secret with none: the nodes ran unsigned."""
    path = tmp_path / "cluster.toml"
    path.write_text('[security]\nsecret = "from-the-file"\n')
    monkeypatch.setenv("REFBUS_SECRET", "")
    with pytest.raises(ConfigError, match=r"\$REFBUS_SECRET is set but empty"):
        load(config_file=path)
    monkeypatch.delenv("REFBUS_SECRET")
    assert load(config_file=path).security.secret == "from-the-file"


def test_up_refuses_two_config_files(tmp_path: Path) -> None:
    """Before, ``refbus up CONFIG --config OTHER`` silently used CONFIG."""
    one, other = tmp_path / "one.toml", tmp_path / "other.toml"
    one.write_text("[orchestrator]\nseed = 1\n")
    other.write_text("[orchestrator]\nseed = 2\n")
    with pytest.raises(ConfigError, match=r"two config files given, .*one\.toml \(CONFIG\) and .*other\.toml"):
        load_config(build_parser().parse_args(["up", str(one), "--config", str(other)]))
    assert load_config(build_parser().parse_args(["up", str(one)])).orchestrator.seed == 1
    assert load_config(build_parser().parse_args(["up", "--config", str(other)])).orchestrator.seed == 2


def test_a_timer_refuses_an_interval_that_would_never_let_the_loop_go() -> None:
    runtime = NodeRuntime("t", RuntimeSettings(node_id="t", metrics_port=-1), register=False)
    try:
        for bad in (0.0, -1.0):
            with pytest.raises(ValueError, match="above 0 seconds"):
                runtime.every(bad, lambda: None)
    finally:
        runtime.close()
