"""Full garbage collections as per-rank host stalls: a rank's clock pauses where its work
crosses its period, symmetric mode adds the expected pause of the latest rank, and the
two modes agree."""

import random
import statistics
from dataclasses import replace

import pytest

from commsim.sim.engine import SimConfig, Simulator
from commsim.sim.host_gc import (ExpectedStops, GcClock, HostGc, aligned_by_default, expected_pause_ns,
                                 parse_host_gc)
from tests.sim.fixed_costs import FixedCosts
from tests.sim.test_lateness import _cycles


def test_expected_pause_of_the_latest_rank():
    gc = HostGc(period_steps=10, pause_ns=1_000_000)
    # a tenth of a period: each rank passes with probability 0.1
    assert expected_pause_ns(gc, 100, 100, 1) == 100_000
    assert expected_pause_ns(gc, 100, 100, 16) == round(1e6 * (1 - 0.9 ** 16))
    # two and a half periods: two passes for sure, a third with probability 0.5
    assert expected_pause_ns(gc, 2_500, 100, 4) == round(1e6 * (2 + 1 - 0.5 ** 4))
    assert expected_pause_ns(gc, 0, 100, 64) == 0 and expected_pause_ns(gc, 100, 0, 64) == 0
    assert expected_pause_ns(HostGc(10, 0), 100, 100, 64) == 0


