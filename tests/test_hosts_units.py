"""bench/hosts.py's bookkeeping, without building namespaces (no root needed): reaping only the processes
teardown killed, teardown that runs whatever stopping the processes did, probes the sweep finds, and a
SIGTERM cleanup that cannot deadlock on the registry lock and unwinds the stack; names that carry the owner's start
time; teardown that tries every step; a command line that refuses what is not a cluster name."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from polling import read_line

from bench import hosts


def _exited_unreaped(proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``proc`` has exited, leaving it to be reaped (WNOWAIT: its status stays for Popen.wait)."""
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)


def test_reaping_collects_only_the_killed_survivors_not_other_children() -> None:
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    _exited_unreaped(other)
    _exited_unreaped(killed)
    hosts._reap_children([killed.pid, 1])  # pid 1 is no child of ours: ignored
    assert other.wait(timeout=10) == 3  # its exit status is still its own
    # Collected: no exit status is left to wait for. (Popen.poll cannot tell: it reports a child someone else
    # collected as ended too.)
    with pytest.raises(ChildProcessError):
        os.waitid(os.P_PID, killed.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    killed.poll()  # settles the Popen (ECHILD: ended, status unknown to it), so it does not warn at exit


class _Unkillable:
    """A Popen that never ends: every wait times out."""

    def __init__(self) -> None:
        self.signals: list[str] = []

    def poll(self) -> None:
        return None

    def terminate(self) -> None:
        self.signals.append("TERM")

    def kill(self) -> None:
        self.signals.append("KILL")

    def wait(self, timeout: float | None = None) -> int:
        raise subprocess.TimeoutExpired("unkillable", timeout or 0)


def test_stopping_a_process_that_will_not_die_gives_up_without_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosts, "STOP_TIMEOUT_S", 0.01)
    proc = _Unkillable()
    hosts._stop(proc)  # type: ignore[arg-type]
    assert proc.signals == ["TERM", "KILL"]


def test_down_tears_down_even_when_stopping_a_process_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    torn: list[str] = []
    stopped: list[object] = []

    def stop(proc: object) -> None:
        stopped.append(proc)
        raise subprocess.TimeoutExpired("stuck", 5.0)

    monkeypatch.setattr(hosts, "_stop", stop)
    monkeypatch.setattr(hosts, "_teardown", torn.append)
    cluster = hosts.Hosts("rbt1-1-0", ["hostA"])
    cluster.processes.append(object())  # type: ignore[arg-type]
    monkeypatch.setitem(hosts._live, cluster.name, cluster)
    with pytest.raises(subprocess.TimeoutExpired):
        cluster.down()
    assert len(stopped) == 1 and torn == ["rbt1-1-0"]


def test_a_probe_namespace_left_by_a_dead_owner_is_swept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = _fake_root(tmp_path, monkeypatch)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    probe = hosts._probe_name(f"rbt{dead.pid}-1")  # what a run killed between `ip netns add` and `del` leaves
    (hosts.NETNS_DIR / probe).touch()
    (cluster,) = hosts._known_clusters()
    assert probe.startswith(f"{cluster}-") and hosts.CLUSTER_NAME.match(cluster).group(1) == str(dead.pid)  # type: ignore[union-attr]
    assert hosts.sweep() == [cluster] and commands == [("ip", "netns", "del", probe)]


class _Cluster:
    def __init__(self) -> None:
        self.downs = 0

    def down(self) -> None:
        self.downs += 1


def test_the_sigterm_cleanup_runs_while_its_thread_holds_the_registry_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = _Cluster()
    monkeypatch.setitem(hosts._live, "rbt1-1-0", cluster)  # type: ignore[arg-type]
    done = threading.Event()

    def interrupted_under_the_lock() -> None:
        with hosts._live_lock:  # as build() holds it when SIGTERM's handler runs on the same thread
            hosts._down_all()  # the handler's body (before it re-raises SIGTERM)
        done.set()

    thread = threading.Thread(target=interrupted_under_the_lock, daemon=True)
    thread.start()
    finished = done.wait(10)
    if not finished:  # deadlocked: free it (a plain Lock may be released by any thread) and fail
        hosts._live_lock.release()
        thread.join(10)
    assert finished, "the SIGTERM cleanup deadlocked on _live_lock"
    assert cluster.downs == 1


