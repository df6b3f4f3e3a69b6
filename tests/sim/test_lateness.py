"""Host-time jitter across ranks: per-rank mode draws every rank's host ops, symmetric
mode adds the expected lateness of each collective's slowest member; they agree."""

import statistics
from math import pi, sqrt

import pytest

from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from commsim.sim.engine import SimConfig, Simulator
from commsim.sim.lateness import HostLateness, expected_max_of_normals
from tests.sim.fixed_costs import FixedCosts


def test_expected_maximum_of_normals():
    assert expected_max_of_normals(1) == 0.0
    assert expected_max_of_normals(2) == pytest.approx(1 / sqrt(pi), abs=1e-6)
    assert expected_max_of_normals(3) == pytest.approx(1.5 / sqrt(pi), abs=1e-6)
    # tables of normal order statistics (Harter 1961): 16 -> 1.7660, 100 -> 2.5076
    assert expected_max_of_normals(16) == pytest.approx(1.7660, abs=1e-3)
    assert expected_max_of_normals(100) == pytest.approx(2.5076, abs=1e-3)


def test_lateness_accumulates_until_the_host_waits():
    late = HostLateness(0.2)
    for _ in range(4):
        late.add(1_000_000)  # four 1 ms ops: sd 0.2 ms each, 0.4 ms together
    assert late.slowest_of(2) == int(400_000 / sqrt(pi))
    late.waited()
    assert late.slowest_of(64) == 0


def _cycles(ranks: int, cycles: int = 30) -> Schedule:
    """Every rank: four 1 ms host ops, a tiny all-reduce over all ranks, the host waiting
    for it: a step that synchronises every cycle."""
    ops, i = [], 1
    for c in range(cycles):
        for k in range(4):
            ops.append(O.HostWork(O.OpId(i), f"hook {c}.{k}", O.HostKind.PYTHON, 1_000_000))
            i += 1
        ops.append(O.Collective(O.OpId(i), "comm", f"ar{c}", O.CollectiveKind.ALL_REDUCE, 16, O.DType.FP32,
                                tuple(range(ranks)), reduce_op=O.ReduceOp.SUM))
        ops.append(O.HostSync(O.OpId(i + 1), f"wait {c}", O.SyncScope.OPS, deps=(O.OpId(i),)))
        i += 2
    return Schedule.uniform(ranks, Program((), tuple(ops)))


def test_symmetric_lateness_agrees_with_every_rank_drawn():
    sched = _cycles(16)
    quiet = Simulator(sched, FixedCosts(), SimConfig(mode="symmetric", host_jitter=0.0)).run().step_time_ns
    sym = Simulator(sched, FixedCosts(), SimConfig(mode="symmetric", host_jitter=0.2)).run()
    drawn = [Simulator(sched, FixedCosts(), SimConfig(mode="per-rank", host_jitter=0.2, jitter=0.0, seed=s)).run()
             .step_time_ns for s in range(6)]
    # each cycle waits for the latest of 16 hosts: 0.4 ms x E[max of 16] = 0.71 ms late
    assert sym.step_time_ns - quiet == pytest.approx(30 * 0.4e6 * 1.7660, rel=0.01)
    assert statistics.fmean(drawn) == pytest.approx(sym.step_time_ns, rel=0.02)
    # the waiting shows as stragglers' time on rank 0
    waits = [r.wait_peers_ns for r in sym.ranks[0].records if isinstance(r.op, O.Collective)]
    assert min(waits) > 0 and sum(waits) == pytest.approx(sym.step_time_ns - quiet, rel=0.01)


def test_no_jitter_no_change():
    sched = _cycles(4, cycles=3)
    a = Simulator(sched, FixedCosts(), SimConfig(mode="symmetric")).run()
    assert a.step_time_ns == 3 * 4_000_000 + 3 * 16  # four 1 ms ops and a 16-byte collective a cycle
