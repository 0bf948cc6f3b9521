"""Trainer checkpoints: weights and optimizer state come back bit-exact (and training on from them matches
training on without the round trip); a process killed with SIGKILL while it writes, a torn file or garbage
under a checkpoint's name leave the previous checkpoint in use, with a warning naming the file. A world of
real gloo ranks whose directories hold an earlier world's files that got further agrees on a step every rank
has, and its own checkpoints are never pruned in favour of the earlier world's; the files above that step are
moved aside, never removed, so one rank's damaged checkpoints cost the other ranks none of theirs."""

from __future__ import annotations

import copy
import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from polling import wait_for
from refbus.nodes.halting import CONFIG_STATUS
from refbus.nodes.rl import checkpoint
from refbus.nodes.toy.policy import make_policy
from refbus.nodes.toy.train import make_optimizer
from refbus.nodes.up import rendezvous
from structlog.testing import capture_logs

WAIT_S = 60.0  # a spawned rank imports torch on a loaded machine; gloo's own timeout is 20 s


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
    _assert_restored_and_trains_on_alike((model, optimizer), (restored, restored_optimizer))


def _assert_restored_and_trains_on_alike(saved: tuple[torch.nn.Module, torch.optim.Optimizer],
                                         restored: tuple[torch.nn.Module, torch.optim.Optimizer]) -> None:
    """``restored`` (just loaded) holds what ``saved`` held, bit for bit, and stays so over one more step each."""
    for stepped in (False, True):
        if stepped:
            _update(*saved)
            _update(*restored)
        _assert_same_state(saved[0].state_dict(), restored[0].state_dict())
        _assert_same_state(saved[1].state_dict(), restored[1].state_dict())  # dtypes as saved


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


def test_a_checkpoint_of_other_dtypes_is_refused_naming_the_tensor_and_changes_nothing(tmp_path: Path) -> None:
    """Loading casts model weights silently: a float64 checkpoint into a float32 model would not be the state
    saved. Refused, the model and optimizer left as they were; so is optimizer state of another dtype or shape
    than the state the optimizer already holds."""
    model, optimizer = _trained(0, 2)
    checkpoint.save(tmp_path, 0, 2, model.double(), optimizer)  # weights float64, Adam's state still float32
    target, target_optimizer = _trained(1, 1)
    _assert_refused_unchanged(tmp_path, 2, target, target_optimizer,
                              r"model/\S+ is torch.float64 .*needs torch.float32")

    model, optimizer = _bf16_trained(0, 2)
    checkpoint.save(tmp_path, 0, 4, model, optimizer)
    target, target_optimizer = _bf16_trained(1, 1)
    for held in target_optimizer.state.values():  # an optimizer holding float32 state already
        held["buf"] = held["buf"].float()
    _assert_refused_unchanged(tmp_path, 4, target, target_optimizer,
                              r"optim/0/buf is torch.bfloat16 .*holds torch.float32")

    # Its parameters in another order: the file's state for the first weight would land on the last bias.
    target, _ = _bf16_trained(1, 0)
    target_optimizer = Bf16MomentSGD(list(target.parameters())[::-1])
    _update(target, target_optimizer)
    _assert_refused_unchanged(tmp_path, 4, target, target_optimizer,
                              r"optim/\d+/buf is torch.bfloat16 \(\d+, \d+\), this optimizer holds "
                              r"torch.bfloat16 \(\d+,\)")


def _assert_refused_unchanged(directory: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              match: str) -> None:
    """Loading ``step`` into ``model`` and ``optimizer`` raises a CheckpointMismatch (what a resuming rank takes for a
    configuration that cannot work) matching ``match`` and leaves both exactly as they were."""
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    with pytest.raises(checkpoint.CheckpointMismatch, match=match):
        checkpoint.load(directory, 0, step, model, optimizer)
    _assert_same_state(weights, model.state_dict())
    _assert_same_state(state, optimizer.state_dict())