def _fake_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Namespace and state directories under ``tmp_path``; every command is recorded and succeeds, ``ip netns
    del`` removes the (plain) file standing for the namespace. Returns the commands run."""
    commands: list[tuple[str, ...]] = []

    def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        commands.append(argv)
        if argv[:3] == ("ip", "netns", "del"):
            (hosts.NETNS_DIR / argv[3]).unlink()
        return subprocess.CompletedProcess(argv, 0, "", "")

    (tmp_path / "netns").mkdir()
    monkeypatch.setattr(hosts, "NETNS_DIR", tmp_path / "netns")
    monkeypatch.setattr(hosts, "STATE_ROOT", tmp_path / "state")
    monkeypatch.setattr(hosts, "_sh", sh)
    monkeypatch.setattr(hosts, "_pids_in", lambda inodes: [])  # these files are no namespaces: nothing to kill
    return commands


def _stale(name: str) -> None:
    """What a cluster ``name`` leaves: a namespace and its state directory."""
    (hosts.NETNS_DIR / f"{name}-hostA").touch()
    (hosts.STATE_ROOT / name).mkdir(parents=True)


def test_a_process_that_reuses_a_dead_owners_pid_is_not_its_owner(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_root(tmp_path, monkeypatch)
    mine = hosts._new_cluster_name()
    pid, start, _ = hosts.CLUSTER_NAME.match(mine).groups()  # type: ignore[union-attr]
    assert (int(pid), int(start)) == (os.getpid(), hosts._start_time(os.getpid()))
    reused = f"rbt{pid}-{int(start) - 1}-0"  # this pid, an earlier process: its owner is gone
    _stale(mine)
    _stale(reused)
    assert hosts.sweep() == [reused]
    assert hosts.leftovers(reused) == [] and hosts.leftovers(mine)


def test_a_name_that_exists_already_fails_the_build_and_leaves_that_cluster_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = _fake_root(tmp_path, monkeypatch)
    monkeypatch.setattr(hosts, "unsupported", lambda: None)
    monkeypatch.setattr(hosts, "_sequence", itertools.repeat(7))  # every name the same: a collision
    monkeypatch.setattr(hosts, "_teardown", lambda name: pytest.fail(f"tore down {name}"))
    kept = hosts.build(1, keep=True)  # as `python -m bench.hosts up` builds one, then exits
    assert (kept.state / hosts.KEEP_MARKER).exists()
    built = len(commands)
    with pytest.raises(RuntimeError, match=f"cluster {kept.name} exists already"):
        hosts.build(1, keep=True)
    assert (kept.state / hosts.KEEP_MARKER).exists() and len(commands) == built
    assert kept.name not in hosts._live


def test_the_default_names_of_the_most_hosts_are_valid_and_distinct(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_root(tmp_path, monkeypatch)
    monkeypatch.setattr(hosts, "unsupported", lambda: None)
    names = [host.name for host in hosts.build(hosts.MAX_HOSTS, keep=True)]
    assert names[:3] == ["hostA", "hostB", "hostC"] and names[25:28] == ["hostZ", "hostAA", "hostAB"]
    assert names[-1] == "hostGR"  # the 200th: 200 = 7 * 26 + 18
    assert len(set(names)) == len(names) == hosts.MAX_HOSTS
    assert all(hosts.HOST_NAME.match(name) and name != hosts.BRIDGE for name in names)


@pytest.mark.parametrize("name", ["*", "../../..", "rbt1-1-0-hostA", "rbt1-1-0/.."])
def test_down_refuses_what_is_not_a_cluster_name_before_removing_anything(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_root(tmp_path, monkeypatch)
    torn: list[str] = []
    monkeypatch.setattr(hosts, "_teardown", torn.append)
    monkeypatch.setattr(hosts, "sweep", list)
    with pytest.raises(SystemExit) as exited:
        hosts._main(["down", "rbt1-1-0", name])
    assert exited.value.code == 2 and torn == []
    assert f"not cluster names (rbt<pid>-<start>-<n>): {name!r}" in capsys.readouterr().err


def test_down_with_names_prints_only_those(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _fake_root(tmp_path, monkeypatch)
    torn: list[str] = []
    monkeypatch.setattr(hosts, "_teardown", torn.append)
    monkeypatch.setattr(hosts, "sweep", lambda: ["rbt2-2-0"])  # another run's stale cluster
    assert hosts._main(["down", "rbt1-1-0"]) == 0
    assert capsys.readouterr().out.split() == torn == ["rbt1-1-0"]


def test_teardown_runs_every_step_and_then_names_what_is_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = _fake_root(tmp_path, monkeypatch)
    fake = hosts._sh
    name = f"rbt{os.getpid()}-0-0"
    _stale(name)
    (hosts.NETNS_DIR / f"{name}-hostB").touch()
    (hosts.NETNS_DIR / f"{name}-hostC").touch()
    (hosts.STATE_ROOT / name / "hosts").touch()

    def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        if argv[-1].endswith("-hostA"):
            raise subprocess.TimeoutExpired(argv, hosts.COMMAND_TIMEOUT_S)
        if argv[-1].endswith("-hostB"):
            commands.append(argv)
            return subprocess.CompletedProcess(argv, 1, "", "Device or resource busy")
        return fake(*argv, check=check)

    monkeypatch.setattr(hosts, "_sh", sh)
    with pytest.raises(RuntimeError) as failed:
        hosts._teardown(name)
    # The timed-out and the failed deletion stopped none of the rest: hostC's namespace and the directory went.
    assert [argv[-1] for argv in commands] == [f"{name}-hostB", f"{name}-hostC"]
    assert hosts.leftovers(name) == [f"netns {name}-hostA", f"netns {name}-hostB"]
    message = str(failed.value)
    assert f"netns {name}-hostA" in message and f"{name}-hostA timed out" in message
    assert f"netns {name}-hostB" in message and "Device or resource busy" in message


def test_teardown_leaves_a_tmpfs_it_cannot_unmount_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_root(tmp_path, monkeypatch)
    name = f"rbt{os.getpid()}-0-0"
    _stale(name)
    shm = hosts.STATE_ROOT / name / "hostA" / "shm"
    shm.mkdir(parents=True)
    (shm / "segment").write_text("a host's data")
    monkeypatch.setattr(hosts, "_mounts_under", lambda directory: [str(shm)])  # umount "succeeds", stays
    with pytest.raises(RuntimeError, match=f"mount {shm}"):
        hosts._teardown(name)
    assert (shm / "segment").read_text() == "a host's data"


def test_a_stale_cluster_that_cannot_be_torn_down_is_a_warning_not_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_root(tmp_path, monkeypatch)
    stuck, gone = f"rbt{os.getpid()}-0-0", f"rbt{os.getpid()}-0-1"  # start time 0: owners that are gone
    _stale(stuck)
    _stale(gone)
    teardown = hosts._teardown

    def failing(name: str) -> None:
        if name == stuck:
            raise RuntimeError(f"processes [1] of {name} survived SIGKILL")
        teardown(name)

    monkeypatch.setattr(hosts, "_teardown", failing)
    with pytest.warns(RuntimeWarning, match=f"cannot sweep {stuck}.*survived SIGKILL"):
        assert hosts.sweep() == [gone]
    assert hosts.leftovers(gone) == [] and hosts.leftovers(stuck)


UNWOUND = """
import sys, time
from bench import hosts
hosts._install_cleanup()
try:
    print("ready", flush=True)
    time.sleep(float(sys.argv[1]))
finally:
    print("unwound", flush=True)
"""


def test_sigterm_takes_the_clusters_down_and_then_unwinds_the_stack() -> None:
    owner = subprocess.Popen([sys.executable, "-c", UNWOUND, "60"], cwd=Path(__file__).resolve().parents[1],
                             stdout=subprocess.PIPE, bufsize=0)
    try:
        assert read_line(owner, 30) == "ready"
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(30) == 128 + signal.SIGTERM
        assert read_line(owner, 30) == "unwound"  # the interrupted code's finally ran
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        owner.stdout.close()  # type: ignore[union-attr]
