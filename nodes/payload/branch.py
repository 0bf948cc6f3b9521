"""One trainable sequence's per-token arrays, validated, and the operations on their shape.

A :class:`Branch` holds any subset of:

- ``routed_experts``: ``[tokens, layers, top_k]`` uint8, or uint16 for models with more than 255 experts;
  ``layers`` and ``top_k`` within :data:`MAX_ROUTING_LAYERS` and :data:`MAX_ROUTING_TOP_K`.
- ``topk_ids`` ``[tokens, k]`` int32 with ``topk_logprobs`` ``[tokens, k]`` float32 (both or neither).
- ``mask_ids`` (int32, flat) together with ``mask_counts`` (int32, one per token, 0 = no mask, at most
  :data:`MAX_MASK_WIDTH`), with ``len(mask_ids) == sum(mask_counts)`` (both or neither).

Every present field describes the same tokens, so they agree on the token count. A branch has at least one
field: a sequence without arrays is represented by no branch at all (``None``), so nothing is kept, referenced
or deleted for it.

This module imports numpy only. Env servers import it, and they must never pull in torch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np

ROUTED_EXPERTS: Final = "routed_experts"
TOPK_IDS: Final = "topk_ids"
TOPK_LOGPROBS: Final = "topk_logprobs"
MASK_IDS: Final = "mask_ids"
MASK_COUNTS: Final = "mask_counts"

FIELDS: Final[tuple[str, ...]] = (ROUTED_EXPERTS, TOPK_IDS, TOPK_LOGPROBS, MASK_IDS, MASK_COUNTS)
"""Every field name, in the canonical order used by :meth:`Branch.fields` and on the wire."""

PAIRED_FIELDS: Final[tuple[tuple[str, str], ...]] = ((TOPK_IDS, TOPK_LOGPROBS), (MASK_IDS, MASK_COUNTS))
"""Fields that are meaningless alone: a branch (or a sample description) has both of a pair or neither."""

MAX_ROUTING_LAYERS: Final = 1024
MAX_ROUTING_TOP_K: Final = 256
"""Bounds of a routing shape ``(layers, top_k)``: far above any model's, far below what would let a peer make
a trainer size buffers from an absurd shape."""

MAX_MASK_WIDTH: Final = 4096
"""Ids one token's sampling mask lists, at most. A trainer assembles masks dense, ``[tokens, widest count]``
int32, so one token's count sizes a whole micro batch's tensor: this bound keeps a peer's single absurd count
(a keep of 16 MiB can claim four million ids for one token) from asking a trainer for terabytes."""

ROUTING_DTYPES: Final[tuple[np.dtype, ...]] = (np.dtype(np.uint8), np.dtype(np.uint16))
_INT32: Final = np.dtype(np.int32)
_FLOAT32: Final = np.dtype(np.float32)


class BranchError(ValueError):
    """A branch's arrays are malformed. Names the field, what was expected and what was found."""

    def __init__(self, field: str, expected: str, actual: str) -> None:
        self.field = field
        self.expected = expected
        self.actual = actual
        super().__init__(f"{field}: expected {expected}, got {actual}")


def check_pairs(present: Collection[str], where: str = "branch") -> None:
    """Raise :class:`BranchError` unless each of :data:`PAIRED_FIELDS` is present entirely or not at all."""
    for first, second in PAIRED_FIELDS:
        if (first in present) != (second in present):
            missing, given = (second, first) if first in present else (first, second)
            raise BranchError(missing, f"present because {given} is ({where})", "missing")


def _describe(array: object) -> str:
    if isinstance(array, np.ndarray):
        return f"{array.dtype} array of shape {tuple(array.shape)}"
    return type(array).__name__


def _take(field: str, array: object, ndim: int, dtypes: tuple[np.dtype, ...], what: str) -> np.ndarray:
    """Check type, rank and dtype of the caller's array, then return the view the branch keeps."""
    if not isinstance(array, np.ndarray) or array.ndim != ndim or array.dtype not in dtypes:
        raise BranchError(field, what, _describe(array))
    # A C-contiguous layout is what goes out as one zero-copy frame; most inputs already are, and for
    # those this is a view, not a copy.
    view = np.ascontiguousarray(array)
    if view is array:
        view = array.view()
    # Read-only through the branch, so no holder can change bytes that another holder or a checksum
    # relies on.
    view.flags.writeable = False
    return view


