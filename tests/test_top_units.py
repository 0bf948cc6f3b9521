"""`refbus top` without a cluster: its command line, its rows, the text table and the JSON it prints."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
from typing import Any

import pytest
from refbus.nodes import cli
from refbus.nodes.cli import build_parser
from refbus.nodes.config import Config
from refbus.nodes.top import Top, format_table, rows
from refbus.protocol.messages import NodeInfo, NodeList


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "-inf", "soon"])
def test_a_bad_interval_is_refused_at_the_command_line(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["top", f"--interval={value}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--interval" in err and ("positive number of seconds" in err or "expected seconds" in err), err


def test_a_positive_interval_is_taken() -> None:
    assert build_parser().parse_args(["top", "--interval", "0.5"]).interval == 0.5
    assert build_parser().parse_args(["top"]).interval == 1.0


class _Closed:
    closed = 0

    def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("interval", [-1.0, 0.0, float("nan"), float("inf")])
def test_top_refuses_a_bad_interval_from_python_too(interval: float) -> None:
    top = Top.__new__(Top)
    top.runtime = _Closed()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="positive number of seconds"):
        top.run(once=False, interval_s=interval)
    assert top.runtime.closed == 1  # type: ignore[attr-defined]


# --- rows, the table, the JSON ---------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
HOSTILE = "h\x1b]0;pwned\x07\n"


def _nodes() -> list[NodeInfo]:
    return [NodeInfo("ro", "rollout", "h", 1, status={"version": -1.0}, last_seen=90.0),  # no (or torn) weights
            NodeInfo("pm", "ps-manager", HOSTILE, 2, status={"version": 7.0}, last_seen=90.0),
            NodeInfo("env", "env-server", "h", 3, status={"blobs_held": NAN, "bytes_held": INF}, last_seen=NAN),
            NodeInfo("tr\x1b[2J", "trainer", "h", 4, status={"step": NAN}, last_seen=90.0)]


def test_a_negative_or_non_finite_number_is_no_number() -> None:
    table = {r.node_id: r for r in rows(_nodes(), 100.0)}
    assert table["ro"].version is None and table["ro"].lag is None  # not -1, and no lag of newest + 1
    assert table["pm"].version == 7.0 and table["pm"].lag == 0.0
    env = table["env"]
    assert env.blobs_held is None and env.bytes_held is None and env.heartbeat_age_s == 0.0
    assert table["tr\x1b[2J"].version is None


def test_a_rollout_on_the_newest_version_lags_0_while_a_step_is_in_progress() -> None:
    """A trainer reports the step it trains: while it trains step 4 that is 5, one past the newest version (4).
    It set the newest, so rollout workers serving version 4 read a lag of 1. A step sets none now, and no
    garbage number (NaN, negative, not a number) does either."""
    nodes = [NodeInfo("t0", "trainer", "h", 1, status={"step": 5.0}), NodeInfo("t1", "trainer", "h", 2, status={}),
             NodeInfo("pm", "ps-manager", "h", 3, status={"version": 4.0}),
             NodeInfo("r0", "rollout-worker", "h", 4, status={"version": 4.0}),
             NodeInfo("r1", "rollout-worker", "h", 5, status={"version": 3.0}),
             NodeInfo("bad", "rollout-worker", "h", 6, status={"version": NAN, "step": 9.0}),
             NodeInfo("neg", "rollout-worker", "h", 7, status={"version": -5.0})]
    assert {r.node_id: r.lag for r in rows(nodes, 0.0)} == {
        "t0": 0.0, "t1": None, "pm": 0.0, "r0": 0.0, "r1": 1.0, "bad": None, "neg": None}
    assert {r.node_id: r.lag for r in rows(nodes[:2], 0.0)} == {"t0": None, "t1": None}  # no version: no newest


def test_the_table_escapes_what_nodes_report() -> None:
    text = format_table(rows(_nodes(), 100.0), "title\x1b[H")
    assert all(line.isprintable() for line in text.splitlines())
    assert text.count("\n") == 6  # title, header, four rows: a newline in a host name breaks no line
    assert "h\\x1b]0;pwned\\x07\\x0a" in text and "tr\\x1b[2J" in text and "title\\x1b[H" in text
    ro = next(line for line in text.splitlines() if line.startswith("ro "))
    assert ro.split()[6:8] == ["-", "-"]  # VERSION and LAG


def _strict(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_top_json_is_strict_json_of_the_form_its_help_says(capsys: pytest.CaptureFixture[str]) -> None:
    top = Top.__new__(Top)
    top.as_json, top.out = True, io.StringIO()
    table = rows(_nodes(), 100.0)
    top.show([*table, dataclasses.replace(table[0], node_id="late", heartbeat_age_s=NAN, lag=INF)])
    shown: Any = _strict(top.out.getvalue())  # type: ignore[union-attr]
    assert shown["omitted"] == 0
    # The help said "each table as a JSON array" after top had come to print one object per refresh.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["top", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert sorted(shown) == ["nodes", "omitted"] and '{"nodes": [...], "omitted": N}' in said, said
    found = {row["node_id"]: row for row in shown["nodes"]}
    assert found["ro"]["version"] is None and found["env"]["blobs_held"] is None
    assert found["late"]["heartbeat_age_s"] is None and found["late"]["lag"] is None
    assert found["pm"]["host"] == HOSTILE  # JSON escapes it itself


class _Registry:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def listing(self, role: str) -> NodeList:
        return NodeList(_nodes())

    def close(self) -> None:
        pass


@pytest.mark.parametrize("as_json", [True, False])
def test_refbus_nodes_prints_strict_json_and_escaped_text(as_json: bool, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "NodeRuntime", _Registry)
    assert cli._list_nodes(Config(), argparse.Namespace(role="", json=as_json)) == 0
    out = capsys.readouterr().out
    if as_json:
        found = {node["node_id"]: node for node in _strict(out)}  # type: ignore[union-attr]
        assert found["env"]["status"]["blobs_held"] is None and found["env"]["last_seen"] is None
    else:
        assert "\x1b" not in out and "\x07" not in out and out.count("\n") == 4
        assert "h\\x1b]0;pwned\\x07\\x0a:2" in out
