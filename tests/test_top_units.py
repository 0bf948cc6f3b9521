"""`refbus top` without a cluster: its command line, its rows, the text table and the JSON it prints."""

from __future__ import annotations

import pytest
from refbus.nodes.cli import build_parser


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
    from refbus.nodes.top import Top

    top = Top.__new__(Top)
    top.runtime = _Closed()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="positive number of seconds"):
        top.run(once=False, interval_s=interval)
    assert top.runtime.closed == 1  # type: ignore[attr-defined]