class Bf16MomentSGD(torch.optim.Optimizer):
    """SGD with momentum kept in bfloat16 for float32 weights, as memory-saving optimizers keep their state."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p, dtype=torch.bfloat16))
                buf.mul_(0.9).add_(p.grad.to(torch.bfloat16))
                p.add_(buf.float(), alpha=-group["lr"])


def _bf16_trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = make_policy(seed)
    optimizer = Bf16MomentSGD(model.parameters())
    for _ in range(steps):
        _update(model, optimizer)
    return model, optimizer


def test_optimizer_state_of_another_dtype_than_its_parameters_comes_back_as_saved(tmp_path: Path) -> None:
    """torch's loading casts optimizer state to its parameter's dtype: bf16 moments of fp32 weights came back
    fp32 and were refused as cast, so a world whose optimizer keeps such state could never resume."""
    model, optimizer = _bf16_trained(0, 3)
    checkpoint.save(tmp_path, 0, 3, model, optimizer)
    restored, restored_optimizer = _bf16_trained(7, 0)  # other weights, an empty optimizer state
    checkpoint.load(tmp_path, 0, 3, restored, restored_optimizer)
    _assert_restored_and_trains_on_alike((model, optimizer), (restored, restored_optimizer))  # bfloat16, as saved


def test_a_write_below_the_newest_moves_the_files_above_it_aside(tmp_path: Path) -> None:
    """Files above the step written are an earlier lineage's: left in place, they would prune every new
    checkpoint; removed, a readable checkpoint would be lost. They are moved aside, loud, and still load."""
    model, optimizer = _trained(0, 1)
    with capture_logs() as logs:
        for step in (98, 100, 2, 4):
            checkpoint.save(tmp_path, 0, step, model, optimizer)
    assert _files(tmp_path, 0) == (["step-2.safetensors", "step-4.safetensors"],
                                   ["step-100.safetensors", "step-98.safetensors"])
    assert checkpoint.latest_step(tmp_path, 0) == 4 and checkpoint.latest_step(tmp_path, 0, at_most=3) == 2
    warnings = [e for e in logs if e["event"] == "checkpoint.superseded"]
    assert sorted(e["path"] for e in warnings) == [str(checkpoint.path_of(tmp_path, 0, s)) for s in (100, 98)]
    assert all(e["log_level"] == "warning" and e["cause"] == "step 2 was written below them" for e in warnings)
    _assert_moved_back_they_load(tmp_path, 0, [e["moved_to"] for e in warnings], 100)


def test_a_world_that_keeps_dying_in_a_checkpoint_round_keeps_one_copy_of_what_it_loses(tmp_path: Path) -> None:
    """Rank 0 writes step 4, rank 1 dies writing it, and the world resumes at 2 (rank 0 prunes to 2), again and
    again: each restart moves rank 0's step 4 aside, and its next write of step 4 removes the copy the previous
    restart moved, loud, so ``superseded/`` holds one step 4, not one per restart. An earlier lineage's
    checkpoints above every step written since stay, until the lineage training now writes their steps."""
    model, optimizer = _trained(0, 1)
    for step in (98, 100, 2):  # an earlier lineage, then a world started over at 0
        checkpoint.save(tmp_path, 0, step, model, optimizer)
    superseded = checkpoint.rank_dir(tmp_path, 0) / checkpoint.SUPERSEDED
    with capture_logs() as logs:
        for _ in range(4):
            checkpoint.save(tmp_path, 0, 4, model, optimizer)
            checkpoint.prune(tmp_path, 0, 2, cause="rank 1 has nothing whole above step 2")
            assert _files(tmp_path, 0) == (["step-2.safetensors"],
                                           ["step-100.safetensors", "step-4.safetensors", "step-98.safetensors"])
            assert len(list(superseded.iterdir())) == 2
    removed = [e for e in logs if e["event"] == "checkpoint.superseded_removed"]
    assert len(removed) == 3 and all(e["log_level"] == "warning" and e["holds"] == 4 for e in removed)
    for step in (4, 100):
        checkpoint.save(tmp_path, 0, step, model, optimizer)
    assert _files(tmp_path, 0) == (["step-100.safetensors", "step-4.safetensors"], [])
    assert not any(superseded.iterdir())


def _assert_moved_back_they_load(directory: Path, rank: int, moved: list[str], newest: int) -> None:
    """Checkpoints moved aside (``moved``: where to) are whole: moved back, the newest is ``newest`` and loads."""
    for aside in map(Path, moved):
        assert aside.parent.parent == checkpoint.rank_dir(directory, rank) / checkpoint.SUPERSEDED
        os.replace(aside, checkpoint.rank_dir(directory, rank) / aside.name)
    assert checkpoint.latest_step(directory, rank) == newest
    checkpoint.load(directory, rank, newest, *_trained(7, 0))


def _files(directory: Path | str, rank: int) -> tuple[list[str], list[str]]:
    """Rank ``rank``'s checkpoint files in place and those moved aside (any rewind), by name."""
    folder = checkpoint.rank_dir(directory, rank)
    return (sorted(p.name for p in folder.iterdir() if p.is_file()),
            sorted(p.name for p in (folder / checkpoint.SUPERSEDED).glob("*/*")))


