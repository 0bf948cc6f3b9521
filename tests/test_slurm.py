"""The README's SLURM script, submitted as written to a small Slurm cluster on namespace hosts.

Debian's ``slurm-wlm`` and ``munge``: munged in the root namespace (its socket is a file every host
reaches), slurmctld on hostA, slurmd on hostB and hostC, entered with ``nsenter --net`` (bench/hosts.py;
``ip netns exec`` would mount a fresh ``/sys`` and slurmd's cgroup check would fail). The job script and
the cluster file are the README's blocks; the job runs in a directory every host sees, as on a real
cluster with a shared file system. Only ``make slurm-test`` runs it (REFBUS_SLURM=1; it installs the
packages as root); without them it skips, or fails under REFBUS_REQUIRE_NETNS=1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from polling import wait_for
from test_readme_hosts import README, readme_recipe

from bench import hosts

BIN = Path(sys.executable).parent
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun")
WAIT_S = 30.0
JOB_S = 300.0  # the whole job: start, the ranks' steps, the ordered stop


def slurm_script(text: str) -> str:
    """The README's SLURM job script: the ``sh`` block of "Running for real" that starts with ``#!``."""
    start = text.index("## Running for real")
    section = text[start:text.index("\n## ", start)]
    blocks = re.findall(r"^```sh\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    (script,) = [b for b in blocks if b.startswith("#!/bin/bash")]
    return script


SLURM_CONF = """\
ClusterName=refbus
SlurmctldHost=hostA({address})
AuthType=auth/munge
AuthInfo=socket={socket}
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MailProg=/bin/true
ReturnToService=2
StateSaveLocation={state}/state
SlurmdSpoolDir={state}/spool/%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd-%n.log
NodeName=hostB,hostC CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=1000
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """munged, slurmctld on hostA, slurmd on hostB and hostC: :meth:`start` starts them, :meth:`stop` stops and
    reaps every one it started, also after a start that failed part way (the harness kills what is left in the
    hosts; munged runs in the root namespace, so only :meth:`stop` ends it)."""

    def __init__(self, cluster: hosts.Hosts, state: Path) -> None:
        self.cluster = cluster
        self.state = state
        self.procs: list[subprocess.Popen[bytes]] = []
        self.socket = state / "munge-socket" / "munge.sock"
        self.conf = state / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        """Start the daemons and wait until both nodes are idle."""
        state = self.state
        keys = state / "munge"
        keys.mkdir(mode=0o700, parents=True)
        self.socket.parent.mkdir(mode=0o755)
        subprocess.run(["mungekey", "-c", "-k", str(keys / "munge.key")], check=True, timeout=WAIT_S,
                       capture_output=True)
        self._start(None, ["munged", "-F", "--force", f"--key-file={keys / 'munge.key'}", f"--socket={self.socket}",
                           f"--pid-file={keys / 'munged.pid'}", f"--log-file={keys / 'munged.log'}",
                           f"--seed-file={keys / 'munged.seed'}"])
        wait_for(self.socket.exists, WAIT_S, "munged's socket")
        for node in ("hostB", "hostC"):
            (state / "spool" / node).mkdir(parents=True)
        (state / "state").mkdir()
        self.conf.write_text(SLURM_CONF.format(address=self.cluster["hostA"].address, socket=self.socket,
                                               state=state))
        self._start(self.cluster["hostA"], ["slurmctld", "-D", "-i"])
        for node in ("hostB", "hostC"):
            self._start(self.cluster[node], ["slurmd", "-D", "-N", node])

        def idle() -> bool:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")
            return sorted(line.strip() for line in states if line.strip()) == ["hostB idle", "hostC idle"]

        wait_for(idle, WAIT_S, f"hostB and hostC idle in Slurm\n{self.logs()}")

    def _start(self, host: hosts.Host | None, argv: list[str]) -> None:
        log = open(self.state / f"{argv[0]}-{len(self.procs)}.out", "wb")  # noqa: SIM115 - the child holds it
        with log:
            if host is None:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            else:
                proc = host.popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
        self.procs.append(proc)

    def run(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A Slurm client command on hostA (slurmd connects back to srun and sbatch there)."""
        return subprocess.run(self.cluster["hostA"].argv(argv), capture_output=True, text=True, timeout=WAIT_S,
                              env=env or self.env, check=False)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted(self.state.glob("*.log")) + sorted(self.state.glob("*.out")))

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, to each started daemon, the last started first; each one reaped."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(WAIT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(WAIT_S)


@pytest.fixture
def slurm(make_hosts, tmp_path: Path) -> Iterator[Slurm]:
    if os.environ.get("REFBUS_SLURM") != "1":
        pytest.skip("the SLURM test runs with `make slurm-test` (REFBUS_SLURM=1)")
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if missing:
        reason = f"Slurm is not installed ({', '.join(missing)}: Debian's slurm-wlm and munge)"
        if os.environ.get("REFBUS_REQUIRE_NETNS") == "1":
            pytest.fail(f"REFBUS_REQUIRE_NETNS=1 but {reason}")
        pytest.skip(reason)
    cluster = make_hosts(3, names=("hostA", "hostB", "hostC"))
    state = tmp_path / "slurm"
    state.mkdir()
    started = Slurm(cluster, state)
    try:
        started.start()  # inside the try: what a failed start did start is stopped too
        yield started
    finally:
        started.stop()


def test_the_readme_slurm_script_runs_as_written(slurm: Slurm, tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    recipe = readme_recipe(README.read_text())
    (job / "cluster.toml").write_text(recipe.cluster_toml)
    (job / "refbus.sbatch").write_text(slurm_script(README.read_text()))
    steps = tomllib.loads(recipe.cluster_toml)["trainer"]["steps"]
    env = {**slurm.env, "PATH": f"{BIN}:{os.environ['PATH']}"}  # the script's own keys secure it
    submitted = slurm.run("sbatch", "--parsable", f"--chdir={job}", f"--output={job}/slurm.out",
                          str(job / "refbus.sbatch"), env=env)
    assert submitted.returncode == 0, submitted.stderr + slurm.logs()
    job_id = submitted.stdout.strip().split(";")[0]

    def state() -> dict[str, str]:
        shown = slurm.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(field.split("=", 1) for field in shown.split() if "=" in field)

    ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
    output_path = job / "slurm.out"
    try:
        wait_for(lambda: state().get("JobState") in ended, JOB_S, f"job {job_id} to end", poll_s=0.5)
    finally:
        output = output_path.read_text(errors="replace") if output_path.exists() else "(no output yet)"
        print(output[-8000:])
    final = state()
    assert (final["JobState"], final["ExitCode"]) == ("COMPLETED", "0:0"), output[-6000:] + slurm.logs()
    trained = [r for r in events_in(output) if r.get("event") == "step.trained"]
    assert sorted(r["step"] for r in trained) == sorted(list(range(steps)) * 2), output[-6000:]


def events_in(output: str) -> Iterator[dict]:
    """The JSON log lines of the job's output (every node's stderr goes there)."""
    for line in output.splitlines():
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue

