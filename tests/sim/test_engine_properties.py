"""Engine invariants on random valid schedules (tests/schedule_gen.py), with the round-number
cost model of tests/sim/fixed_costs.py so that every time is an exact integer.

Each property is a plain checker over (schedule, result), run by a hypothesis test; a
second, hand-made test per checker breaks the property in a real trace and expects the
checker to fail, so that the checkers can fail. Only the engine's public surface is used
(Simulator, SimConfig, simulate, SimResult and its records / host blocks), so that the
tests survive refactors of the engine's insides.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from commsim.report.metrics import STALL_CAUSES, StepInfo, compute_metrics, stall_breakdown
from commsim.sim.engine import HOST, SimConfig, SimResult, Simulator, simulate
from tests.schedule_gen import schedules
from tests.sim.fixed_costs import FixedCosts

COMPUTE = "compute"
MiB = 1 << 20


# ---------------------------------------------------------------- scenarios


def costs():
    """A fixed cost model: roomy or tight memory (cache flushes, out of memory), one or two
    GPUs a node, collectives with or without latency."""
    return st.builds(FixedCosts, hbm_bytes=st.sampled_from([1 << 40, 6 * MiB, 24 * MiB, 44 * MiB]),
                     gpus_per_node=st.sampled_from([1, 2]), latency_ns=st.sampled_from([0, 7]))


# A group's collectives may sit on several streams of a rank (ZeRO-3 with overlap_comm:
# all-gathers and reduce-scatters over one group); the engine matches them in issue
# order (test_collectives_matched_in_issue_order).
STREAM_PER_GROUP = False


@st.composite
def cases(draw, symmetric_ok: bool = True):
    """(schedule, cost model, config): a valid schedule, simulated per rank (or symmetric
    when its ranks share one program), with or without jitter, a warm-up step and a short
    launch queue."""
    # buffers of up to 1 MiB share 2 MiB segments; larger ones take 20 MiB segments
    sched = draw(schedules(max_persistent_bytes=MiB, stream_per_group=STREAM_PER_GROUP, max_ops=12,
                           max_tmp_bytes=draw(st.sampled_from([MiB, 12 * MiB])), alloc_weight=4))
    mode = "per-rank"
    if symmetric_ok and len(sched.programs) == 1 and draw(st.booleans()):
        mode = "symmetric"
    config = SimConfig(mode=mode, seed=draw(st.integers(0, 3)), jitter=draw(st.sampled_from([0.0, 0.05])),
                       rank_noise_sd=0.0, launch_queue_depth=draw(st.sampled_from([1, 2, 1024])),
                       warmup_steps=draw(st.integers(0, 1)))  # 2+: see test_two_warm_up_steps
    return sched, draw(costs()), config


def run(sched: Schedule, cost, config: SimConfig) -> SimResult:
    return simulate(Simulator(sched, cost, config))


def records_by_id(result: SimResult, rank: int) -> dict:
    return {r.op.id: r for r in result.ranks[rank].records}


# ---------------------------------------------------------------- checkers


def check_complete(sched: Schedule, result: SimResult) -> None:
    """Properties 1 and 2: without OOM, every simulated rank recorded every op of its
    step exactly once (host ops on the host stream, device ops on their stream) and
    nothing else; frees are never recorded (neither the simulator nor the executor
    traces them). A deadlock shows as ops left unrecorded (or SimPy's 'no scheduled
    events left' from the run itself)."""
    assert result.oom is None
    expected_ranks = {0} if result.mode == "symmetric" else set(range(sched.world_size))
    assert set(result.ranks) == expected_ranks
    for rank, rr in result.ranks.items():
        step = sched.program_of(rank).step
        counts = Counter(r.op.id for r in rr.records)
        for op in step:
            if isinstance(op, O.Free):
                assert counts[op.id] == 0, (rank, op)
            else:
                assert counts[op.id] == 1, (rank, op, counts[op.id])
        assert set(counts) <= {op.id for op in step}, (rank, set(counts) - {op.id for op in step})
        ops = {op.id: op for op in step}
        for r in rr.records:
            assert r.rank == rank
            assert r.op == ops[r.op.id]
            assert r.stream == (r.op.stream if O.is_device_op(r.op) else HOST), (rank, r)
            assert 0 <= r.issue_ns <= r.start_ns <= r.end_ns <= result.step_time_ns, (rank, r)


def check_order(sched: Schedule, result: SimResult) -> None:
    """Property 3, per rank: a device op starts no earlier than its issue, its deps' ends
    and (ready_ns) when those allowed it; on each stream ops start in issue order, each
    after the previous one ended; the host runs its ops in program order, one at a time,
    issuing device ops as it passes them; a host sync ends no earlier than what it waits
    on (its deps, everything issued before it on its stream, or on every stream), and so
    does an allocation that synchronised the device (cudaMalloc, cache flush)."""
    for rank, rr in result.ranks.items():
        rec = records_by_id(result, rank)
        step = sched.program_of(rank).step
        last_on: dict[str, object] = {}
        host_free = 0
        issued: list = []  # device records issued so far, in program order
        device_syncs = {hb.start_ns for hb in rr.host_blocks if hb.reason in ("allocator", "allocator_flush")}
        for op in step:
            if isinstance(op, O.Free):
                continue
            r = rec[op.id]
            if O.is_device_op(op):
                assert r.issue_ns >= host_free, (rank, op.id, "issued before the host got there")
                host_free = r.issue_ns
                assert r.issue_ns <= r.ready_ns <= r.start_ns, (rank, r)
                for d in op.deps:
                    assert r.start_ns >= rec[d].end_ns, (rank, op.id, "starts before dep", d)
                    assert r.ready_ns >= rec[d].end_ns, (rank, op.id, "ready before dep", d)
                prev = last_on.get(op.stream)
                if prev is not None:
                    assert r.start_ns >= prev.end_ns, (rank, op.id, "overlaps previous op on", op.stream)
                    assert r.ready_ns >= prev.end_ns, (rank, op.id, "ready before previous op on", op.stream)
                last_on[op.stream] = r
                issued.append(r)
                continue
            assert r.start_ns >= host_free, (rank, op.id, "host op overlaps the previous one")
            host_free = r.end_ns
            if isinstance(op, O.HostSync):
                if op.scope is O.SyncScope.OPS:
                    waited = [rec[d] for d in op.deps]
                elif op.scope is O.SyncScope.STREAM:
                    waited = [x for x in issued if x.stream == op.stream]
                else:
                    waited = issued
                for w in waited:
                    assert r.end_ns >= w.end_ns, (rank, op.id, "sync ends before", w.op.id)
            elif isinstance(op, O.Alloc) and r.start_ns in device_syncs:
                for w in issued:
                    assert r.end_ns >= w.end_ns, (rank, op.id, "device-synchronising alloc ends before", w.op.id)


def collective_instances(sched: Schedule, ranks) -> dict[tuple, dict[int, O.OpId]]:
    """The same collective on every member: the k-th collective over a group in each
    member's program (the IR's matching rule: same order per group)."""
    out: dict[tuple, dict[int, O.OpId]] = defaultdict(dict)
    for rank in ranks:
        seen: Counter = Counter()
        for op in sched.program_of(rank).step:
            if isinstance(op, O.Collective):
                out[(op.group, seen[op.group])][rank] = op.id
                seen[op.group] += 1
    return out


def check_collectives_together(sched: Schedule, result: SimResult) -> None:
    """Property 3, across ranks: a collective starts (and ends) at the same moment on
    every simulated member."""
    for key, members in collective_instances(sched, result.ranks).items():
        times = {rank: (records_by_id(result, rank)[i].start_ns, records_by_id(result, rank)[i].end_ns)
                 for rank, i in members.items()}
        assert len(set(times.values())) == 1, (key, times)


def check_accounting(result: SimResult) -> None:
    """Property 4, for every simulated rank: the step time equals the compute stream's
    busy time (the union of its Compute kernels) plus the stall breakdown (its idle time
    by cause, which also counts collectives and copies run on the compute stream), as
    metrics.py defines them: exact in integer ns (stall_breakdown), and to 1 ns per
    figure in compute_metrics' float seconds."""
    step = result.step_time_ns
    info = StepInfo(world_size=len(result.ranks), nodes=1, tokens_per_gpu=0, model_flops_per_gpu=0.0,
                    hardware_flops_per_gpu=0.0)
    for rank, rr in result.ranks.items():
        comp = sorted((r.start_ns, r.end_ns) for r in rr.records if r.stream == COMPUTE and isinstance(r.op, O.Compute))
        busy, cur = 0, None
        for a, b in comp:  # union length
            if cur is None or a > cur[1]:
                busy += b - a
                cur = [a, b]
            elif b > cur[1]:
                busy += b - cur[1]
                cur[1] = b
        stalls = stall_breakdown([r for r in rr.records if r.stream != HOST], rr.host_blocks, step)
        assert set(stalls) == set(STALL_CAUSES)
        assert all(v >= 0 for v in stalls.values()), (rank, stalls)
        assert busy + sum(stalls.values()) == step, (rank, busy, stalls, step)
        if not step:
            continue
        m = compute_metrics(result, info, rank=rank)
        figures = [m.compute_busy_frac * step] + [v * 1e9 for v in m.stalls_s.values()]
        assert round(m.step_time_s * 1e9) == step
        assert abs(sum(round(f) for f in figures) - step) <= len(figures), (rank, figures, step)
        assert round(m.compute_busy_frac * step) == busy


def trace_key(result: SimResult, rank: int) -> list:
    """A rank's records as comparable tuples, by op id (ops that end at the same instant
    are recorded in whichever order their processes resume, which the two modes need not
    share). ready_ns only for device ops: the engine never sets it on host records (0
    before the step's shift, so minus the warm-up's length after it)."""
    return sorted((int(r.op.id), r.stream, r.issue_ns, r.start_ns, r.end_ns, r.ready_ns if r.stream != HOST else None)
                  for r in result.ranks[rank].records)


# ---------------------------------------------------------------- properties


@settings(max_examples=200, deadline=None)
@given(cases())
def test_no_deadlock_and_every_op_recorded_once(case):
    sched, cost, config = case
    result = run(sched, cost, config)
    if result.oom is not None:  # tight memory may not fit: nothing to check but the message
        assert result.oom
        return
    check_complete(sched, result)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_deps_stream_order_and_host_syncs_respected(case):
    sched, cost, config = case
    result = run(sched, cost, config)
    if result.oom is None:
        check_order(sched, result)


@settings(max_examples=200, deadline=None)
@given(cases(symmetric_ok=False))
def test_collective_starts_together_on_every_member(case):
    sched, cost, config = case
    result = run(sched, cost, config)
    if result.oom is None:
        check_collectives_together(sched, result)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_step_time_is_compute_busy_plus_stalls(case):
    sched, cost, config = case
    result = run(sched, cost, config)
    if result.oom is None:
        check_accounting(result)


@settings(max_examples=150, deadline=None)
@given(schedules(min_world=1, max_world=4, shared=True, full_groups=True, max_persistent_bytes=MiB, max_ops=12,
                 max_tmp_bytes=12 * MiB, alloc_weight=4), costs(),
       st.integers(0, 1), st.sampled_from([1, 2, 1024]))
def test_per_rank_without_noise_equals_symmetric(sched, cost, warmup, depth):
    assert len(sched.programs) == 1
    # Symmetric mode shares rank 0's NICs with gpus_per_node sibling groups even when the
    # world has fewer ranks on its node: see test_symmetric_nic_sharing_on_a_partial_node.
    assume(sched.world_size >= cost.gpus_per_node)
    base = SimConfig(jitter=0.0, rank_noise_sd=0.0, warmup_steps=warmup, launch_queue_depth=depth)
    sym = run(sched, cost, replace(base, mode="symmetric"))
    per = run(sched, cost, replace(base, mode="per-rank"))
    assert (sym.oom is None) == (per.oom is None)
    if sym.oom is not None:
        return
    assert per.step_time_ns == sym.step_time_ns
    assert trace_key(per, 0) == trace_key(sym, 0)
    for rank in per.ranks:  # every rank alike
        assert trace_key(per, rank) == trace_key(sym, 0)


# ---------------------------------------------------------------- the checkers can fail


def _comp(i, flops, stream=COMPUTE, deps=()):
    return O.Compute(O.OpId(i), stream, f"c{i}", O.ComputeKind.GEMM, flops, 0, 0, deps=deps)


def _coll(i, size, group, stream="ag", deps=()):
    return O.Collective(O.OpId(i), stream, f"ag{i}", O.CollectiveKind.ALL_GATHER, size, O.DType.UINT8, group,
                        deps=deps)


def _example() -> tuple[Schedule, SimResult]:
    """Two ranks: a collective both wait on, cross-stream deps, host syncs of each scope."""
    prog = Program((), (
        O.Alloc(O.OpId(1), COMPUTE, "a", "buf", 1000),
        _comp(2, 100),
        _coll(3, 50, (0, 1), deps=(O.OpId(2),)),
        _comp(4, 30, deps=(O.OpId(3),)),
        O.HostSync(O.OpId(5), "s", O.SyncScope.STREAM, stream="ag"),
        _comp(6, 20, stream="side"),
        O.HostSync(O.OpId(7), "o", O.SyncScope.OPS, deps=(O.OpId(6),)),
        O.HostWork(O.OpId(8), "py", O.HostKind.PYTHON, 40),
        O.HostSync(O.OpId(9), "d", O.SyncScope.DEVICE),
        O.Free(O.OpId(10), COMPUTE, "f", "buf"),
    ))
    sched = Schedule.from_rank_programs([prog, replace(prog, step=prog.step[:1] + (_comp(2, 130),) + prog.step[2:])])
    return sched, run(sched, FixedCosts(), SimConfig(mode="per-rank", jitter=0.0, warmup_steps=0))


def _rec(result, rank, i):
    return records_by_id(result, rank)[O.OpId(i)]


def test_checkers_pass_on_the_example():
    sched, res = _example()
    check_complete(sched, res)
    check_order(sched, res)
    check_collectives_together(sched, res)
    check_accounting(res)
    # after the cudaMalloc (1000 ns), the collective waits for rank 1's longer kernel
    assert (_rec(res, 0, 3).start_ns, _rec(res, 1, 3).start_ns) == (1130, 1130)
    assert _rec(res, 0, 3).wait_peers_ns == 30


@pytest.mark.parametrize("breakage", ["missing", "duplicate", "wrong_stream", "free_recorded"])
def test_check_complete_fails_on_a_broken_trace(breakage):
    sched, res = _example()
    records = res.ranks[1].records
    if breakage == "missing":
        records.remove(_rec(res, 1, 4))
    elif breakage == "duplicate":
        records.append(replace(_rec(res, 1, 4)))
    elif breakage == "wrong_stream":
        _rec(res, 1, 8).stream = COMPUTE
    else:
        records.append(replace(_rec(res, 1, 8), op=sched.program_of(1).step[-1]))
    with pytest.raises(AssertionError):
        check_complete(sched, res)


@pytest.mark.parametrize("breakage", ["before_dep", "stream_overlap", "sync_early", "host_overlap"])
def test_check_order_fails_on_a_broken_trace(breakage):
    sched, res = _example()
    if breakage == "before_dep":  # c4 waits for the collective
        r = _rec(res, 0, 4)
        r.start_ns = _rec(res, 0, 3).end_ns - 1
    elif breakage == "stream_overlap":  # c2 still running when c4 starts on the same stream
        r = _rec(res, 1, 2)
        r.end_ns = _rec(res, 1, 4).start_ns + 1
    elif breakage == "sync_early":
        _rec(res, 0, 5).end_ns = _rec(res, 0, 3).end_ns - 1
    else:
        _rec(res, 0, 8).start_ns = _rec(res, 0, 7).end_ns - 1
    with pytest.raises(AssertionError):
        check_order(sched, res)


def test_check_collectives_together_fails_on_a_broken_trace():
    sched, res = _example()
    _rec(res, 1, 3).start_ns += 1
    with pytest.raises(AssertionError):
        check_collectives_together(sched, res)


@pytest.mark.parametrize("breakage", ["kernel_past_step", "overlapping_host_blocks"])
def test_check_accounting_fails_on_a_broken_trace(breakage):
    sched, res = _example()
    if breakage == "kernel_past_step":
        _rec(res, 0, 4).end_ns = res.step_time_ns + 5
    else:
        # the cudaMalloc block (0-1000, the compute stream idle) counted twice
        res.ranks[0].host_blocks.append(replace(res.ranks[0].host_blocks[0]))
    with pytest.raises(AssertionError):
        check_accounting(res)


def test_per_rank_equals_symmetric_check_fails_when_a_rank_differs():
    prog = Program((), (_comp(1, 10), _coll(2, 40, (0, 1)), _comp(3, 5, deps=(O.OpId(2),))))
    sched = Schedule.uniform(2, prog)
    base = SimConfig(jitter=0.0, rank_noise_sd=0.0)
    sym = run(sched, FixedCosts(), replace(base, mode="symmetric"))
    per = run(sched, FixedCosts(), replace(base, mode="per-rank"))
    assert trace_key(per, 0) == trace_key(sym, 0) == [(1, COMPUTE, 0, 0, 10, 0), (2, "ag", 0, 0, 40, 0),
                                                       (3, COMPUTE, 0, 40, 45, 40)]
    # with jitter the ranks' kernels differ, and so does the comparison
    jit = run(sched, FixedCosts(), replace(base, mode="per-rank", jitter=0.3, seed=1))
    assert trace_key(jit, 0) != trace_key(sym, 0)


# ---------------------------------------------------------------- defects these tests found, fixed


def test_two_warm_up_steps():
    # the host waited for the previous step only before the measured one: a second
    # warm-up step reused the first's op ids while its ops were in flight
    prog = Program((), (_comp(1, 100),))
    res = run(Schedule.uniform(1, prog), FixedCosts(), SimConfig(mode="symmetric", warmup_steps=2))
    assert [(r.op.id, r.start_ns, r.end_ns) for r in res.ranks[0].records] == [(1, 0, 100)]
    assert res.step_time_ns == 100


def test_symmetric_nic_sharing_on_a_partial_node():
    # one rank on a node of two GPUs: no sibling group shares its NIC
    prog = Program((), (_coll(1, 128, (0,)),))
    sched, cost = Schedule.uniform(1, prog), FixedCosts(gpus_per_node=2)
    base = SimConfig(jitter=0.0, rank_noise_sd=0.0)
    per = run(sched, cost, replace(base, mode="per-rank"))
    assert per.step_time_ns == 128  # 128 bytes over a 1 byte/ns NIC
    assert run(sched, cost, replace(base, mode="symmetric")).step_time_ns == 128  # 256: the NIC at half rate


def test_collectives_matched_in_issue_order():
    # ZeRO-3's shape: reduce-scatter and all-gather over one group, on their own streams
    rs = O.Collective(O.OpId(1), "reduce", "rs", O.CollectiveKind.REDUCE_SCATTER, 100, O.DType.UINT8, (0, 1),
                      reduce_op=O.ReduceOp.SUM)
    ag = _coll(2, 50, (0, 1), stream="allgather")
    late = replace(rs, deps=(O.OpId(3),))
    sched = Schedule.from_rank_programs([Program((), (rs, ag)), Program((), (_comp(3, 1000), late, ag))])
    res = run(sched, FixedCosts(), SimConfig(mode="per-rank", jitter=0.0, warmup_steps=0))
    # the all-gathers pair up at once, the reduce-scatters once rank 1 reaches its own;
    # the engine pairs rank 0's reduce-scatter with rank 1's all-gather at 0 (0-50)
    assert [(_rec(res, r, 1).start_ns, _rec(res, r, 1).end_ns) for r in (0, 1)] == [(1000, 1100)] * 2
    check_collectives_together(sched, res)


def test_collectives_of_a_group_on_two_streams_complete():
    g, h = (0, 1, 2), (0, 1)
    sched = Schedule.from_rank_programs([
        Program((), (_coll(1, 30, g, stream=COMPUTE), _coll(2, 20, h, stream=COMPUTE),
                     _coll(3, 30, g, stream=COMPUTE))),
        # rank 1 reaches its second collective over g first: the engine pairs it with the others' first
        Program((), (_comp(4, 100), _coll(1, 30, g, stream=COMPUTE), _coll(2, 20, h, stream=COMPUTE),
                     _coll(3, 30, g, stream="allgather"))),
        Program((), (_coll(1, 30, g, stream=COMPUTE), _coll(3, 30, g, stream=COMPUTE))),
    ])
    res = run(sched, FixedCosts(), SimConfig(mode="per-rank", jitter=0.0, warmup_steps=0))
    check_complete(sched, res)  # the engine recorded only ag1 on ranks 0 and 2, ag3 and c4 on rank 1
    check_collectives_together(sched, res)


def test_a_collective_some_member_never_reaches_is_a_named_deadlock():
    from commsim.sim.engine import ScheduleDeadlock

    sched = Schedule.from_rank_programs([Program((), (_coll(1, 30, (0, 1)), _comp(2, 10, deps=(O.OpId(1),)))),
                                         Program((), (_comp(2, 10),))])
    with pytest.raises(ScheduleDeadlock, match=r"^the schedule deadlocks: rank 0 at op 1 `ag1` \(2 op\(s\) unfinished\); "
                       r"collectives waiting for members: 2-rank group 0-1 call 0 \(1 of 2 arrived\)$"):
        run(sched, FixedCosts(), SimConfig(mode="per-rank", jitter=0.0, warmup_steps=0))
