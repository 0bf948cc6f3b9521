"""The benches' cross-host modes end to end on tiny sizes, on namespace hosts (bench/hosts.py): every row is
there with a figure and a baseline, what was moved is checked (the benches raise on wrong bytes, and the
counts are asserted here), and nothing of the hosts is left. Timings are never asserted."""

from __future__ import annotations

import math

import torch

from bench import hosts, payload, ps
from bench.harness import MIB, format_table

CAP_BIT = 200_000_000  # slow enough to shape a 1 MiB checkpoint, fast enough to keep the test short


def _mine() -> set[str]:
    """This process's clusters that still exist (namespaces, mounts or state); other runs' are theirs."""
    owner = f"{hosts._this_owner()}-"
    return {name for name in hosts._known_clusters() if name.startswith(owner) and hosts.leftovers(name)}


def _complete(rows: list, count: int) -> None:
    assert len(rows) == count
    for row in rows:
        assert math.isfinite(row.refbus) and row.refbus > 0 and math.isfinite(row.baseline) and row.baseline > 0
    assert len(format_table(rows).splitlines()) == count + 1


def test_payload_fetch_across_hosts_moves_the_right_bytes_and_prints_every_row(make_hosts) -> None:
    make_hosts(1)  # skips (or fails under REFBUS_REQUIRE_NETNS=1) where hosts cannot be built
    before = _mine()
    shapes = ((4, 64 << 10), (2, 1 * MIB))
    settings = payload.Settings(repeats=1, shapes=shapes, in_flight_bytes=0)
    rows, extra = payload.run_across_hosts(settings)
    _complete(rows, 5 * len(shapes))
    assert {row.section for row in rows} == {"fetch across hosts"}
    assert all(figures["zmq_s"] > 0 for figures in extra["fetch"].values())  # the bare-ZeroMQ baseline ran there
    # Every blob of every step, the warm-up's included.
    assert [figures["samples_checked"] for figures in extra["fetch"].values()] == [
        count * (settings.repeats + 1) for count, _ in shapes]
    assert [h.split()[0] for h in extra["hosts"]] == ["hostA", "hostB", "hostC"]
    assert _mine() == before


def test_ps_across_hosts_pulls_pushes_and_broadcasts_under_caps_and_removes_them(make_hosts) -> None:
    make_hosts(1)
    before = _mine()
    torch.set_num_threads(1)
    settings = ps.Settings(state_bytes=2 * MIB, tensors=10, repeats=1, broadcast_sizes=(2, 4),
                           broadcast_bytes=1 * MIB, latency_pulls=1)
    rows, extra = ps.run_across_hosts(settings, CAP_BIT)
    _complete(rows, 2 + 2 * len(settings.broadcast_sizes))
    assert extra["transfer"]["frames"]["pull_s"] > 0  # the pull matched the push, or the bench raised
    for n in settings.broadcast_sizes:
        inits = extra["broadcast"][str(n)]
        assert inits["tree_reads"] == 1 and inits["star_reads"] == n - 1
        assert inits["rounds"] == math.ceil(math.log2(n))
    bound = [row for row in rows if "log2" in row.metric]
    assert [row.baseline for row in bound] == [ps.broadcast_bound_s(n, extra["broadcast"]["bytes"], CAP_BIT)
                                               for n in settings.broadcast_sizes]
    assert _mine() == before


def test_a_capped_link_shows_its_caps_and_uncap_or_teardown_removes_them(make_hosts) -> None:
    cluster = make_hosts(2)
    a, b = cluster
    a.cap(CAP_BIT)
    b.cap(CAP_BIT * 2)
    assert len(a.caps()) == 2 and all("rate 200Mbit" in line for line in a.caps())  # both directions
    a.uncap()
    a.uncap()  # nothing left to remove is fine
    assert a.caps() == [] and len(b.caps()) == 2
    cluster.down()  # the qdiscs go with the namespaces
    assert hosts.leftovers(cluster.name) == []
