"""Schedule.with_host_time_scaled: a slower (or faster) host CPU as a schedule transform."""

import pytest

from commsim.api import check_host_scale
from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from commsim.ir.schedule import Program, Schedule, ScheduleMeta


def _schedule() -> Schedule:
    step = (
        O.HostWork(O.OpId(1), "hook", O.HostKind.MODULE_HOOK, 1_000),
        O.HostWork(O.OpId(2), "launch", O.HostKind.LAUNCH, 333),
        O.Compute(O.OpId(3), "compute", "fwd", O.ComputeKind.GEMM, 1024, 10, 10, O.GemmShape(8, 8, 8)),
        O.HostSync(O.OpId(4), "sync", O.SyncScope.DEVICE),
        O.HostWork(O.OpId(5), "cpu adam", O.HostKind.OPTIMIZER, 7_000),
        O.HostWork(O.OpId(6), "debug string", O.HostKind.DEBUG, 5),
    )
    a = Program(setup=(O.Alloc(O.OpId(0), "compute", "init w", "w", 4096),), step=step)
    b = Program(setup=(), step=step[:2])
    return Schedule.from_rank_programs([a, b, a], ScheduleMeta(model="m", host_costs="a table"))


def test_every_host_routine_but_the_host_optimizer_takes_the_factor_times_as_long():
    s = _schedule()
    t = s.with_host_time_scaled(1.5)
    durations = [[op.duration_ns if isinstance(op, O.HostWork) else None for op in p.step] for p in t.programs]
    # 333 x 1.5 = 499.5 and 5 x 1.5 = 7.5 round to the nearest even nanosecond
    assert durations == [[1_500, 500, None, None, 7_000, 8], [1_500, 500]]
    # nothing else changes: the other ops, the setup, the ranks' programs, the meta
    for p, q in zip(s.programs, t.programs):
        assert p.setup == q.setup
        assert [op for op in p.step if not isinstance(op, O.HostWork)] == \
               [op for op in q.step if not isinstance(op, O.HostWork)]
        assert [op.id for op in p.step] == [op.id for op in q.step]
    assert (t.rank_program, t.meta, t.world_size) == (s.rank_program, s.meta, s.world_size)


def test_a_factor_of_one_is_the_schedule_itself_and_faster_hosts_shorten():
    s = _schedule()
    assert s.with_host_time_scaled(1) is s
    assert [op.duration_ns for op in s.with_host_time_scaled(0.5).programs[1].step] == [500, 166]


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "2"])
def test_the_scale_must_be_a_finite_positive_number(bad):
    with pytest.raises(CommsimInputError, match=r"^--host-scale .*: must be a number > 0, how many times as long"):
        check_host_scale(bad)
