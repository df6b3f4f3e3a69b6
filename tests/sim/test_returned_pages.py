"""Reported host pages on a VM that reports free memory (sim.returned_pages): the pool's
rule, and a simulated step that pays for large blocks on pages freed long ago."""

from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from commsim.hardware.platform import CPU
from commsim.sim.engine import SimConfig, Simulator
from commsim.sim.returned_pages import ReturnedPages
from tests.sim.fixed_costs import FixedCosts

MIB = 1 << 20


def test_a_return_is_fast_until_2_4_periods_after_its_free_and_reported_from_then():
    pool = ReturnedPages(period_ns=2_000)
    assert [pool.reported_share(a) for a in (0, 2_000, 4_000, 4_799, 4_800, 9_000)] == \
        [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_newest_returns_serve_first_and_the_rest_is_reported_memory():
    pool = ReturnedPages(period_ns=2_000)
    pool.returned(0, 100)
    pool.returned(4_000, 50)
    # at 4_500: the 50 bytes 500 old (fast), then 30 of the first return, 4_500 old: fast
    assert pool.take(4_500, 80) == 0
    assert pool.held_bytes() == 70
    # at 5_000 the first return's 70 bytes are 2.5 periods old (forgotten: reported);
    # a new return of 20 serves first, fast, and the other 20 bytes are reported
    pool.returned(4_600, 20)
    assert pool.take(5_000, 40) == 20 and pool.held_bytes() == 0


def test_an_old_return_is_forgotten_and_partial_takes_keep_their_time():
    pool = ReturnedPages(period_ns=2_000)
    pool.returned(100, 100)
    assert pool.take(1_000, 40) == 0
    assert pool.held_bytes() == 60
    assert pool.take(4_899, 60) == 0  # 4_799 old: just under 2.4 periods
    assert pool.take(4_899, 10) == 10  # nothing left: reported memory
    pool.returned(0, 10)
    assert pool.take(4_800, 5) == 5 and pool.held_bytes() == 0  # 2.4 periods old: forgotten, reported


def test_clone_moves_times_to_another_clock():
    pool = ReturnedPages(period_ns=2_000)
    pool.returned(5_000, 10)
    moved = pool.clone(-5_000)
    assert moved.stack == [[10, 0]] and pool.stack == [[10, 5_000]]
    assert moved.take(1_000, 10) == 0


def _program(gap_flops: int) -> Program:
    """Free a 64 MiB block, compute for ``gap_flops`` ns, then allocate 64 MiB again."""
    ops = [O.Alloc(O.OpId(1), "compute", "a", "a", 64 * MIB, phase=O.Phase.OPTIMIZER),
           O.Free(O.OpId(2), "compute", "free a", "a"),
           O.Compute(O.OpId(3), "compute", "work", O.ComputeKind.ELEMENTWISE, gap_flops, 0, 0),
           O.Alloc(O.OpId(4), "compute", "b", "b", 64 * MIB, phase=O.Phase.OPTIMIZER),
           O.Free(O.OpId(5), "compute", "free b", "b")]
    return Program((), tuple(ops))


def _step_ns(gap_flops: int, reported) -> tuple[int, dict]:
    costs = FixedCosts()
    costs.platform = CPU
    costs.reported = reported
    sched = Schedule.uniform(1, _program(gap_flops))
    res = Simulator(sched, costs, SimConfig(warmup_steps=1, jitter=0.0)).run()
    return res.step_time_ns, res.ranks[0].reported_page_bytes


def test_a_block_on_pages_freed_long_ago_pays_the_extra():
    extra = 0.5  # ns a byte
    quick, quick_pages = _step_ns(1_000, (10_000_000, extra))
    slow, slow_pages = _step_ns(30_000_000, (10_000_000, extra))
    plain_quick, _ = _step_ns(1_000, None)
    plain_slow, _ = _step_ns(30_000_000, None)
    # b reuses a's pages 1 us after their free: fast; 30 ms after (three 10 ms periods):
    # reported. a reuses the pages b freed just before, at the end of the step before.
    assert quick == plain_quick and quick_pages == {}
    assert slow_pages == {"optimizer": 64 * MIB}
    assert slow - plain_slow == int(64 * MIB * extra)


def test_only_written_pages_go_back():
    """A large block of which only part was written had pages only there: its free
    returns those, and a later block beyond them gets reported pages."""
    costs = FixedCosts()
    costs.platform = CPU
    costs.reported = (10_000_000, 1.0)
    ops = [O.Alloc(O.OpId(1), "compute", "a", "a", 256 * MIB, touch_bytes=32 * MIB, phase=O.Phase.BACKWARD),
           O.Free(O.OpId(2), "compute", "free a", "a"),
           O.Alloc(O.OpId(3), "compute", "b", "b", 64 * MIB, phase=O.Phase.BACKWARD),
           O.Free(O.OpId(4), "compute", "free b", "b")]
    sched = Schedule.uniform(1, Program((), tuple(ops)))
    res = Simulator(sched, costs, SimConfig(warmup_steps=0, jitter=0.0)).run()
    # nothing given back before a: its 32 written MiB are reported memory; b takes the
    # 32 MiB a gave back and 32 more (a's 224 unwritten MiB never had pages)
    assert res.ranks[0].reported_page_bytes == {"bwd": 64 * MIB}


def _gloo_step(kind: O.CollectiveKind, size: int, reported, block_before: bool = False, block_after: bool = False):
    """Two CPU ranks: optionally a 64 MiB block freed right before, one collective of
    ``size`` bytes, optionally a 64 MiB block right after."""
    costs = FixedCosts(gpus_per_node=2, link_bytes_per_s=1e12)
    costs.platform = CPU
    costs.reported = reported
    ops = []
    if block_before:
        ops += [O.Alloc(O.OpId(1), "compute", "a", "a", 64 * MIB, phase=O.Phase.BACKWARD),
                O.Free(O.OpId(2), "compute", "free a", "a")]
    red = O.ReduceOp.SUM if kind is not O.CollectiveKind.ALL_GATHER else None
    ops.append(O.Collective(O.OpId(3), "comm", "c", kind, size, O.DType.FP32, (0, 1), reduce_op=red,
                            phase=O.Phase.BACKWARD))
    if block_after:
        ops += [O.HostSync(O.OpId(4), "wait c", O.SyncScope.OPS, deps=(O.OpId(3),)),
                O.Alloc(O.OpId(5), "compute", "b", "b", 64 * MIB, phase=O.Phase.BACKWARD),
                O.Free(O.OpId(6), "compute", "free b", "b")]
    res = Simulator(Schedule.uniform(2, Program((), tuple(ops))), costs, SimConfig(warmup_steps=0, jitter=0.0)).run()
    return res.step_time_ns, res.ranks[0]


def test_gloos_whole_buffer_temporaries_take_and_give_back_large_blocks_pages():
    extra = 0.5  # ns a byte over a fast page
    rs = O.CollectiveKind.REDUCE_SCATTER
    plain, _ = _gloo_step(rs, 64 * MIB, None)
    # nothing returned before: the reduce-scatter's clone of its 64 MiB input is all
    # reported memory (the caller's thread writes it before its part goes out), and it
    # counts as the phase's fresh pages
    cold, r = _gloo_step(rs, 64 * MIB, (10_000_000, extra))
    assert cold - plain == int(64 * MIB * extra)
    assert r.reported_page_bytes == {"bwd": 64 * MIB} and r.fresh_page_bytes == {"bwd": 64 * MIB}
    # on pages a block gave back just before: fast (the block itself, first, was not)
    t, r = _gloo_step(rs, 64 * MIB, (10_000_000, extra), block_before=True)
    assert r.reported_page_bytes == {"bwd": 64 * MIB}
    assert t - _gloo_step(rs, 64 * MIB, None, block_before=True)[0] == int(64 * MIB * extra)
    # the all-gather's temporary of its output alike; the clone is given back when the
    # call ends, so a block right after it takes those pages, fast
    _, r = _gloo_step(O.CollectiveKind.ALL_GATHER, 64 * MIB, (10_000_000, extra), block_after=True)
    assert r.reported_page_bytes == {"bwd": 64 * MIB}
    # an all-reduce works in place, and a buffer below glibc's mmap ceiling stays in the heap
    for kind, size in ((O.CollectiveKind.ALL_REDUCE, 64 * MIB), (rs, 16 * MIB)):
        t, r = _gloo_step(kind, size, (10_000_000, extra))
        assert t == _gloo_step(kind, size, None)[0] and r.reported_page_bytes == {}
