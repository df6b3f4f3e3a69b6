"""How calibrate times host work on CPUs: in wall time, the node's ranks taking turns a core each."""

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

import runtime.calibrate_host as ch  # noqa: E402


def _measurer(rank: int, ranks_per_node: int, caching_allocator: bool = False):
    m = ch.HostMeasurements()
    m.rank, m.ranks_per_node = rank, ranks_per_node
    m.platform = SimpleNamespace(caching_allocator=caching_allocator)
    return m


@pytest.fixture
def barriers(monkeypatch):
    calls = []
    monkeypatch.setattr(ch.dist, "barrier", lambda: calls.append(1))
    return calls


def test_ranks_take_turns_a_core_each(monkeypatch, barriers):
    """Four ranks a node on two cores: two turns, ranks 0-1 measure in the first and 2-3
    in the second; every rank passes both barriers (the world stays in step); the next
    node's ranks follow their own local ranks."""
    monkeypatch.setattr(ch, "cpu_cores", lambda: 2)
    turns = {r: list(_measurer(r, 4)._turns()) for r in range(8)}
    assert turns[0] == turns[1] == turns[4] == turns[5] == [True, False]
    assert turns[2] == turns[3] == turns[6] == turns[7] == [False, True]
    assert len(barriers) == 8 * 2


def test_a_core_per_rank_measures_at_once(monkeypatch, barriers):
    monkeypatch.setattr(ch, "cpu_cores", lambda: 2)
    assert list(_measurer(1, 2)._turns()) == [True]
    assert list(_measurer(2, 3)._turns()) == [False, True]  # three ranks, two cores
    monkeypatch.setattr(ch, "cpu_cores", lambda: 1)
    assert [list(_measurer(r, 2, caching_allocator=True)._turns()) for r in (0, 1)] == [[True], [True]]  # GPUs


def test_host_work_is_timed_in_wall_time(monkeypatch):
    """Not the thread's CPU time, which misses a fault's hypervisor share; on CPUs the
    reading is divided by the core share (two cores, four ranks: a half)."""
    monkeypatch.setattr(ch, "cpu_cores", lambda: 2)
    clock, share = _measurer(0, 4)._host_work_clock()
    assert clock is time.perf_counter and share == 0.5
    clock, share = _measurer(0, 2, caching_allocator=True)._host_work_clock()
    assert clock is time.perf_counter and share == 1.0
