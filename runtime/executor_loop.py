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
  allocate-free pair leaves beyond the allocation's. And the records of a host work of
  no duration and of a sync with nothing to wait for: their own calls (the spin's, the
  events') inside the record.

Where kernels run on the host thread (CPUs), the Python that follows a kernel runs slower
the more of the caches the kernel's data took: the interpreter's own code and data come
back from memory. One rank of the executor on the development VM: 6 us after a 64 KiB
memory-bound kernel, 9 after 1 MiB, 20 after 16 MiB, 62 after 64 MiB; 10 us after a
256^3 fp32 GEMM, 20 after 512^3, 81 after 1024^3; after a 5 ms spin of the host, 6 (the
kernel's time alone does not do it). So the schedule also runs memory-bound kernels and
GEMMs of a few sizes, each followed by a host work of no duration: the gap over the one
after a tiny kernel is what the Python after a kernel of that size pays
(``cold_points``). It is the interpreter's, so a framework's Python after a kernel pays
it too.

Means over each block: the loop's occasional long gaps come back in every real step
too (the block's median left the simulated block 3% short of the measured one). Calibrate
takes the median of three steps' figures, so one slice of another process does not count.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from commsim.ir.trace import TraceRecord

# ops per block: enough gaps for a stable median, few enough to keep calibration short
OPS_PER_BLOCK = 300
HOST_OP_KINDS = ("work", "sync", "alloc", "free")
# and what a host work of no duration and a sync with nothing to wait for record
RECORD_KINDS = ("work_record", "sync_record")
# the kernels whose following Python is timed (CPUs): memory-bound ones by the bytes
# they move (the first is the warm reference), square fp32 GEMMs by their side
COLD_MEMORY_BYTES = (128, 1 << 20, 8 << 20, 64 << 20)
COLD_GEMM_SIDES = (256, 512, 1024)
COLD_REPS = 24  # each kernel, each followed by a host work of no duration


@dataclass(frozen=True)
class LoopCosts:
    issue_ns: int  # host time between device ops beyond their records
    kernel_ns: int  # CPUs: the tiny kernel's recorded time (its fixed cost); GPUs: 0
    # HOST_OP_KINDS -> the loop's time per host op beyond its record; RECORD_KINDS -> the
    # time inside the record of a host work (beyond its duration) and of a sync
    host_op_ns: dict[str, int]
    # CPUs: the Python after a kernel, over its time after a tiny one: (bytes moved, ns)
    # of memory-bound kernels and (flops, ns) of GEMMs; empty where kernels are queued
    cold_points: dict[str, list[list[float]]]


def loop_schedule(world: int, n: int = OPS_PER_BLOCK, cold_reps: int = 0) -> Schedule:
    """One step of ``n`` tiny kernels, ``n`` host works of no duration, ``n`` host syncs
    with nothing in flight and ``n`` allocate-free pairs of 4 KiB, block by block; then,
    with ``cold_reps``, each of the COLD kernels that many times, each followed by a host
    work of no duration."""
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
    kernels = [O.Compute(O.OpId(0), "compute", f"cold memory {nb}", O.ComputeKind.ELEMENTWISE, 0, nb // 2, nb // 2)
               for nb in COLD_MEMORY_BYTES]
    kernels += [O.Compute(O.OpId(0), "compute", f"cold gemm {m}", O.ComputeKind.GEMM, 2 * m ** 3, 0, 0,
                          O.GemmShape(m, m, m, 1)) for m in COLD_GEMM_SIDES]
    for kernel in kernels if cold_reps else ():
        for _ in range(cold_reps):
            ops.append(replace(kernel, id=next_id()))
            ops.append(O.HostWork(next_id(), "after " + kernel.label, O.HostKind.PYTHON, 0))
    return Schedule.uniform(world, Program((), tuple(ops)))


def _gaps(recs: list[TraceRecord], start_to_start: bool = False) -> list[int]:
    """Gaps between consecutive records of one block (start to start, or end to start)."""
    recs = sorted(recs, key=lambda r: r.start_ns)
    return [b.start_ns - (a.start_ns if start_to_start else a.end_ns) for a, b in zip(recs, recs[1:])]


def loop_costs(records: list[TraceRecord], inline_kernels: bool) -> LoopCosts:
    """The figures from one step's records of ``loop_schedule`` (one rank, one step)."""
    cold = [r for r in records if r.label.startswith(("cold ", "after cold "))]
    records = [r for r in records if not r.label.startswith(("cold ", "after cold "))]
    by_kind: dict[str, list[TraceRecord]] = {}
    for r in records:
        by_kind.setdefault(r.kind, []).append(r)
    kernels = by_kind.get(O.ComputeKind.ELEMENTWISE.value, [])
    assert len(kernels) > 1, "the loop schedule's kernels were not recorded"

    def mean_gap(recs: list[TraceRecord], start_to_start: bool = False) -> int:
        gaps = _gaps(recs, start_to_start)
        return max(0, int(statistics.fmean(gaps))) if gaps else 0

    def mean_duration(recs: list[TraceRecord]) -> int:
        return int(statistics.fmean(r.duration_ns for r in recs)) if recs else 0

    if inline_kernels:
        issue = mean_gap(kernels)
        kernel = int(statistics.fmean(r.duration_ns for r in kernels))
    else:
        issue, kernel = mean_gap(kernels, start_to_start=True), 0
    works = by_kind.get("host_" + O.HostKind.PYTHON.value, [])
    syncs = by_kind.get("sync_" + O.SyncScope.DEVICE.value, [])
    work, sync = mean_gap(works), mean_gap(syncs)
    pair = mean_gap(by_kind.get("alloc", []))  # the allocation's loop and the whole free
    host = {"work": work, "sync": sync, "alloc": work, "free": max(0, pair - work),
            "work_record": mean_duration(works), "sync_record": mean_duration(syncs)}
    return LoopCosts(issue, kernel, host, cold_points(cold) if inline_kernels and cold else {})


def cold_points(records: list[TraceRecord]) -> dict[str, list[list[float]]]:
    """From the COLD blocks' records: the mean gap after each kernel to its host work,
    over that after the smallest memory-bound kernel (never below 0)."""
    recs = sorted(records, key=lambda r: r.start_ns)
    gaps: dict[str, list[int]] = {}
    for a, b in zip(recs, recs[1:]):
        if b.label == "after " + a.label:
            gaps.setdefault(a.label, []).append(b.start_ns - a.end_ns)
    mean = {label: statistics.fmean(g) for label, g in gaps.items()}
    warm = mean[f"cold memory {COLD_MEMORY_BYTES[0]}"]
    memory = [[float(nb), max(0.0, mean[f"cold memory {nb}"] - warm)] for nb in COLD_MEMORY_BYTES]
    gemm = [[2.0 * m ** 3, max(0.0, mean[f"cold gemm {m}"] - warm)] for m in COLD_GEMM_SIDES]
    return {"memory": memory, "gemm": gemm}
