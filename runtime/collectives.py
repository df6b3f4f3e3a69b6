"""A schedule's collectives as real ``torch.distributed`` collectives.

``ProcessGroups`` creates a process group for each rank tuple the schedule's collectives
use; ``Collectives.issue`` hands one collective op to the backend asynchronously, of its
kind (all-gather, reduce-scatter, all-reduce, broadcast), size in bytes, dtype and group,
on the rank's buffers where one is large enough. With ``check_data`` every collective
carries known values and comes with a check of its result: an all-gather must hold the
concatenation of every rank's shard, a reduce-scatter or all-reduce the sum (or max),
a broadcast the root's buffer.

The known values are exact in every dtype a schedule uses, whatever the group's size:
small non-negative integers, and sums whose every partial sum is one too (at most 254:
bf16 holds every integer up to 256 exactly, uint8 up to 255), so a result is checked
for equality, in any order the backend adds in (``check_values``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from commsim.ir import ops as O
from commsim.ir.schedule import Schedule
from runtime.step import DataMismatch

TORCH_DTYPE = {
    O.DType.FP32: torch.float32, O.DType.FP16: torch.float16, O.DType.BF16: torch.bfloat16,
    O.DType.FP64: torch.float64, O.DType.INT64: torch.int64, O.DType.INT32: torch.int32, O.DType.UINT8: torch.uint8,
}
_REDUCE = {O.ReduceOp.SUM: dist.ReduceOp.SUM, O.ReduceOp.MAX: dist.ReduceOp.MAX, O.ReduceOp.AVG: dist.ReduceOp.SUM}

# torch 2.13 renamed the flat collectives; older releases only have the old names
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ProcessGroups:
    """torch.distributed process groups for the schedule's rank tuples (created in the
    same order on every rank, as new_group requires; the whole world is the default
    group, ``None``)."""

    def __init__(self, schedule: Schedule, world: int):
        groups = sorted({op.group for p in schedule.programs for op in p.step if isinstance(op, O.Collective)})
        self.pg: dict[tuple[int, ...], Any] = {}
        for g in groups:
            self.pg[g] = None if len(g) == world else dist.new_group(list(g))

    def __getitem__(self, g: tuple[int, ...]) -> Any:
        return self.pg[g]


class Collectives:
    """Issues one rank's collectives. ``buffers`` is the rank's live buffers by name
    (shared with the executor, which allocates and frees them)."""

    def __init__(self, schedule: Schedule, rank: int, device: torch.device, buffers: dict[str, torch.Tensor],
                 check_data: bool):
        self.rank, self.device, self.buffers, self.check_data = rank, device, buffers, check_data
        self.groups = ProcessGroups(schedule, schedule.world_size)
        self.partitions: dict[tuple, torch.Tensor] = {}  # persistent own-side tensors of collectives

    @property
    def own_bytes(self) -> int:
        """Bytes of the partitions kept across steps (the executor's, not the schedule's)."""
        return sum(t.numel() * t.element_size() for t in self.partitions.values())

    def _tensor(self, names: tuple[str, ...], nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A typed view of the first listed buffer large enough, else a scratch tensor."""
        item = dtype.itemsize
        if self.check_data:
            names = ()  # concurrent collectives may target one buffer: keep checked data apart
        for n in names:
            t = self.buffers.get(n)
            if t is not None and t.numel() >= nbytes:
                return t[:nbytes].view(dtype)
        return torch.empty(nbytes // item, dtype=dtype, device=self.device)

    def _partition(self, op: O.Collective, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's own side of a gather or reduce-scatter: in a framework, the rank's
        persistent parameter or gradient partition, whose pages were touched long ago.
        One per gathered / reduced buffer set (a parameter's forward and backward gathers
        share it), kept across steps: a fresh untouched tensor per call would add page
        faults to the collective that no framework pays."""
        if self.check_data:
            return torch.empty(numel, dtype=dtype, device=self.device)
        key = (op.kind, op.buffers or (op.id,), numel, dtype)
        t = self.partitions.get(key)
        if t is None:
            t = self.partitions[key] = torch.zeros(numel, dtype=dtype, device=self.device)
        return t

    def issue(self, op: O.Collective) -> tuple[Any, Callable[[], None] | None]:
        """Issue one collective asynchronously; returns (work, check) where check()
        verifies the data once the work is done (None without ``check_data``)."""
        dtype = TORCH_DTYPE[op.dtype]
        group = self.groups[op.group]
        p = len(op.group)
        me = op.group.index(self.rank)
        check: Any = None
        tag = int(op.id)
        if op.kind is O.CollectiveKind.ALL_GATHER:
            out = self._tensor(op.buffers, op.size_bytes, dtype)
            shard = self._partition(op, out.numel() // p, dtype)
            if self.check_data:
                _fill(shard, shard_values(me, shard.numel(), tag))

                def _check() -> None:
                    n = shard.numel()
                    for r in range(p):
                        if not _equal(out[r * n:(r + 1) * n], shard_values(r, n, tag)):
                            raise DataMismatch(f"all-gather chunk {r} does not hold rank {op.group[r]}'s shard")
                check = _check
            work = all_gather(out, shard, group=group, async_op=True)
        elif op.kind is O.CollectiveKind.REDUCE_SCATTER:
            inp = self._tensor(op.buffers, op.size_bytes, dtype)
            out = self._partition(op, inp.numel() // p, dtype)
            if self.check_data:
                _fill(inp, sum_terms(me, p, inp.numel()))

                def _check() -> None:
                    if not _equal(out, sum_expected(p, out.numel(), me * out.numel())):
                        raise DataMismatch(f"reduce-scatter result is not the sum over {p} ranks")
                check = _check
            work = reduce_scatter(out, inp, op=_REDUCE[op.reduce_op or O.ReduceOp.SUM], group=group, async_op=True)
        elif op.kind is O.CollectiveKind.ALL_REDUCE:
            buf = self._tensor(op.buffers, op.size_bytes, dtype)
            rop = op.reduce_op or O.ReduceOp.SUM
            if self.check_data:
                if rop is O.ReduceOp.MAX:
                    _fill(buf, shard_values(me, buf.numel(), tag))
                    expect = max_expected(p, buf.numel(), tag)
                else:
                    _fill(buf, sum_terms(me, p, buf.numel()))
                    expect = sum_expected(p, buf.numel())

                def _check() -> None:
                    if not _equal(buf, expect):
                        raise DataMismatch(f"all-reduce result is not the {rop.value} over {p} ranks")
                check = _check
            work = dist.all_reduce(buf, op=_REDUCE[rop], group=group, async_op=True)
        else:
            buf = self._tensor(op.buffers, op.size_bytes, dtype)
            root = op.root if op.root is not None else op.group[0]
            if self.check_data:
                sent = shard_values(op.group.index(root), buf.numel(), tag)
                _fill(buf, sent if self.rank == root else torch.zeros_like(sent))

                def _check() -> None:
                    if not _equal(buf, sent):
                        raise DataMismatch(f"broadcast did not deliver rank {root}'s buffer")
                check = _check
            work = dist.broadcast(buf, src=root, group=group, async_op=True)
        return work, check


# ---------------------------------------------------------------- check values
# Every value is a non-negative integer of at most 254, so it is exact in every dtype
# a schedule uses (bf16 holds each integer up to 2^8 = 256 exactly, fp16 up to 2048,
# uint8 up to 255), and so is every sum below: at most SUM_TERMS ranks add a non-zero
# term (1 or 2) to an element, so every partial sum, in whatever order the backend
# adds, is an integer of at most 254. (Filling rank r with r + 1 made the sum
# p(p + 1)/2, past 256 from 23 ranks on: false mismatches in bf16.)
SUM_TERMS = 127
_PATTERN = 251  # a prime below 255: a shard's values repeat only every 251 elements


def shard_values(index: int, numel: int, tag: int) -> torch.Tensor:
    """The values the ``index``-th member of a group sends (an all-gather's shard, a
    max's input, a broadcast's buffer), in 1..251: shifted per member and per op, so
    that a chunk from the wrong member or op differs from the expected one."""
    e = torch.arange(numel, dtype=torch.int64, device="cpu")
    return (1 + (index + 13 * e + 29 * tag) % _PATTERN).to(torch.float64)


def _stride(p: int) -> int:
    """Element e takes a term from the members whose index is e modulo this."""
    return -(-p // SUM_TERMS)


def sum_terms(index: int, p: int, numel: int) -> torch.Tensor:
    """What the ``index``-th of ``p`` members adds to a sum: at the elements e with
    e = index (mod stride), 1 for even members and 2 for odd ones; 0 elsewhere. Every
    member adds to some element (a lost member shows) and no element gets more than
    SUM_TERMS terms."""
    m = _stride(p)
    e = torch.arange(numel, dtype=torch.int64, device="cpu")
    return ((e % m) == (index % m)).to(torch.float64) * (1 + index % 2)


def sum_expected(p: int, numel: int, offset: int = 0) -> torch.Tensor:
    """The sum over ``p`` members of ``sum_terms``, at elements ``offset`` ..
    ``offset + numel`` of the summed tensor (a reduce-scatter keeps one chunk)."""
    m = _stride(p)
    totals = torch.zeros(m, dtype=torch.float64, device="cpu")
    for r in range(p):
        totals[r % m] += 1 + r % 2
    return totals[(torch.arange(numel, dtype=torch.int64, device="cpu") + offset) % m]


def max_expected(p: int, numel: int, tag: int) -> torch.Tensor:
    """The element-wise max over ``p`` members of ``shard_values``."""
    out = torch.zeros(numel, dtype=torch.float64, device="cpu")
    for r in range(min(p, _PATTERN)):  # the values repeat with the member's index modulo 251
        out = torch.maximum(out, shard_values(r, numel, tag))
    return out


def _fill(t: torch.Tensor, values: torch.Tensor) -> None:
    t.copy_(values.to(dtype=t.dtype).to(t.device))


def _equal(t: torch.Tensor, expected: torch.Tensor) -> bool:
    """Exact equality: the values are integers every dtype here holds exactly, so the
    comparison is in float64, with no tolerance."""
    return bool(torch.equal(t.detach().to("cpu", torch.float64), expected))
