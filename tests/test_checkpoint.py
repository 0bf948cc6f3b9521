"""Trainer checkpoints: weights and optimizer state come back bit-exact (and training on from them matches
training on without the round trip); a process killed with SIGKILL while it writes, a torn file or garbage
under a checkpoint's name leave the previous checkpoint in use, with a warning naming the file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from polling import wait_for
from refbus.nodes.rl import checkpoint
from refbus.nodes.toy.policy import make_policy
from refbus.nodes.toy.train import make_optimizer
from structlog.testing import capture_logs


def _trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A toy policy and its Adam after ``steps`` updates on a fixed loss (every state tensor non-trivial)."""
    torch.manual_seed(seed)
    model = make_policy(seed)
    optimizer = make_optimizer(model, 5e-3)
    for _ in range(steps):
        _update(model, optimizer)
    return model, optimizer


def _update(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    loss.backward()  # type: ignore[union-attr]
    optimizer.step()


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            _assert_same_state(x, y)
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), key
        elif isinstance(x, list | tuple):
            assert list(x) == list(y), key
        else:
            assert x == y, key


def test_round_trip_is_bit_exact_and_training_goes_on_identically(tmp_path: Path) -> None:
    model, optimizer = _trained(0, 3)
    path = checkpoint.save(tmp_path, 1, 3, model, optimizer)
    assert path == tmp_path / "rank-1" / "step-3.safetensors" and checkpoint.latest_step(tmp_path, 1) == 3

    restored, restored_optimizer = _trained(7, 0)  # other weights, an empty optimizer state
    checkpoint.load(tmp_path, 1, 3, restored, restored_optimizer)
    _assert_same_state(model.state_dict(), restored.state_dict())
    _assert_same_state(optimizer.state_dict(), restored_optimizer.state_dict())

    _update(model, optimizer)
    _update(restored, restored_optimizer)
    _assert_same_state(model.state_dict(), restored.state_dict())
    _assert_same_state(optimizer.state_dict(), restored_optimizer.state_dict())


def test_older_checkpoints_are_pruned_and_ranks_are_kept_apart(tmp_path: Path) -> None:
    model, optimizer = _trained(0, 1)
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, 0, step, model, optimizer)
    assert sorted(p.name for p in (tmp_path / "rank-0").iterdir()) == ["step-4.safetensors", "step-6.safetensors"]
    assert checkpoint.latest_step(tmp_path, 0) == 6 and checkpoint.latest_step(tmp_path, 1) == 0
    os.makedirs(tmp_path / "rank-1")  # rank 0's file under rank 1's name: refused, not loaded
    os.link(tmp_path / "rank-0" / "step-6.safetensors", tmp_path / "rank-1" / "step-6.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match="rank 0 step 6, not rank 1 step 6"):
        checkpoint.load(tmp_path, 1, 6, model, optimizer)
    assert checkpoint.latest_step(tmp_path, 1) == 0


@pytest.mark.parametrize("damage", ["torn", "garbage", "foreign"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, damage: str) -> None:
    model, optimizer = _trained(0, 1)
    checkpoint.save(tmp_path, 0, 2, model, optimizer)
    newest = checkpoint.save(tmp_path, 0, 4, model, optimizer)
    if damage == "torn":
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    elif damage == "garbage":
        newest.write_bytes(os.urandom(4096))
    else:  # a valid safetensors file that is not a trainer checkpoint
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(3)}, newest)
    with capture_logs() as logs:
        assert checkpoint.latest_step(tmp_path, 0) == 2
    warnings = [e for e in logs if e["event"] == "checkpoint.unreadable"]
    assert len(warnings) == 1 and warnings[0]["path"] == str(newest) and warnings[0]["log_level"] == "warning"
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(tmp_path, 0, 4, model, optimizer)


WRITER = """
import sys, torch
from refbus.nodes.rl import checkpoint
directory = sys.argv[1]
model = torch.nn.Linear(1024, 1024)
optimizer = torch.optim.Adam(model.parameters())
model(torch.ones(1, 1024)).sum().backward()
optimizer.step()
checkpoint.save(directory, 0, 1, model, optimizer)
print("first", flush=True)
step = 2
while True:
    checkpoint.save(directory, 0, step, model, optimizer)
    step += 1
"""


def test_sigkill_while_writing_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    """A writer saves step 1, then saves step after step (12 MiB each); it is killed while a temporary file
    exists: the newest complete checkpoint is read, the torn temporary one ignored and removed by the next
    write."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "first"
        folder = tmp_path / "rank-0"
        wait_for(lambda: any(p.name.endswith(".tmp") for p in folder.iterdir()), 60.0, "a checkpoint being written",
                 poll_s=0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    complete = [p for p in folder.iterdir() if not p.name.endswith(".tmp")]
    newest = checkpoint.latest_step(tmp_path, 0)
    assert newest >= 1 and folder / f"step-{newest}.safetensors" in complete
    model, optimizer = torch.nn.Linear(1024, 1024), None
    optimizer = torch.optim.Adam(model.parameters())
    checkpoint.load(tmp_path, 0, newest, model, optimizer)
    checkpoint.save(tmp_path, 0, newest + 1, model, optimizer)
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