def _world_rank(rank: int, init: str, directory: str, saves: list[int], conn: Connection) -> None:
    """One rank of a 2-rank gloo world: resume (as a trainer does), then save ``saves``; sends the step it
    resumed at, its files afterwards (:func:`_files`) and the causes of its ``checkpoint.superseded``
    warnings, or the error."""
    import types

    import torch.distributed as dist
    from refbus.nodes.config import ConfigError
    from refbus.nodes.rl.trainer import resume

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=20))
    try:
        model, optimizer = _trained(rank, 0)
        section: Any = types.SimpleNamespace(checkpoint_every=2, checkpoint_dir=directory)
        with capture_logs() as logs:
            try:
                first = resume(section, rank, model, optimizer)
            except (checkpoint.CheckpointError, ConfigError) as exc:
                conn.send(f"resume failed: {type(exc).__name__}: {exc}")
                return
            for step in saves:
                checkpoint.save(directory, rank, step, model, optimizer)
        causes = sorted({e["cause"] for e in logs if e["event"] == "checkpoint.superseded"})
        conn.send((first, _files(directory, rank), causes))
    finally:
        dist.destroy_process_group()


def _run_world(directory: Path, world: int, saves: list[int]) -> list[Any]:
    """What each rank of a fresh 2-rank world sent; every process reaped."""
    ctx = multiprocessing.get_context("spawn")
    init = rendezvous(directory, "test", world)
    procs, conns = [], []
    try:
        for rank in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_world_rank, args=(rank, init, str(directory), saves, child), daemon=True)
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        results = []
        for rank, conn in enumerate(conns):
            assert conn.poll(WAIT_S), f"rank {rank} of world {world} sent nothing within {WAIT_S}s"
            results.append(conn.recv())
        return results
    finally:
        for proc in procs:
            proc.join(WAIT_S)
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
        for conn in conns:
            conn.close()


def test_a_world_starting_below_an_earlier_worlds_checkpoints_keeps_its_own_and_resumes_from_them(
        tmp_path: Path) -> None:
    """Rank 0 holds steps 98 and 100 of an earlier world, rank 1 nothing (a new rank, or its directory lost):
    the world starts at 0, the earlier world's files are moved aside, its checkpoints 2 and 4 are the ones in
    place, and the next world resumes at 4 on both ranks."""
    model, optimizer = _trained(0, 1)
    for step in (98, 100):
        checkpoint.save(tmp_path, 0, step, model, optimizer)
    ours = ["step-2.safetensors", "step-4.safetensors"]
    earlier = ["step-100.safetensors", "step-98.safetensors"]
    assert _run_world(tmp_path, 0, [2, 4]) == [(0, (ours, earlier), ["rank 1 has nothing whole above step 0"]),
                                               (0, (ours, []), [])]
    assert _run_world(tmp_path, 1, []) == [(4, (ours, earlier), []), (4, (ours, []), [])]


