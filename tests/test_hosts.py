"""The namespace-host harness itself (bench/hosts.py): names resolve everywhere, each host has its own host
name and /dev/shm, and nothing is left behind: not after a clean teardown, not after SIGTERM, not after the
owner was killed with SIGKILL (the next build sweeps it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from polling import read_line, wait_for

from bench import hosts

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 10.0

IDENTITY = """
import json, socket, sys
print(json.dumps({"hostname": socket.gethostname(),
                  "resolved": {name: socket.gethostbyname(name) for name in sys.argv[1:]}}))
"""

LISTEN = """
import socket, sys
server = socket.create_server(("0.0.0.0", 0))
print(server.getsockname()[1], flush=True)
server.settimeout(float(sys.argv[1]))
conn, _ = server.accept()
conn.sendall(socket.gethostname().encode())
conn.close()
"""

CONNECT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as conn:
    print(conn.recv(64).decode())
"""


def _python(host: hosts.Host, script: str, *args: str) -> str:
    result = host.run([sys.executable, "-c", script, *args], timeout=WAIT_S)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_hosts_resolve_each_other_and_each_keeps_its_own_name_and_shm(make_hosts) -> None:
    cluster = make_hosts(3)
    names = [h.name for h in cluster]
    for host in cluster:
        seen = json.loads(_python(host, IDENTITY, *names))
        assert seen == {"hostname": host.name, "resolved": {h.name: h.address for h in cluster}}
        assert host.address.startswith("198.18.")

    b, c = cluster["hostB"], cluster["hostC"]
    listener = b.popen([sys.executable, "-c", LISTEN, str(WAIT_S)], stdout=subprocess.PIPE, bufsize=0)
    try:
        port = read_line(listener, WAIT_S)
        assert _python(c, CONNECT, "hostB", port, str(WAIT_S)) == "hostB"  # a TCP connection across the bridge
        assert listener.wait(WAIT_S) == 0
    finally:
        listener.stdout.close()  # type: ignore[union-attr]

    marker = f"refbus-hosts-test-{os.getpid()}"
    assert b.run(["sh", "-c", f"echo from-b > /dev/shm/{marker}"]).returncode == 0
    # Another process on B sees the same /dev/shm; C and the root namespace do not.
    assert b.run(["cat", f"/dev/shm/{marker}"]).stdout == "from-b\n"
    assert c.run(["ls", "/dev/shm"]).stdout == ""
    assert not Path("/dev/shm", marker).exists()
    assert (b.shm / marker).read_text() == "from-b\n"


def test_down_kills_every_process_inside_and_removes_everything(make_hosts) -> None:
    cluster = make_hosts(2)
    tracked = cluster["hostA"].popen(["sleep", "300"])
    # A grandchild nobody tracks (its parent exits at once): found through its network namespace.
    escaped = cluster["hostB"].run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"])
    stray = int(escaped.stdout)
    assert Path(f"/proc/{stray}").exists()
    assert hosts.leftovers(cluster.name)

    cluster.down()
    assert hosts.leftovers(cluster.name) == []
    assert tracked.poll() == -signal.SIGTERM
    wait_for(lambda: not Path(f"/proc/{stray}").exists(), WAIT_S, "the untracked process gone")
    cluster.down()  # idempotent


def _owner(*args: str) -> subprocess.Popen[bytes]:
    """A separate process that builds a cluster and prints its name; then waits to be signalled."""
    script = ("import sys, time; from bench import hosts; cluster = hosts.build(2); print(cluster.name, flush=True); "
              "time.sleep(float(sys.argv[1]))")
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, stdout=subprocess.PIPE, bufsize=0)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signalled_owner_leaves_nothing_after_the_next_build(make_hosts, sig: int) -> None:
    make_hosts(1)  # skips (or fails under REFBUS_REQUIRE_NETNS=1) where hosts cannot be built
    owner = _owner(str(WAIT_S * 3))
    try:
        name = read_line(owner, WAIT_S)
        assert hosts.CLUSTER_NAME.match(name) and hosts.leftovers(name)
        owner.send_signal(sig)
        assert owner.wait(WAIT_S) == (128 + sig if sig == signal.SIGTERM else -sig)  # SIGTERM: SystemExit
    finally:
        if owner.poll() is None:  # a failure above: SIGTERM lets it take its cluster down, SIGKILL if it hangs
            owner.terminate()
            try:
                owner.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                owner.kill()
                owner.wait()
        owner.stdout.close()  # type: ignore[union-attr]
    if sig == signal.SIGTERM:
        assert hosts.leftovers(name) == []  # its own handler took the cluster down
    else:  # nothing ran in the owner: the next build sweeps it (or another run's sweep did already)
        make_hosts(1)
        assert hosts.leftovers(name) == []


def test_bad_names_and_unknown_clusters_are_refused(make_hosts) -> None:
    make_hosts(1)
    for names in (["hostA", "hostA"], ["bridge"], ["no spaces"], ["-x"]):
        with pytest.raises(ValueError, match="host names"):
            hosts.build(len(names), names=names)
    cli = subprocess.run([sys.executable, "-m", "bench.hosts", "exec", "rbt1-1-0", "hostA", "--", "true"],
                         cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    assert cli.returncode == 1 and "no cluster 'rbt1-1-0'" in cli.stderr


def test_command_line_up_exec_down(make_hosts) -> None:
    make_hosts(1)

    def cli(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "bench.hosts", *args], cwd=ROOT, capture_output=True,
                                text=True, timeout=WAIT_S * 3)
        assert result.returncode == 0, result.stderr
        return result.stdout

    made = json.loads(cli("up", "2", "--names", "left,right"))
    name = made["cluster"]
    try:
        assert made["hosts"]["right"]["address"] == "198.18.0.2"
        assert cli("exec", name, "right", "--", "hostname") == "right\n"
        assert name not in hosts.sweep() and hosts.leftovers(name)  # kept: its owner is gone but it stays
    finally:
        assert cli("down", name).split() == [name]
    assert hosts.leftovers(name) == []
