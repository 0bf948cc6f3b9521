"""Trainer checkpoints: one safetensors file per rank and step, written atomically, read back bit-exact.

A checkpoint of step ``K`` holds what a rank needs to train step ``K`` next: the model's state dict (tensors
named ``model/<name>``), the optimizer's tensor state (``optim/<param index>/<key>``) and, in the file's
metadata (strings only), the step, the rank and the optimizer's non-tensor parts as JSON (param groups,
scalar state). safetensors parses a header and raw tensor bytes: loading a file runs no code, unlike a
pickle.

Writes are atomic: the file is written under a temporary name in the same directory, fsynced, renamed into
place and the directory fsynced. A process killed mid-write leaves at most a temporary file (ignored, and
removed by the next write) and the previous checkpoint intact. :func:`latest_step` trusts no file name: it
opens each candidate, newest first, and skips (with a warning naming it) one it cannot read; a directory it
cannot list (permission denied, a file in its place), or one it may not write in (:func:`check_writable`), is
:class:`CheckpointDirUnusable`, which no retry clears.

Files: ``<dir>/rank-<rank>/step-<K>.safetensors``. Each write of step ``K`` keeps the newest :data:`KEEP`
of its rank at or below ``K`` and moves every file above ``K`` aside: those belong to a superseded lineage
(an earlier world that got further before a world started over below it, e.g. from step 0 when the world
grew or a rank's checkpoints were lost or damaged), and left in place they would outrank, and so prune,
every new checkpoint. Moved aside, not removed: a readable checkpoint is never lost as a side effect of
another rank's damage (:func:`prune`); one moved aside is removed once the rank holds a checkpoint of its step
or a later one again (the lineage training now has caught up with it), so a world that keeps dying during a
checkpoint round keeps one copy of the step it loses, not one per restart. Ranks train in lockstep (every
step has a collective), so within one lineage the newest step every rank has is at most one checkpoint behind
any rank's own newest: keeping two is enough for the ranks to agree. Where ranks hold checkpoints of different
lineages, :func:`latest_step` with ``at_most`` lets them agree on an older step every rank has, and
:func:`prune` moves what lies above it aside.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

log = structlog.get_logger(__name__)

FORMAT = "refbus-trainer-checkpoint-1"
KEEP = 2
SUPERSEDED = "superseded"  # under a rank's directory: its checkpoints above a step its world started over at
# At most 18 digits: every step fits the int64 the ranks agree with; any other name is not a checkpoint.
_NAME = re.compile(r"step-(\d{1,18})\.safetensors")
_TEMP_SUFFIX = ".tmp"


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, torn or not one of ours."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint that reads back whole holds another model's or optimizer's state than the one loading it."""


class CheckpointDirUnusable(CheckpointError):
    """A checkpoint directory (the one configured, or a rank's in it) that this process may not list or make a file
    in, or a file standing where it or a directory above it must be: it stays so until someone changes it (no
    restart clears it), unlike a disk that fails a write."""


def rank_dir(directory: Path | str, rank: int) -> Path:
    return Path(directory) / f"rank-{rank}"


def path_of(directory: Path | str, rank: int, step: int) -> Path:
    return rank_dir(directory, rank) / _file_name(step)


def _file_name(step: int) -> str:
    return f"step-{step}.safetensors"


def save(directory: Path | str, rank: int, step: int, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer) -> Path:
    """Write rank ``rank``'s checkpoint of ``step`` atomically; returns its path. Once the new one is in place
    the rank's checkpoints are pruned to ``step`` (:func:`prune`) and leftover temporary files removed. A write
    that fails (a full disk) raises :class:`CheckpointError` naming the file, its temporary file removed and the
    rank's checkpoints as they were. The caller keeps ownership of the model and optimizer (their tensors are
    copied to the file)."""
    folder = rank_dir(directory, rank)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, optimizer_meta = _flatten(model.state_dict(), optimizer.state_dict())
    metadata = {"format": FORMAT, "step": str(step), "rank": str(rank), "optimizer": json.dumps(optimizer_meta)}
    final = path_of(directory, rank, step)
    temp = final.with_name(final.name + _TEMP_SUFFIX)
    try:
        save_file(tensors, temp, metadata=metadata)
        _fsync(temp)
    except (OSError, SafetensorError) as exc:  # safetensors names neither the file nor the step
        temp.unlink(missing_ok=True)  # a partial file would hold space the next write needs
        raise CheckpointError(f"{final}: cannot write rank {rank}'s checkpoint of step {step}: {exc}") from None
    os.replace(temp, final)
    _fsync(folder)
    prune(directory, rank, step, cause=f"step {step} was written below them")
    for leftover in folder.glob(f"*{_TEMP_SUFFIX}"):
        if not leftover.is_dir():  # not one of its temporary files: never written as a directory
            leftover.unlink(missing_ok=True)
    return final


