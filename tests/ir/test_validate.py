"""The validator accepts clean schedules and finds every injected fault, naming where."""

from dataclasses import replace

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from commsim.ir.validate import validate
from tests.schedule_gen import schedules


def _per_rank(schedule: Schedule) -> list[Program]:
    return [schedule.program_of(r) for r in range(schedule.world_size)]


def _checks(schedule: Schedule) -> set[str]:
    return {f.check for f in validate(schedule)}


def _with_step(schedule: Schedule, rank: int, step: list[O.Op]) -> Schedule:
    programs = _per_rank(schedule)
    programs[rank] = replace(programs[rank], step=tuple(step))
    return Schedule.from_rank_programs(programs, schedule.meta)


@settings(max_examples=60, deadline=None)
@given(schedules(min_world=2), st.data())
def test_swapped_collective_order_is_found(schedule, data):
    rank = data.draw(st.integers(0, schedule.world_size - 1))
    step = list(schedule.program_of(rank).step)
    colls = [i for i, op in enumerate(step) if isinstance(op, O.Collective) and len(op.group) > 1]
    pairs = [(i, j) for i in colls for j in colls if i < j and step[i].group == step[j].group
             and (step[i].kind, step[i].size_bytes, step[i].dtype, step[i].reduce_op, step[i].root)
             != (step[j].kind, step[j].size_bytes, step[j].dtype, step[j].reduce_op, step[j].root)]
    assume(pairs)
    i, j = data.draw(st.sampled_from(pairs))
    a, b = step[i], step[j]
    # Swap what is issued at the two positions, keeping ids and deps in place.
    step[i] = replace(b, id=a.id, deps=a.deps, stream=a.stream, buffers=a.buffers)
    step[j] = replace(a, id=b.id, deps=b.deps, stream=b.stream, buffers=b.buffers)
    bad = _with_step(schedule, rank, step)
    findings = validate(bad)
    assert findings and findings[0].check == "collective order"
    assert findings[0].section == "step"


@settings(max_examples=60, deadline=None)
@given(schedules(), st.data())
def test_missing_dependency_target_is_found(schedule, data):
    rank = data.draw(st.integers(0, schedule.world_size - 1))
    step = list(schedule.program_of(rank).step)
    devices = [i for i, op in enumerate(step) if O.is_device_op(op)]
    assume(devices)
    i = data.draw(st.sampled_from(devices))
    step[i] = replace(step[i], deps=step[i].deps + (O.OpId(10**9),))
    findings = validate(_with_step(schedule, rank, step))
    assert any(f.check == "dependency" and "10000" in f.message and "does not exist" in f.message and f.op_index == i
               for f in findings)


@settings(max_examples=60, deadline=None)
@given(schedules(), st.data())
def test_cycle_is_found(schedule, data):
    rank = data.draw(st.integers(0, schedule.world_size - 1))
    step = list(schedule.program_of(rank).step)
    devices = [i for i, op in enumerate(step) if O.is_device_op(op)]
    assume(len(devices) >= 2)
    i, j = sorted(data.draw(st.lists(st.sampled_from(devices), min_size=2, max_size=2, unique=True)))
    step[i] = replace(step[i], deps=step[i].deps + (step[j].id,))
    step[j] = replace(step[j], deps=step[j].deps + (step[i].id,))
    findings = validate(_with_step(schedule, rank, step))
    assert findings[0].check == "dependency" and "cycle" in findings[0].message


@settings(max_examples=60, deadline=None)
@given(schedules(), st.data())
def test_double_free_is_found(schedule, data):
    rank = data.draw(st.integers(0, schedule.world_size - 1))
    step = list(schedule.program_of(rank).step)
    frees = [i for i, op in enumerate(step) if isinstance(op, O.Free)]
    i = data.draw(st.sampled_from(frees))
    step.insert(i + 1, replace(step[i], id=O.OpId(10**6)))
    findings = validate(_with_step(schedule, rank, step))
    assert [f.check for f in findings] == ["buffer"]
    assert findings[0].op_index == i + 1 and "twice" in findings[0].message


@settings(max_examples=60, deadline=None)
@given(schedules(), st.data())
def test_use_before_alloc_is_found(schedule, data):
    rank = data.draw(st.integers(0, schedule.world_size - 1))
    step = list(schedule.program_of(rank).step)
    allocs = [op for op in step if isinstance(op, O.Alloc)]
    buf = data.draw(st.sampled_from(allocs)).buffer
    use = O.Compute(O.OpId(10**6), "compute", "early", O.ComputeKind.ELEMENTWISE, 1, 1, 1, buffers=(buf,))
    step.insert(0, use)
    findings = validate(_with_step(schedule, rank, step))
    assert [(f.check, f.op_index) for f in findings] == [("buffer", 0)]
    assert "before it is allocated" in findings[0].message


def test_two_ranks_with_swapped_collectives_name_rank_and_op(tiny_schedule):
    ag = O.Collective(O.OpId(5), "allgather", "a", O.CollectiveKind.ALL_GATHER, 64, O.DType.BF16, (0, 1))
    rs = O.Collective(O.OpId(6), "reduce", "b", O.CollectiveKind.REDUCE_SCATTER, 128, O.DType.BF16, (0, 1),
                      reduce_op=O.ReduceOp.SUM)
    p0 = Program((), (ag, rs))
    p1 = Program((), (replace(rs, id=O.OpId(5)), replace(ag, id=O.OpId(6))))
    findings = validate(Schedule.from_rank_programs([p0, p1]))
    assert [f.line() for f in findings] == [
        "rank 1, step op 0: collective order: collective #0 of group (0,1) differs from rank 0's (step op 0 "
        "`5 collective stream=allgather kind=all_gather size_bytes=64 dtype=bf16 group=0-1 label=\"a\"`): a real run "
        "would hang or mix data; rank 1 issues `5 collective stream=reduce kind=reduce_scatter size_bytes=128 "
        "dtype=bf16 group=0-1 reduce_op=sum label=\"b\"`"
    ]