def test_ranks_without_a_common_newest_step_agree_on_the_newest_every_rank_has(tmp_path: Path) -> None:
    """Rank 0 holds 2 and 100 (another lineage's), rank 1 holds 2 and 4: the minimum of the newest (4) is not
    on rank 0; the world resumes at 2, and each rank's files above 2 are moved aside."""
    model, optimizer = _trained(0, 1)
    for rank, steps in ((0, (2, 100)), (1, (2, 4))):
        for step in steps:
            checkpoint.save(tmp_path, rank, step, model, optimizer)
    cause = ("rank 1 has nothing whole above step 4; no step from 3 to 4 is whole on every rank (the ranks hold "
             "different lineages)")
    assert _run_world(tmp_path, 0, []) == [(2, (["step-2.safetensors"], ["step-100.safetensors"]), [cause]),
                                           (2, (["step-2.safetensors"], ["step-4.safetensors"]), [cause])]


def test_one_ranks_damaged_checkpoints_cost_the_others_none_of_theirs(tmp_path: Path) -> None:
    """Both ranks wrote 2 and 4; rank 1's disk tore both, and holds garbage under a checkpoint's name and a
    name whose step no int64 holds. The world starts at 0 (rank 1 has nothing), but rank 0's readable 2 and
    4 are moved aside, not removed, with a warning naming rank 1 and its unreadable file; moved back, they
    load."""
    model, optimizer = _trained(0, 1)
    for rank in (0, 1):
        for step in (2, 4):
            checkpoint.save(tmp_path, rank, step, model, optimizer)
    for step in (2, 4):
        torn = checkpoint.path_of(tmp_path, 1, step)
        torn.write_bytes(torn.read_bytes()[:100])
    checkpoint.path_of(tmp_path, 1, 6).write_bytes(os.urandom(512))
    (checkpoint.rank_dir(tmp_path, 1) / f"step-{10 ** 20}.safetensors").write_bytes(b"not ours")
    ours = ["step-2.safetensors", "step-4.safetensors"]
    cause = "rank 1 has nothing whole above step 0, its step-6 file unreadable (rank-1/step-6.safetensors)"
    rank0, rank1 = _run_world(tmp_path, 0, [])
    assert rank0 == (0, ([], ours), [cause])
    assert rank1 == (0, ([f"step-{10 ** 20}.safetensors"], [*ours, "step-6.safetensors"]), [cause])

    _assert_moved_back_they_load(tmp_path, 0, [str(p) for p in checkpoint.rank_dir(tmp_path, 0).glob("*/*/*")], 4)


def test_a_whole_checkpoint_of_another_model_is_refused_as_a_configuration_not_restarted_into(
        tmp_path: Path) -> None:
    """Both ranks hold 2 and 4, rank 1's 4 of another model (the policy configured changed, the directory kept):
    it reads back whole, so the world agrees on 4; rank 1 refuses it with a ConfigError (exit 2: final, where a
    crash would be restarted into the same refusal for the whole restart budget) naming the file, and moves
    nothing aside."""
    model, optimizer = _trained(0, 1)
    other = torch.nn.Linear(3, 3)
    other_optimizer = torch.optim.Adam(other.parameters())
    for rank in (0, 1):
        checkpoint.save(tmp_path, rank, 2, model, optimizer)
        checkpoint.save(tmp_path, rank, 4, *((other, other_optimizer) if rank else (model, optimizer)))
    _, refused = _run_world(tmp_path, 0, [])
    assert refused.startswith(f"resume failed: ConfigError: {checkpoint.path_of(tmp_path, 1, 4)}: lacks model/")
    assert "rl.policy and rl.optimizer are not those that wrote trainer.checkpoint_dir" in refused
    assert _files(tmp_path, 1) == (["step-2.safetensors", "step-4.safetensors"], [])


