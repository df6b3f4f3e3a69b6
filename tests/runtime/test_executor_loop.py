"""The executor's own cost per op (runtime.executor_loop): the figures read from records
of the loop schedule, and a simulated run of that schedule charging them back."""

from __future__ import annotations

from commsim.hardware.platform import CPU
from commsim.ir import ops as O
from commsim.ir.trace import TraceRecord
from commsim.sim.engine import SimConfig, Simulator
from commsim.ir.schedule import Program, Schedule
from runtime.executor_loop import COLD_GEMM_SIDES, COLD_MEMORY_BYTES, cold_points, loop_costs, loop_schedule
from tests.sim.fixed_costs import FixedCosts


def _records(kernel_ns: int, gap_ns: int, host_gap: dict[str, int], n: int = 5) -> list[TraceRecord]:
    """Records as a CPU rank leaves them for a loop schedule of ``n`` ops per block."""
    sched = loop_schedule(1, n)
    out, t = [], 0
    for op in sched.program_of(0).step:
        if isinstance(op, O.Compute):
            out.append(TraceRecord(0, "compute", int(op.id), "elementwise", "tiny", t, t + kernel_ns))
            t += kernel_ns + gap_ns
        elif isinstance(op, O.HostWork):
            out.append(TraceRecord(0, "host", int(op.id), "host_python", "nothing", t, t + 100))
            t += 100 + host_gap["work"]
        elif isinstance(op, O.HostSync):
            out.append(TraceRecord(0, "host", int(op.id), "sync_device", "idle", t, t + 300))
            t += 300 + host_gap["sync"]
        elif isinstance(op, O.Alloc):
            out.append(TraceRecord(0, "host", int(op.id), "alloc", "small", t, t + 1000))
            t += 1000 + host_gap["work"] + host_gap["free"]  # the free is not recorded
    return out


def test_each_kind_of_op_gets_the_gap_the_loop_leaves_after_it():
    gaps = {"work": 2500, "sync": 2700, "free": 400}
    c = loop_costs(_records(4800, 7000, gaps), inline_kernels=True)
    assert (c.issue_ns, c.kernel_ns) == (7000, 4800)
    assert c.host_op_ns == {"work": 2500, "sync": 2700, "alloc": 2500, "free": 400,
                            "work_record": 100, "sync_record": 300}


def test_on_gpus_the_issue_rate_is_start_to_start_and_the_kernel_is_the_devices():
    c = loop_costs(_records(4800, 7000, {"work": 2500, "sync": 2700, "free": 400}), inline_kernels=False)
    assert (c.issue_ns, c.kernel_ns) == (11800, 0)


def test_a_simulated_loop_schedule_gives_back_the_measured_step():
    """The schedule simulated with the figures read from it: every op where it ran."""
    gaps = {"work": 2500, "sync": 2700, "free": 400}
    recs = _records(4800, 7000, gaps, n=5)
    c = loop_costs(recs, inline_kernels=True)
    costs = FixedCosts()
    costs.platform = CPU
    costs.issue_ns = c.issue_ns
    costs.loop_ns = c.host_op_ns
    res = Simulator(loop_schedule(1, 5), costs, SimConfig(jitter=0.0, keep_trace=True)).run()
    starts = {r.op.id: r.start_ns for r in res.ranks[0].records}
    # FixedCosts prices a kernel at its flops (0 here), host work and syncs at nothing,
    # an allocation at malloc_base_ns: the starts move by the loop's figures alone
    kernels = [starts[O.OpId(i)] for i in range(1, 6)]
    assert [b - a for a, b in zip(kernels, kernels[1:])] == [c.issue_ns] * 4
    works = [starts[O.OpId(i)] for i in range(6, 11)]
    assert [b - a for a, b in zip(works, works[1:])] == [100 + 2500] * 4  # its record, then the gap
    syncs = [r for r in res.ranks[0].records if 11 <= r.op.id <= 15]
    assert [r.end_ns - r.start_ns for r in syncs] == [300] * 5
    assert [b.start_ns - a.end_ns for a, b in zip(syncs, syncs[1:])] == [2700] * 4
    allocs = [starts[O.OpId(i)] for i in range(16, 26, 2)]
    assert [b - a for a, b in zip(allocs, allocs[1:])] == [costs.malloc_base_ns + 400 + 2500] * 4


def _cold_records(gap_after: dict[str, int]) -> list[TraceRecord]:
    """A CPU rank's records of the COLD blocks: each kernel, then the host work after it,
    ``gap_after[label]`` later."""
    sched = loop_schedule(1, 1, cold_reps=3)
    out, t = [], 0
    prev = None
    for op in sched.program_of(0).step:
        if not op.label.startswith(("cold ", "after cold ")):
            continue
        if isinstance(op, O.Compute):
            out.append(TraceRecord(0, "compute", int(op.id), op.kind.value, op.label, t, t + 50_000))
            t += 50_000 + gap_after[op.label]
        else:
            out.append(TraceRecord(0, "host", int(op.id), "host_python", op.label, t, t + 100))
            t += 100 + 3000
        prev = op
    assert prev is not None
    return out


def test_the_python_after_a_kernel_is_read_over_the_one_after_the_smallest():
    gaps = {f"cold memory {nb}": 6000 + i * 20_000 for i, nb in enumerate(COLD_MEMORY_BYTES)}
    gaps |= {f"cold gemm {m}": 10_000 + i * 30_000 for i, m in enumerate(COLD_GEMM_SIDES)}
    pts = cold_points(_cold_records(gaps))
    assert pts["memory"] == [[float(nb), i * 20_000.0] for i, nb in enumerate(COLD_MEMORY_BYTES)]
    assert pts["gemm"] == [[2.0 * m ** 3, 4000.0 + i * 30_000] for i, m in enumerate(COLD_GEMM_SIDES)]
    # the blocks are left out of the loop's own figures, and a GPU's records give none
    recs = _records(4800, 7000, {"work": 2500, "sync": 2700, "free": 400}) + _cold_records(gaps)
    assert loop_costs(recs, inline_kernels=True).cold_points == pts
    assert loop_costs(recs, inline_kernels=True).issue_ns == 7000
    assert loop_costs(recs, inline_kernels=False).cold_points == {}


def test_the_host_pays_the_python_after_a_kernel_before_its_next_op():
    costs = FixedCosts()
    costs.platform = CPU
    ops = (O.Compute(O.OpId(1), "compute", "k", O.ComputeKind.ELEMENTWISE, 1000, 0, 0),
           O.HostWork(O.OpId(2), "after", O.HostKind.PYTHON, 500),
           O.HostWork(O.OpId(3), "then", O.HostKind.PYTHON, 500))

    def starts(after_ns):
        costs.after_kernel_ns = after_ns
        res = Simulator(Schedule.uniform(1, Program((), ops)), costs, SimConfig(jitter=0.0, keep_trace=True)).run()
        return {int(r.op.id): r.start_ns for r in res.ranks[0].records}

    plain, cold = starts(0), starts(40_000)
    assert (cold[2] - plain[2], cold[3] - plain[3]) == (40_000, 40_000)  # once, after the kernel