def test_extra_collective_on_one_rank():
    ag = O.Collective(O.OpId(1), "c", "a", O.CollectiveKind.ALL_REDUCE, 8, O.DType.FP64, (0, 1),
                      reduce_op=O.ReduceOp.SUM)
    findings = validate(Schedule.from_rank_programs([Program((), (ag,)), Program((), (ag, replace(ag, id=O.OpId(2))))]))
    assert len(findings) == 1
    assert (findings[0].rank, findings[0].op_index) == (1, 1)
    assert "rank 1 issues 2 collectives on group (0,1), rank 0 issues 1" in findings[0].message


def test_structure_errors():
    w = O.Alloc(O.OpId(1), "compute", "", "w", 0)
    t = O.Alloc(O.OpId(7), "compute", "", "t", 8, touch_bytes=9)
    g = O.Compute(O.OpId(2), "compute", "", O.ComputeKind.GEMM, 5, 0, 0, O.GemmShape(1, 1, 1))
    c = O.Collective(O.OpId(3), "c", "", O.CollectiveKind.ALL_GATHER, 6, O.DType.BF16, (0, 1))
    c2 = O.Collective(O.OpId(4), "c", "", O.CollectiveKind.ALL_REDUCE, 8, O.DType.BF16, (1,))
    s = O.HostSync(O.OpId(5), "", O.SyncScope.STREAM)
    fr = O.Free(O.OpId(6), "compute", "", "w")
    ft = O.Free(O.OpId(8), "compute", "", "t")
    findings = validate(Schedule.uniform(2, Program((), (w, g, c, c2, s, fr, t, ft))))
    assert [(f.check, f.op_index, f.message) for f in findings] == [
        ("size", 0, "size_bytes must be positive, got 0"),
        ("structure", 1, "flops 5 differ from its gemm shape's 2"),
        ("collective", 2, "size_bytes 6 does not split into 2 equal shards"),
        ("collective", 3, "all_reduce needs a reduce_op"),
        ("structure", 4, "a stream-scoped sync names its stream and no deps"),
        ("size", 6, "touch_bytes must be within 0..size_bytes (8), got 9"),
        ("collective", 3, "rank 0 issues a collective of a group it is not in"),
    ]


def test_leak_and_forward_wait():
    a = O.Alloc(O.OpId(1), "compute", "", "x", 512)
    wait = O.HostSync(O.OpId(2), "", O.SyncScope.OPS, deps=(O.OpId(3),))
    k = O.Compute(O.OpId(3), "compute", "", O.ComputeKind.ELEMENTWISE, 1, 1, 1, buffers=("x",))
    findings = validate(Schedule.uniform(1, Program((), (a, wait, k))))
    assert [(f.check, f.op_index) for f in findings] == [("dependency", 1), ("buffer", None)]
    assert "issued later (step op 2)" in findings[0].message
    assert "never freed" in findings[1].message


def test_dangling_dependency_names_the_op_by_its_id():
    # ids are not indices: a setup comes first and ids start at 10, as in generated schedules
    a = O.Alloc(O.OpId(10), "compute", "", "x", 512)
    k1 = O.Compute(O.OpId(20), "compute", "", O.ComputeKind.ELEMENTWISE, 1, 1, 1, buffers=("x",))
    k2 = O.Compute(O.OpId(21), "compute", "", O.ComputeKind.ELEMENTWISE, 1, 1, 1, deps=(O.OpId(99),), buffers=("x",))
    k3 = O.Compute(O.OpId(22), "compute", "", O.ComputeKind.ELEMENTWISE, 1, 1, 1, deps=(O.OpId(22),))
    findings = validate(Schedule.uniform(1, Program((a,), (k1, k2, k3))))
    assert [f.line() for f in findings] == [
        "rank 0, step op 1: dependency: op 21 depends on op 99, which does not exist "
        "`21 compute stream=compute kind=elementwise flops=1 bytes_read=1 bytes_written=1 deps=99 buffers=x label=\"\"`",
        "rank 0, step op 2: dependency: op 22 depends on itself "
        "`22 compute stream=compute kind=elementwise flops=1 bytes_read=1 bytes_written=1 deps=22 label=\"\"`",
    ]


def test_stated_reuse_must_be_within_the_op_s_traffic():
    def findings(reuse, ws):
        op = O.Compute(O.OpId(1), "compute", "adam", O.ComputeKind.OPTIMIZER, 8, 100, 60, reuse_bytes=reuse,
                       working_set_bytes=ws)
        return [(f.check, f.message) for f in validate(Schedule.from_rank_programs([Program((), (op,))]))]

    assert findings(0, 0) == findings(160, 10**9) == []
    assert findings(161, 0) == [("size", "reuse_bytes must be within 0..bytes_read + bytes_written (160), got 161")]
    assert findings(-1, 0) == [("size", "reuse_bytes must be within 0..bytes_read + bytes_written (160), got -1")]
    assert findings(40, -8) == [("size", "working_set_bytes must not be negative, got -8")]
    in_place = O.Compute(O.OpId(1), "compute", "adam", O.ComputeKind.OPTIMIZER, 8, 100, 60, in_place_bytes=61)
    assert [(f.check, f.message) for f in validate(Schedule.from_rank_programs([Program((), (in_place,))]))] == [
        ("size", "in_place_bytes must be within 0..bytes_written (60), got 61")]
