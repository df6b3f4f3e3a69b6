"""A schedule's collectives as real ``torch.distributed`` collectives.

``ProcessGroups`` creates a process group for each rank tuple the schedule's collectives
use; ``Collectives.issue`` hands one collective op to the backend asynchronously, of its
kind (all-gather, reduce-scatter, all-reduce, broadcast), size in bytes, dtype and group,
on the rank's buffers where one is large enough. With ``check_data`` every collective
carries known values and comes with a check of its result: an all-gather must hold the
concatenation of every rank's shard, a reduce-scatter or all-reduce the sum (or max),
a broadcast the root's buffer.
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

    def _tensor(self, names: tuple[str, ...], nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A typed view of the first listed buffer large enough, else a scratch tensor."""
        item = torch.empty(0, dtype=dtype).element_size()
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

    def _fill(self, t: torch.Tensor, value: float) -> None:
        t.fill_(value)

    def issue(self, op: O.Collective) -> tuple[Any, Callable[[], None] | None]:
        """Issue one collective asynchronously; returns (work, check) where check()
        verifies the data once the work is done (None without ``check_data``)."""
        dtype = TORCH_DTYPE[op.dtype]
        group = self.groups[op.group]
        p = len(op.group)
        me = op.group.index(self.rank)
        check: Any = None
        tag = float(op.id % 7)
        if op.kind is O.CollectiveKind.ALL_GATHER:
            out = self._tensor(op.buffers, op.size_bytes, dtype)
            shard = self._partition(op, out.numel() // p, dtype)
            if self.check_data:
                self._fill(shard, me + 1 + tag)

                def _check() -> None:
                    for r in range(p):
                        chunk = out[r * shard.numel():(r + 1) * shard.numel()]
                        if not bool((chunk == r + 1 + tag).all()):
                            raise DataMismatch(f"all-gather chunk {r} does not hold rank {op.group[r]}'s shard")
                check = _check
            work = all_gather(out, shard, group=group, async_op=True)
        elif op.kind is O.CollectiveKind.REDUCE_SCATTER:
            inp = self._tensor(op.buffers, op.size_bytes, dtype)
            out = self._partition(op, inp.numel() // p, dtype)
            if self.check_data:
                self._fill(inp, me + 1)

                def _check() -> None:
                    if not bool((out == p * (p + 1) / 2).all()):
                        raise DataMismatch(f"reduce-scatter result is not the sum over {p} ranks")
                check = _check
            work = reduce_scatter(out, inp, op=_REDUCE[op.reduce_op or O.ReduceOp.SUM], group=group, async_op=True)
        elif op.kind is O.CollectiveKind.ALL_REDUCE:
            buf = self._tensor(op.buffers, op.size_bytes, dtype)
            rop = op.reduce_op or O.ReduceOp.SUM
            if self.check_data:
                self._fill(buf, me + 1)
                expect = p * (p + 1) / 2 if rop is not O.ReduceOp.MAX else p

                def _check() -> None:
                    if not bool((buf == expect).all()):
                        raise DataMismatch(f"all-reduce result is not the {rop.value} over {p} ranks")
                check = _check
            work = dist.all_reduce(buf, op=_REDUCE[rop], group=group, async_op=True)
        else:
            buf = self._tensor(op.buffers, op.size_bytes, dtype)
            root = op.root if op.root is not None else op.group[0]
            if self.check_data:
                self._fill(buf, 42.0 if self.rank == root else 0.0)

                def _check() -> None:
                    if not bool((buf == 42.0).all()):
                        raise DataMismatch(f"broadcast did not deliver rank {root}'s buffer")
                check = _check
            work = dist.broadcast(buf, src=root, group=group, async_op=True)
        return work, check
