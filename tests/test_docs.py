"""The README's references stay true: every config key documented, every documented command real."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from refbus.nodes.cli import ROLES, build_parser
from refbus.nodes.config import reference_tables

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_readme_configuration_reference_is_the_generated_one() -> None:
    start = README.index("| key | default | meaning |")
    documented = README[start:README.index("\n## ", start)]
    assert documented == reference_tables(), (
        "README's configuration reference is stale: replace it with the output of "
        "`python -c 'from refbus.nodes.config import reference_tables; print(reference_tables(), end=\"\")'`")


def test_every_command_in_the_readme_table_exists(capsys: pytest.CaptureFixture[str]) -> None:
    documented = set(re.findall(r"^\| `refbus ([a-z]+)", README, flags=re.MULTILINE))
    assert {"up", "node", "monitor", "top", "ledger", "nodes", "config"} <= documented
    for command in documented:
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([command, "--help"])
        assert exit_.value.code == 0, command
    capsys.readouterr()
    roles = set(re.findall(r"`refbus node ([a-z-]+)`", README))
    assert roles == set(ROLES)