def prune(directory: Path | str, rank: int, newest: int, *, cause: str) -> list[Path]:
    """Move rank ``rank``'s checkpoints above step ``newest`` (a superseded lineage) aside, into
    ``rank-<rank>/superseded/rewound-to-<newest>-<ns>/`` (a folder of their own, so a later rewind never
    overwrites them), and remove all but the :data:`KEEP` newest at or below ``newest``. Each file moved is
    logged (``checkpoint.superseded``, a warning naming it, where it went and ``cause``: why the world started
    over below it); so is a directory under a checkpoint's name above ``newest`` (else never touched: not a
    checkpoint, and not refbus's to remove). Checkpoints in ``superseded/`` at or below ``newest`` are removed
    (the rank holds step ``newest`` of the lineage training now, at or past theirs), each with a warning
    (``checkpoint.superseded_removed``), and a folder they leave empty with them; anything else there is the
    operator's to clear or move back. Returns the moved files' new paths."""
    folder = rank_dir(directory, rank)
    _remove_caught_up(folder / SUPERSEDED, rank, newest)
    steps = _steps(folder)
    moved = []
    # Directories under a checkpoint's name too: left above ``newest``, one would stand where this lineage's
    # checkpoint of its step is to be written.
    above = [step for step in _steps(folder, directories=True) if step > newest]
    if above:
        aside = folder / SUPERSEDED / f"rewound-to-{newest}-{time.time_ns()}"
        aside.mkdir(parents=True)
        for step in above:
            source = path_of(directory, rank, step)
            target = aside / source.name
            os.replace(source, target)
            moved.append(target)
            log.warning("checkpoint.superseded", path=str(source), moved_to=str(target), rank=rank,
                        resumed_at=newest, cause=cause)
        _fsync(aside)
        _fsync(folder)
    for old in [step for step in steps if step <= newest][KEEP:]:
        path_of(directory, rank, old).unlink(missing_ok=True)
    return moved


def _remove_caught_up(superseded: Path, rank: int, newest: int) -> None:
    """Remove the checkpoints in ``superseded``'s folders at or below step ``newest``, and the folders they leave
    empty: the rank holds ``newest`` of the lineage training now, so each was passed (one copy of each step aside
    at most, whatever the restarts). :class:`CheckpointDirUnusable` where this process may not list or remove them."""
    for aside in _listing(superseded):
        if not aside.is_dir():  # not a folder prune made: the operator's, left as it is
            continue
        try:
            for step in [step for step in _steps(aside) if step <= newest]:
                path = aside / _file_name(step)
                path.unlink(missing_ok=True)
                log.warning("checkpoint.superseded_removed", path=str(path), rank=rank, holds=newest,
                            cause=f"rank {rank} holds step {newest} of the lineage training now")
            if not _listing(aside):
                aside.rmdir()
        except PermissionError as exc:
            raise CheckpointDirUnusable(f"{aside}: cannot remove the checkpoints set aside in it ({exc.strerror})"
                                        ) from None


_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST)
"""Why a directory takes no file, until someone changes it."""


def check_writable(directory: Path | str, rank: int) -> None:
    """Make rank ``rank``'s checkpoint directory where it is missing, and check that this process may make a file
    in it: :class:`CheckpointDirUnusable` naming it where it may not (permission denied, a read-only filesystem, a
    file in the way). Found at the start: at the first write, a step's training later, it would be a write that
    failed, a crash each restart trains up to again."""
    folder = rank_dir(directory, rank)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # what a write makes first; unnamed, or removed on close
            pass
    except OSError as exc:
        if exc.errno not in _UNWRITABLE:  # one a restart may clear (a full disk): left to the write to report
            return
        raise CheckpointDirUnusable(f"{folder}: cannot write checkpoints in it ({exc.strerror})") from None


