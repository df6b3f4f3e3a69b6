"""The executor's own cost per op: the schedule calibrate runs to measure it, and the
figures read from that run's records.

The executor walks a rank's program in a Python loop: for each op it notes the op
(progress), dispatches on its type, reads the clock, runs it, and appends its record.
A record covers the op itself; the loop's bookkeeping around it lies between records,
where no op is recorded. A prediction for ``commsim execute`` has to leave the same
gaps, or its per-op times absorb them (every small kernel too long) and its phases
miss them (a ZeRO-3 optimizer phase runs several hundred allocations, frees and syncs).
So the calibration schedule runs each kind of op in a block of its own, and the figures
are per kind:

* device ops (a tiny memory-bound kernel): on CPUs, where the kernel runs on the host
  thread, the kernel's recorded time and the gap from one record's end to the next
  one's start (the loop); on GPUs, where records are device times and the host only
  issues, the gap between consecutive starts (the host's issue rate);
* host ops: the gap after each host work of no duration, host sync with nothing to wait
  for, and allocation; a free is not recorded, so its whole cost is the gap an
  allocate-free pair leaves beyond the allocation's.

Means over each block: the loop's occasional long gaps (the garbage collector's passes
over the records and completions it keeps) come back in every real step too. Calibrate
takes the median of three steps' figures, so one slice of another process does not count.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from commsim.ir.trace import TraceRecord

# ops per block: enough gaps for a stable median, few enough to keep calibration short
OPS_PER_BLOCK = 300
HOST_OP_KINDS = ("work", "sync", "alloc", "free")


@dataclass(frozen=True)
class LoopCosts:
    issue_ns: int  # host time between device ops beyond their records
    kernel_ns: int  # CPUs: the tiny kernel's recorded time (its fixed cost); GPUs: 0
    host_op_ns: dict[str, int]  # HOST_OP_KINDS -> the loop's time per host op beyond its record


def loop_schedule(world: int, n: int = OPS_PER_BLOCK) -> Schedule:
    """One step of ``n`` tiny kernels, ``n`` host works of no duration, ``n`` host syncs
    with nothing in flight and ``n`` allocate-free pairs of 4 KiB, block by block."""
    ops: list = []

    def next_id() -> O.OpId:
        return O.OpId(len(ops) + 1)

    for _ in range(n):
        ops.append(O.Compute(next_id(), "compute", "tiny", O.ComputeKind.ELEMENTWISE, 0, 64, 64))
    for _ in range(n):
        ops.append(O.HostWork(next_id(), "nothing", O.HostKind.PYTHON, 0))
    for _ in range(n):
        ops.append(O.HostSync(next_id(), "idle", O.SyncScope.DEVICE))
    for i in range(n):
        ops.append(O.Alloc(next_id(), "compute", "small", f"loop{i}", 4096))
        ops.append(O.Free(next_id(), "compute", "small", f"loop{i}"))
    return Schedule.uniform(world, Program((), tuple(ops)))


def _gaps(recs: list[TraceRecord], start_to_start: bool = False) -> list[int]:
    """Gaps between consecutive records of one block (start to start, or end to start)."""
    recs = sorted(recs, key=lambda r: r.start_ns)
    return [b.start_ns - (a.start_ns if start_to_start else a.end_ns) for a, b in zip(recs, recs[1:])]


def loop_costs(records: list[TraceRecord], inline_kernels: bool) -> LoopCosts:
    """The figures from one step's records of ``loop_schedule`` (one rank, one step)."""
    by_kind: dict[str, list[TraceRecord]] = {}
    for r in records:
        by_kind.setdefault(r.kind, []).append(r)
    kernels = by_kind.get(O.ComputeKind.ELEMENTWISE.value, [])
    assert len(kernels) > 1, "the loop schedule's kernels were not recorded"

    def mean_gap(recs: list[TraceRecord], start_to_start: bool = False) -> int:
        gaps = _gaps(recs, start_to_start)
        return max(0, int(statistics.fmean(gaps))) if gaps else 0

    if inline_kernels:
        issue = mean_gap(kernels)
        kernel = int(statistics.fmean(r.duration_ns for r in kernels))
    else:
        issue, kernel = mean_gap(kernels, start_to_start=True), 0
    work = mean_gap(by_kind.get("host_" + O.HostKind.PYTHON.value, []))
    sync = mean_gap(by_kind.get("sync_" + O.SyncScope.DEVICE.value, []))
    pair = mean_gap(by_kind.get("alloc", []))  # the allocation's loop and the whole free
    return LoopCosts(issue, kernel, {"work": work, "sync": sync, "alloc": work, "free": max(0, pair - work)})
