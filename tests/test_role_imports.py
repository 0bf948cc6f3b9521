"""Importing the CLI and resolving ``refbus node <role>`` loads that role's modules only (checked per role in a
fresh interpreter): no other role's entry, no other command's module, and nothing the role must not load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from refbus.nodes.cli import ROLES

COMMANDS = ("refbus.nodes.up", "refbus.nodes.top", "refbus.nodes.monitor", "refbus.nodes.ledger",
            "refbus.nodes.launch")
PAYLOAD, PS, RL, TOY = "refbus.nodes.payload", "refbus.nodes.ps", "refbus.nodes.rl", "refbus.nodes.toy"

# Beyond every other role's entry module: what each role must never load (a package means all of it).
NEVER: dict[str, tuple[str, ...]] = {
    "bus": ("torch", PAYLOAD, PS, RL, TOY),
    "env-server": ("torch", PS, RL, TOY, f"{PAYLOAD}.orchestrator", f"{PAYLOAD}.trainer", f"{PAYLOAD}.fetcher"),
    "orchestrator": ("torch", PS, RL, TOY, f"{PAYLOAD}.env_server", f"{PAYLOAD}.keeper", f"{PAYLOAD}.trainer"),
    "ps-manager": ("torch", PAYLOAD, RL, TOY, f"{PS}.client"),
    "ps-worker": ("torch", PAYLOAD, RL, TOY, f"{PS}.client", f"{PS}.staleness"),
    "trainer": (TOY, f"{PAYLOAD}.env_server", f"{PAYLOAD}.orchestrator", f"{PS}.manager", f"{PS}.worker"),
    "rollout": (PAYLOAD, TOY, f"{PS}.manager", f"{PS}.worker"),
}


def loaded_after_resolving(role: str) -> set[str]:
    code = ("import json, sys\n"
            "from refbus.nodes.cli import build_parser, role_entry\n"
            f"args = build_parser().parse_args(['node', {role!r}])\n"
            "role_entry(args.role)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout))


def test_every_role_is_checked() -> None:
    assert set(NEVER) == set(ROLES)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_resolving_a_role_loads_only_that_role(role: str) -> None:
    loaded = loaded_after_resolving(role)
    own = ROLES[role][1].partition(":")[0]
    assert own in loaded
    # The broker's entry lives in the CLI module itself, which every role loads.
    others = {entry.partition(":")[0] for name, (_, entry) in ROLES.items() if name != role} - {own, "refbus.nodes.cli"}
    never = (*others, *COMMANDS, *NEVER[role])
    wrong = sorted(m for m in loaded if any(m == p or m.startswith(f"{p}.") for p in never))
    assert wrong == [], f"refbus node {role} loads {wrong}"