def test_a_ranks_clock_pauses_once_a_period_from_its_phase():
    rng = random.Random(5)
    phase = random.Random(5).uniform(0.0, 3 * 1000)
    clock = GcClock(HostGc(3, 7), 1000, rng)  # a pass every 3000 ns of work
    pauses = [clock.advance(100) for _ in range(120)]  # 12000 ns of work
    hits = [i for i, p in enumerate(pauses) if p]
    assert all(pauses[i] == 7 for i in hits) and len(hits) == 4
    assert hits[0] == int(phase // 100) - (phase % 100 == 0)  # the op whose work crosses the phase
    assert [b - a for a, b in zip(hits, hits[1:])] == [30, 30, 30]
    assert GcClock(HostGc(3, 7), 0, rng).advance(10**9) == 0  # no host work: no clock


def test_expected_stops_are_paid_whole():
    # one rank, a stop every 1000 ns of work; a step of 25 ops of 100 ns: 2.5 stops a step
    stops = ExpectedStops(HostGc(period_steps=0.4, pause_ns=1000), 2500, 1, [100] * 25)
    assert stops.per_step == pytest.approx(2.5)
    paid = [stops.advance(100) for _ in range(25)]
    # the half stop at the first op, then a whole one after each 1000 ns of work
    assert paid == [500] + [0] * 8 + [1000] + [0] * 9 + [1000] + [0] * 5
    stops.start_step()
    assert (stops.owed, stops.fraction_due) == (0.0, 0.5)
    assert ExpectedStops(HostGc(10, 0), 100, 64, [100]).advance(10**6) == 0


def test_parse_and_refuse():
    assert parse_host_gc("30:200") == HostGc(30.0, 200_000_000)
    assert parse_host_gc("30:200:aligned") == HostGc(30.0, 200_000_000)
    assert parse_host_gc("30:200:independent") == HostGc(30.0, 200_000_000, aligned=False)
    # without the third part, the strategy's default: ZeRO-2's ranks drift apart
    assert parse_host_gc("30:200", aligned_by_default("zero2")) == HostGc(30.0, 200_000_000, aligned=False)
    assert parse_host_gc("30:200:aligned", aligned_by_default("zero2")).aligned
    assert [aligned_by_default(s) for s in ("zero0", "zero1", "zero2", "zero3", "fsdp2")] == \
        [True, True, False, True, True]
    assert parse_host_gc("2.5:0.5") == HostGc(2.5, 500_000)
    for bad in ("30", "0:200", "-1:5", "30:-1", "x:1", "30:y", "nan:5", "30:200:sometimes", "1:2:3:4"):
        with pytest.raises(ValueError, match="PERIOD_STEPS:PAUSE_MS"):
            parse_host_gc(bad)


def test_symmetric_expected_pause_agrees_with_every_rank_drawn():
    # 30 cycles of four 1 ms host ops, the ranks waiting for one another every cycle; a
    # 2 ms pass every 4 steps of host work: each op is 1/480 of a period
    sched = _cycles(16)
    gc = HostGc(period_steps=4, pause_ns=2_000_000, aligned=False)
    quiet = Simulator(sched, FixedCosts(), SimConfig(mode="symmetric")).run().step_time_ns
    sym = Simulator(sched, FixedCosts(), SimConfig(mode="symmetric", host_gc=gc)).run()
    drawn = [Simulator(sched, FixedCosts(), SimConfig(mode="per-rank", host_gc=gc, jitter=0.0, seed=s)).run()
             for s in range(100)]
    # the job's expected stops: 120 ops x (1 - (1 - 1/480)^16) = 3.94 (each op rounded to
    # whole ns of pause), 0.94 of one at the first op, then three whole ones
    expected = 120 * round(2e6 * (1 - (1 - 1 / 480) ** 16))
    assert sym.ranks[0].gc_pause_ns == pytest.approx(expected, abs=1) and sym.host_gc == gc
    assert sym.step_time_ns - quiet == pytest.approx(expected, abs=1)
    # drawn: each cycle pays one pause if any of the 16 ranks passed in it (1/120 each),
    # 4% less than the sum over its four ops: two passes in one cycle overlap
    drawn_extra = statistics.fmean(r.step_time_ns for r in drawn) - quiet  # its standard error: about 4%
    assert drawn_extra == pytest.approx(30 * 2e6 * (1 - (1 - 1 / 120) ** 16), rel=0.1)
    assert drawn_extra == pytest.approx(sym.step_time_ns - quiet, rel=0.15)
    # every rank's own passes: 16 ranks x 2 ms / 4 steps on average
    assert statistics.fmean(sum(rr.gc_pause_ns for rr in r.ranks.values()) for r in drawn) == pytest.approx(
        16 * 2e6 / 4, rel=0.1)
    # one rank alone pays its own passes: on average 2 ms every 4 steps
    solo = _cycles(1)
    one = Simulator(solo, FixedCosts(), SimConfig(mode="symmetric", host_gc=gc)).run().step_time_ns
    base = Simulator(solo, FixedCosts(), SimConfig(mode="symmetric")).run().step_time_ns
    assert one - base == pytest.approx(0.5e6, rel=0.01)


def test_aligned_passes_cost_the_job_one_ranks_passes():
    # the same 16 ranks, their passes aligned (the default): every rank stops at the same
    # op, so the job pays one rank's passes, 2 ms every 4 steps, as one rank alone does
    sched = _cycles(16)
    gc = HostGc(period_steps=4, pause_ns=2_000_000)
    assert gc.aligned and gc.passing_ranks(16) == 1
    quiet = Simulator(sched, FixedCosts(), SimConfig(mode="symmetric")).run().step_time_ns
    sym = Simulator(sched, FixedCosts(), SimConfig(mode="symmetric", host_gc=gc)).run()
    assert sym.step_time_ns - quiet == pytest.approx(0.5e6, rel=0.01)
    drawn = [Simulator(sched, FixedCosts(), SimConfig(mode="per-rank", host_gc=gc, jitter=0.0, seed=s)).run()
             for s in range(100)]
    for r in drawn:  # one phase for all: every rank's own pauses the same
        assert len({rr.gc_pause_ns for rr in r.ranks.values()}) == 1
    # a quarter of the seeds draw the pass into the measured step: 2 ms then, else 0
    assert {r.step_time_ns - quiet for r in drawn} == {0, 2_000_000}
    assert statistics.fmean(r.step_time_ns for r in drawn) - quiet == pytest.approx(0.5e6, rel=0.35)
    independent = Simulator(sched, FixedCosts(), SimConfig(mode="symmetric", host_gc=replace(gc, aligned=False)))
    assert independent.run().step_time_ns - quiet > 6 * (sym.step_time_ns - quiet)


def test_without_host_gc_nothing_changes():
    sched = _cycles(4, cycles=3)
    a = Simulator(sched, FixedCosts(), SimConfig(mode="symmetric")).run()
    b = Simulator(sched, FixedCosts(), SimConfig(mode="per-rank", jitter=0.0)).run()
    assert a.step_time_ns == b.step_time_ns == 3 * 4_000_000 + 3 * 16