def test_directories_under_checkpoint_names_are_not_checkpoints_and_stop_no_resume_and_no_write(
        tmp_path: Path) -> None:
    """Both ranks hold 2 and 4; rank 0 has a directory named as step 6's checkpoint, rank 1 one named as step
    1's and one named as a temporary file. The world resumes at 4 (neither directory counts as a checkpoint,
    nor takes the place of one that is kept), rank 0's directory above 4 is moved aside so that its write of 6
    succeeds, and rank 1's are left as they are (removing them as files failed at every resume and write)."""
    model, optimizer = _trained(0, 1)
    for rank in (0, 1):
        for step in (2, 4):
            checkpoint.save(tmp_path, rank, step, model, optimizer)
    checkpoint.path_of(tmp_path, 0, 6).mkdir()
    for name in ("step-1.safetensors", "step-8.safetensors.tmp"):
        (checkpoint.rank_dir(tmp_path, 1) / name).mkdir()
    ours = ["step-4.safetensors", "step-6.safetensors"]
    cause = "rank 0 has nothing whole above step 4; rank 1 has nothing whole above step 4"
    assert _run_world(tmp_path, 0, [6]) == [(4, (ours, ["step-6.safetensors"]), [cause]), (4, (ours, []), [])]
    assert all((checkpoint.rank_dir(tmp_path, 1) / name).is_dir()
               for name in ("step-1.safetensors", "step-8.safetensors.tmp"))


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


FULL_DISK = """
import resource, signal, sys, torch
from refbus.nodes.rl import checkpoint
directory, limit = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
model = torch.nn.Linear(256, 256)
try:
    checkpoint.save(directory, 0, 2, model, torch.optim.SGD(model.parameters(), lr=0.1))
except checkpoint.CheckpointError as exc:
    print(exc)
"""


def test_a_checkpoint_that_cannot_be_written_is_refused_naming_it_and_the_previous_one_stays(tmp_path: Path) -> None:
    """A rank whose files can grow to half a checkpoint only (a full disk) fails its write of step 2 with a
    CheckpointError naming the file (safetensors' own error names neither file nor step), no temporary file
    left holding space, and its checkpoint of step 1 still the newest, whole."""
    model = torch.nn.Linear(256, 256)
    first = checkpoint.save(tmp_path, 0, 1, model, torch.optim.SGD(model.parameters(), lr=0.1))
    result = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path), str(first.stat().st_size // 2)],
                            capture_output=True, text=True, timeout=WAIT_S)
    assert result.stdout.startswith(f"{checkpoint.path_of(tmp_path, 0, 2)}: cannot write rank 0's checkpoint of "
                                    "step 2: "), (result.stdout, result.stderr)
    assert [p.name for p in first.parent.iterdir()] == [first.name] and checkpoint.latest_step(tmp_path, 0) == 1


UNREADABLE = """
import sys
from structlog.testing import capture_logs
from refbus.nodes.rl import checkpoint
with capture_logs() as logs:
    assert checkpoint.latest_step(sys.argv[1], 0) == 2
print(*[e["error"] for e in logs if e["event"] == "checkpoint.unreadable"], sep="\\n")
"""


def test_a_checkpoint_the_rank_may_not_read_is_skipped_with_a_warning_saying_so(tmp_path: Path) -> None:
    """A newest checkpoint of mode 000 is skipped, and the warning says permission was denied, not (as
    safetensors would say) that there is no such file. A root test process checks it without the capabilities
    that let root read any file."""
    model, optimizer = _trained(0, 1)
    checkpoint.save(tmp_path, 0, 2, model, optimizer)
    denied = checkpoint.save(tmp_path, 0, 4, model, optimizer)
    denied.chmod(0)
    result = subprocess.run([sys.executable, "-c", UNREADABLE, str(tmp_path)], capture_output=True, text=True,
                            timeout=WAIT_S, preexec_fn=_without_file_permission_override if os.geteuid() == 0 else None)
    assert result.stdout.startswith(f"{denied}: PermissionError: [Errno 13] Permission denied"), result
    assert result.stdout.count("\n") == 1, result.stdout