@dataclass(frozen=True, slots=True, eq=False)
class Branch:
    """One trainable sequence's arrays. Construct with keyword arguments; absent fields are ``None``.

    Ownership: the branch keeps read-only views of the arrays it is given and copies nothing, except an
    input that is not C-contiguous, which is copied once into a contiguous array. The caller must not
    write to its original arrays while the branch (or anything made from it) is in use. Every array the
    branch returns (attributes, :meth:`to_arrays`, :meth:`slice_to`) is a read-only view of the same
    memory.

    Equality is identity (arrays have no single truth value); compare contents with :meth:`equals`.

    Raises:
        BranchError: at construction, for a wrong type, dtype or rank, a pair with one half missing,
            fields that disagree on the token count, negative mask counts or ids, mask ids that do not
            add up to the counts, or a branch with no field at all.
    """

    routed_experts: np.ndarray | None = None
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    mask_ids: np.ndarray | None = None
    mask_counts: np.ndarray | None = None

    def __post_init__(self) -> None:
        present = {name for name in FIELDS if getattr(self, name) is not None}
        if not present:
            raise BranchError("branch", f"at least one of {', '.join(FIELDS)}", "no field")
        check_pairs(present)

        tokens: list[tuple[str, int]] = []
        if self.routed_experts is not None:
            routing = _take(
                ROUTED_EXPERTS,
                self.routed_experts,
                3,
                ROUTING_DTYPES,
                "uint8 or uint16 [tokens, layers, top_k]",
            )
            if not (1 <= routing.shape[1] <= MAX_ROUTING_LAYERS and 1 <= routing.shape[2] <= MAX_ROUTING_TOP_K):
                raise BranchError(
                    ROUTED_EXPERTS,
                    f"1 <= layers <= {MAX_ROUTING_LAYERS} and 1 <= top_k <= {MAX_ROUTING_TOP_K}",
                    _describe(routing),
                )
            object.__setattr__(self, ROUTED_EXPERTS, routing)
            tokens.append((ROUTED_EXPERTS, routing.shape[0]))
        if self.topk_ids is not None:
            ids = _take(TOPK_IDS, self.topk_ids, 2, (_INT32,), "int32 [tokens, k]")
            logprobs = _take(TOPK_LOGPROBS, self.topk_logprobs, 2, (_FLOAT32,), "float32 [tokens, k]")
            if ids.shape[1] < 1:
                raise BranchError(TOPK_IDS, "k >= 1", _describe(ids))
            if logprobs.shape != ids.shape:
                raise BranchError(TOPK_LOGPROBS, f"shape {tuple(ids.shape)} like {TOPK_IDS}", _describe(logprobs))
            object.__setattr__(self, TOPK_IDS, ids)
            object.__setattr__(self, TOPK_LOGPROBS, logprobs)
            tokens.append((TOPK_IDS, ids.shape[0]))
        if self.mask_counts is not None:
            counts = _take(MASK_COUNTS, self.mask_counts, 1, (_INT32,), "int32 [tokens]")
            mask_ids = _take(MASK_IDS, self.mask_ids, 1, (_INT32,), "int32 [sum(mask_counts)]")
            if counts.size and int(counts.min()) < 0:
                raise BranchError(MASK_COUNTS, "counts >= 0", f"minimum {int(counts.min())}")
            if counts.size and int(counts.max()) > MAX_MASK_WIDTH:
                raise BranchError(MASK_COUNTS, f"counts <= {MAX_MASK_WIDTH}", f"maximum {int(counts.max())}")
            # int64 accumulation: an int32 sum over a long sequence of wide masks can overflow.
            total = int(counts.sum(dtype=np.int64))
            if mask_ids.shape[0] != total:
                raise BranchError(MASK_IDS, f"length sum(mask_counts) = {total}", f"length {mask_ids.shape[0]}")
            # -1 pads the dense form on the trainer; a negative id would be indistinguishable from padding.
            if mask_ids.size and int(mask_ids.min()) < 0:
                raise BranchError(MASK_IDS, "token ids >= 0", f"minimum {int(mask_ids.min())}")
            object.__setattr__(self, MASK_COUNTS, counts)
            object.__setattr__(self, MASK_IDS, mask_ids)
            tokens.append((MASK_COUNTS, counts.shape[0]))

        reference_name, reference_count = tokens[0]
        for name, count in tokens[1:]:
            if count != reference_count:
                raise BranchError(name, f"{reference_count} tokens like {reference_name}", f"{count} tokens")

    @property
    def token_count(self) -> int:
        """Number of tokens every present field describes."""
        if self.routed_experts is not None:
            return int(self.routed_experts.shape[0])
        if self.topk_ids is not None:
            return int(self.topk_ids.shape[0])
        assert self.mask_counts is not None  # __post_init__ guarantees at least one pair
        return int(self.mask_counts.shape[0])

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """``(layers, top_k)`` of the routing rows, or ``None`` without routing."""
        if self.routed_experts is None:
            return None
        return int(self.routed_experts.shape[1]), int(self.routed_experts.shape[2])

    @property
    def topk_k(self) -> int | None:
        """Width ``k`` of the top-k heads, or ``None`` without them."""
        return None if self.topk_ids is None else int(self.topk_ids.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of array data across all present fields (what goes on the wire, headers aside)."""
        return sum(array.nbytes for name in FIELDS if (array := getattr(self, name)) is not None)

    def fields(self) -> tuple[str, ...]:
        """Names of the present fields, in the canonical order of :data:`FIELDS`."""
        return tuple(name for name in FIELDS if getattr(self, name) is not None)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The present fields as a flat mapping, in canonical order: what goes on the wire.

        The values are the branch's own read-only, C-contiguous views (no copy); the dict is new and
        belongs to the caller.
        """
        return {name: getattr(self, name) for name in self.fields()}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> Branch:
        """Build and validate a branch from a flat mapping (e.g. arrays viewed on received frames).

        Read-only arrays (``np.frombuffer`` on a frame) are accepted and not copied; the frames must
        outlive the branch.

        Raises:
            BranchError: for a key outside :data:`FIELDS`, or anything the constructor rejects.
        """
        for name in arrays:
            if name not in FIELDS:
                raise BranchError(str(name), f"one of {', '.join(FIELDS)}", "an unknown field")
        return cls(**dict(arrays))

    def slice_to(self, kept_tokens: int) -> Branch:
        """The first ``kept_tokens`` tokens of this branch, as views of the same memory.

        Per-token fields are cut on their first axis. The mask keeps ``mask_counts[:cut]`` and then
        ``mask_ids[:sum(mask_counts[:cut])]``, so the ids of dropped tokens go with them. Truncation
        shortens the token count and changes nothing else. Returns ``self`` when nothing is cut.

        Raises:
            BranchError: (field ``kept_tokens``) unless ``0 <= kept_tokens <= token_count``.
        """
        total = self.token_count
        if isinstance(kept_tokens, bool) or not isinstance(kept_tokens, int | np.integer):
            raise BranchError("kept_tokens", "an int", type(kept_tokens).__name__)
        cut = int(kept_tokens)
        if not 0 <= cut <= total:
            raise BranchError("kept_tokens", f"0 <= kept_tokens <= {total}", str(cut))
        if cut == total:
            return self
        arrays: dict[str, np.ndarray] = {}
        for name, array in self.to_arrays().items():
            if name == MASK_IDS:
                assert self.mask_counts is not None
                arrays[name] = array[: int(self.mask_counts[:cut].sum(dtype=np.int64))]
            else:
                arrays[name] = array[:cut]
        return Branch(**arrays)

    def equals(self, other: Branch) -> bool:
        """Whether both branches have the same fields with the same dtypes, shapes and bytes."""
        if self.fields() != other.fields():
            return False
        for name, mine in self.to_arrays().items():
            theirs = getattr(other, name)
            if mine.dtype != theirs.dtype or mine.shape != theirs.shape:
                return False
            # Byte comparison: NaN logprobs that are bit-identical must count as equal.
            if mine.tobytes() != theirs.tobytes():
                return False
        return True
