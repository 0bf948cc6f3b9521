"""The README's references stay true: every config key documented, every documented command real."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from refbus.nodes.cli import ROLES, build_parser
from refbus.nodes.config import Config

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_config_key_is_in_the_readme_reference() -> None:
    config = Config()
    keys = {f"{section.name}.{key.name}" for section in dataclasses.fields(config)
            for key in dataclasses.fields(getattr(config, section.name))}
    documented = set(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", README, flags=re.MULTILINE))
    assert keys == documented


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