def _without_file_permission_override() -> None:
    """Run in a root test's child before exec: drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from its bounding
    set (prctl PR_CAPBSET_DROP), so the program it execs, still root, obeys file modes."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        if libc.prctl(24, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.parametrize("unusable", ["rank directory of mode 000", "file as the checkpoint directory",
                                      "rank directory of mode 500", "checkpoint directory of mode 500",
                                      "superseded folder of mode 000"])
def test_a_checkpoint_directory_the_rank_may_not_list_or_write_in_ends_it_as_a_configuration_not_restarted_into(
        tmp_path: Path, silent_endpoint: str, unusable: str) -> None:
    """A real trainer rank whose rank directory it may not list (mode 000; a root test runs the rank without the
    capabilities that let root list any directory) or whose checkpoint directory is a file: before, a bare
    PermissionError (or, for the file, a NotADirectoryError at its first write) ended it with status 1, which
    its supervisor restarted into the same error for the whole restart budget. So did one it may list but not
    write in (mode 500, another user's directory; or the checkpoint directory so, its rank directory not made
    yet), only once it had trained up to its first checkpoint, each restart training those steps again; and one
    whose folder of checkpoints set aside it may not list, at every resume. Now it
    exits 2 (final) before it joins the bus, its last words one line naming the path and what to do, and no
    traceback."""
    directory = tmp_path / "checkpoints"
    locked = checkpoint.rank_dir(directory, 0)
    if unusable == "file as the checkpoint directory":
        directory.write_bytes(b"not a directory")
        named = f"{locked}: cannot list the checkpoints in it (Not a directory)"
    elif unusable == "rank directory of mode 000":
        locked.mkdir(parents=True)
        locked.chmod(0)
        named = f"{locked}: cannot list the checkpoints in it (Permission denied)"
    elif unusable == "rank directory of mode 500":
        locked.mkdir(parents=True)
        locked.chmod(0o500)
        named = f"{locked}: cannot write checkpoints in it (Permission denied)"
    elif unusable == "superseded folder of mode 000":  # what prune lists at every resume
        locked = checkpoint.rank_dir(directory, 0) / checkpoint.SUPERSEDED
        locked.mkdir(parents=True)
        locked.chmod(0)
        named = f"{locked}: cannot list the checkpoints in it (Permission denied)"
    else:
        directory.mkdir()
        locked = directory
        locked.chmod(0o500)
        named = f"{checkpoint.rank_dir(directory, 0)}: cannot write checkpoints in it (Permission denied)"
    try:
        # The bus never answers: a rank that went on past its resume would wait for it, not exit 2.
        result = subprocess.run(
            [sys.executable, "-m", "refbus.nodes.cli", "node", "trainer", "--bus-control", silent_endpoint,
             "--node-connect-timeout-s", "1", "--trainer-rank", "0", "--trainer-world-size", "1",
             "--trainer-init-method", rendezvous(tmp_path, "unusable", 0), "--trainer-checkpoint-every", "1",
             "--trainer-checkpoint-dir", str(directory)],
            capture_output=True, text=True, timeout=WAIT_S,
            preexec_fn=_without_file_permission_override if os.geteuid() == 0 else None)
    finally:
        if locked.is_dir():
            locked.chmod(0o700)
    assert result.returncode == CONFIG_STATUS, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    said = result.stderr.splitlines()[-1]
    assert said.startswith(f"refbus: {named}: trainer.checkpoint_dir {directory} "), said
    assert "give it that access, or configure another trainer.checkpoint_dir" in said, said


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