def latest_step(directory: Path | str, rank: int, at_most: int | None = None) -> int:
    """The newest step of rank ``rank`` (not above ``at_most`` when given) whose checkpoint reads back whole;
    0 when there is none (a world starts at step 0). A file that cannot be read is skipped with a warning
    (``checkpoint.unreadable``); a rank directory that cannot be listed raises :class:`CheckpointDirUnusable`."""
    folder = rank_dir(directory, rank)
    for step in _steps(folder):
        if at_most is not None and step > at_most:
            continue
        try:
            _check(path_of(directory, rank, step), rank, step)
        except CheckpointError as exc:
            log.warning("checkpoint.unreadable", path=str(path_of(directory, rank, step)), error=str(exc),
                        using="the previous checkpoint")
            continue
        return step
    return 0


def newest_file(directory: Path | str, rank: int) -> int:
    """The newest step rank ``rank`` has a file named for, whether or not it reads back; 0 when none (what
    explains a :func:`latest_step` below it: the files between are unreadable)."""
    return next(iter(_steps(rank_dir(directory, rank))), 0)


def load(directory: Path | str, rank: int, step: int, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer) -> None:
    """Load rank ``rank``'s checkpoint of ``step`` into ``model`` and ``optimizer`` (exact: tensors are copied
    bit for bit). Every model tensor must have the name, dtype and shape of the model's own. The optimizer's
    state tensors come back as saved, in the file's dtype (an optimizer may keep its state in another dtype
    than its parameters, e.g. bf16 moments for fp32 weights); each must belong to one of the optimizer's
    parameters and, where the optimizer already holds that state, have its dtype and shape. Raises
    :class:`CheckpointMismatch`, naming the tensor that does not fit, or :class:`CheckpointError` for a file that
    cannot be read, with the model and optimizer as they were."""
    path = path_of(directory, rank, step)
    metadata, tensors = _read(path)
    _expect(metadata, path, rank, step)
    model_state = {name[len("model/"):]: t for name, t in tensors.items() if name.startswith("model/")}
    _model_fits(path, model_state, model.state_dict())
    # Loading builds a new state and new param groups, leaving these as they were: put back, they undo it
    # (loading them back instead would cast them too).
    before = {"state": optimizer.state, "param_groups": optimizer.param_groups}
    try:
        optimizer_meta = json.loads(metadata["optimizer"])
        state_dict = _unflatten(tensors, optimizer_meta, optimizer.state_dict()["param_groups"])
        optimizer.load_state_dict(state_dict)  # refuses param groups of other sizes
        # The file's parameter ids to the optimizer's parameters, as torch's loading paired them.
        params = dict(zip(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                          itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups), strict=True))
        _optimizer_fits(path, state_dict["state"], params, before["state"])
        # torch casts every state tensor but ``step`` to its parameter's dtype as it loads: the optimizer
        # saved it in its own dtype, and that is what it gets back (on the device torch moved it to).
        for index, values in state_dict["state"].items():
            held = optimizer.state[params[index]]
            for key, tensor in values.items():
                if isinstance(tensor, torch.Tensor) and held[key].dtype != tensor.dtype:
                    held[key] = tensor.to(held[key].device)
    except (KeyError, ValueError, RuntimeError, TypeError) as exc:
        optimizer.__setstate__(before)
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointMismatch(f"{path}: does not fit this model and optimizer: {exc}") from None
    model.load_state_dict(model_state, strict=True)


# --- internals ---------------------------------------------------------------------------------------------


def _flatten(model_state: Mapping[str, torch.Tensor],
             optimizer_state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {f"model/{name}": t.detach().cpu().contiguous() for name, t in model_state.items()}
    scalars: dict[str, dict[str, Any]] = {}
    for index, state in optimizer_state["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{index}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": optimizer_state["param_groups"], "scalars": scalars}


def _unflatten(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
               like: list[dict[str, Any]]) -> dict[str, Any]:
    """The optimizer state dict from a file's parts; ``like``: the optimizer's own param groups (JSON has no
    tuples: a value that is a tuple there, e.g. Adam's ``betas``, becomes one again)."""
    groups = [{key: tuple(value) if isinstance(mine.get(key), tuple) and isinstance(value, list) else value
               for key, value in group.items()} for group, mine in zip(meta["param_groups"], like, strict=False)]
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        if name.startswith("optim/"):
            _, index, key = name.split("/", 2)
            state.setdefault(int(index), {})[key] = tensor
    for index, values in meta["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": groups}


def _read(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    try:
        # Opened first by Python, whose error says why (permission denied): safetensors says "No such file or
        # directory" for any file it cannot open.
        with path.open("rb"), safe_open(path, framework="pt") as file:
            metadata = file.metadata() or {}
            tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (not a dict)
    except Exception as exc:  # safetensors raises its own error types for every kind of damage
        raise CheckpointError(f"{path}: {type(exc).__name__}: {exc}") from None
    return metadata, tensors


def _check(path: Path, rank: int, step: int) -> None:
    """Whether ``path`` reads back whole: its header and metadata, and tensors whose extents cover the file exactly
    (safetensors refuses any other on opening; the bytes themselves are mapped, not read, until :func:`load`)."""
    metadata, _ = _read(path)
    _expect(metadata, path, rank, step)
    try:
        json.loads(metadata["optimizer"])
    except ValueError as exc:
        raise CheckpointError(f"{path}: optimizer metadata is not JSON: {exc}") from None


def _model_fits(path: Path, given: Mapping[str, torch.Tensor], wanted: Mapping[str, torch.Tensor]) -> None:
    """That ``given`` (the file's) has exactly the tensors of ``wanted`` (the model's), each of the same dtype
    and shape."""
    if missing := sorted(wanted.keys() - given.keys()):
        raise CheckpointMismatch(f"{path}: lacks model/{missing[0]} (of {len(missing)} missing tensors)")
    if extra := sorted(given.keys() - wanted.keys()):
        raise CheckpointMismatch(f"{path}: has model/{extra[0]}, which this model lacks (of {len(extra)} such "
                              "tensors)")
    for name, tensor in given.items():
        want = wanted[name]
        if tensor.dtype != want.dtype or tensor.shape != want.shape:
            raise CheckpointMismatch(f"{path}: model/{name} is {tensor.dtype} {tuple(tensor.shape)}, this model "
                                  f"needs {want.dtype} {tuple(want.shape)}")


def _optimizer_fits(path: Path, state: Mapping[int, Mapping[str, Any]], params: Mapping[int, torch.Tensor],
                    own: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
    """That every state tensor of the file (``state``: parameter id -> key -> value) belongs to one of the
    optimizer's parameters (``params``: the file's id -> the parameter) and, where the optimizer already
    holds that state (``own``: its state before loading), has its dtype and shape. A fresh optimizer holds
    none: the file's is taken as saved."""
    for index, values in state.items():
        for key, tensor in values.items():
            if not isinstance(tensor, torch.Tensor):
                continue
            if index not in params:
                raise CheckpointMismatch(f"{path}: has optim/{index}/{key}, for a parameter this optimizer lacks "
                                      f"(it has {len(params)})")
            held = own.get(params[index], {}).get(key)
            if isinstance(held, torch.Tensor) and (held.dtype != tensor.dtype or held.shape != tensor.shape):
                raise CheckpointMismatch(f"{path}: optim/{index}/{key} is {tensor.dtype} {tuple(tensor.shape)}, this "
                                      f"optimizer holds {held.dtype} {tuple(held.shape)}")


def _expect(metadata: Mapping[str, str], path: Path, rank: int, step: int) -> None:
    if metadata.get("format") != FORMAT or "optimizer" not in metadata:
        raise CheckpointError(f"{path}: not a trainer checkpoint (format {metadata.get('format')!r})")
    if metadata.get("step") != str(step) or metadata.get("rank") != str(rank):
        raise CheckpointError(f"{path}: holds rank {metadata.get('rank')} step {metadata.get('step')}, "
                              f"not rank {rank} step {step}")


def _steps(folder: Path, *, directories: bool = False) -> list[int]:
    """Steps with a checkpoint file in ``folder``, newest first; with ``directories``, also those of directories
    under a checkpoint's name. A directory is never a checkpoint: counted as one, it would take the place of one
    that :data:`KEEP` keeps, and removing it (as a file) would fail at every write and every resume. Empty where
    ``folder`` does not exist (nothing written yet); :class:`CheckpointDirUnusable` as :func:`_listing`."""
    return sorted((int(m.group(1)) for p in _listing(folder)
                   if (m := _NAME.fullmatch(p.name)) and (directories or not p.is_dir())), reverse=True)


def _listing(folder: Path) -> list[Path]:
    """What ``folder`` holds; empty where it does not exist; :class:`CheckpointDirUnusable` where this process may
    not list it, or a file stands where it or a directory above it must be."""
    try:
        return list(folder.iterdir())
    except FileNotFoundError:
        return []
    except (PermissionError, NotADirectoryError) as exc:
        raise CheckpointDirUnusable(f"{folder}: cannot list the checkpoints in it ({exc.strerror})") from None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
