"""bench/machine_load.py: what else the machine ran beside a validation run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import machine_load as ml  # noqa: E402

STAT = """cpu  1290589 45950 429651 496113 2902 0 26771 26365 0 0
cpu0 611126 23833 206967 290106 461 0 13094 13161 0 0
cpu1 679462 22116 222683 206007 2441 0 13676 13203 0 0
intr 1 2 3
"""


def test_the_aggregate_line_is_read_by_its_columns():
    t = ml.parse_proc_stat(STAT)
    assert t == ml.CpuTicks(busy=1290589 + 45950 + 429651 + 0 + 26771, idle=496113 + 2902, steal=26365)


def test_an_old_kernel_without_a_steal_column_reads_zero_steal():
    assert ml.parse_proc_stat("cpu  10 0 5 100 0 0 1\n") == ml.CpuTicks(busy=16, idle=100, steal=0)


def test_a_file_without_the_cpu_line_is_an_error():
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        ml.parse_proc_stat("cpu0 1 2 3 4\n")


def snap(busy: int, idle: int, steal: int, own_s: float) -> ml.Snapshot:
    return ml.Snapshot(ml.CpuTicks(busy, idle, steal), own_s)


def test_others_are_the_busy_ticks_the_run_did_not_use():
    # 2 CPUs x 10 s at 100 ticks a second: 2000 ticks; the run used 10 s of CPU (1000
    # ticks) of the 1500 busy ones, the hypervisor took 100
    a, b = snap(0, 0, 0, 5.0), snap(1500, 400, 100, 15.0)
    assert ml.between(a, b, hz=100) == ml.MachineLoad(others=0.25, steal=0.05)


def test_a_run_that_accounts_for_more_than_the_busy_ticks_leaves_no_others():
    # rusage and /proc/stat round differently: never a negative share
    assert ml.between(snap(0, 0, 0, 0.0), snap(100, 100, 0, 1.5), hz=100) == ml.MachineLoad(others=0.0, steal=0.0)


def test_nothing_is_reported_without_counters_or_time():
    assert ml.between(None, snap(1, 1, 0, 0.0)) is None
    assert ml.between(snap(5, 5, 0, 0.0), snap(5, 5, 0, 0.0), hz=100) is None


def test_the_row_line_lists_runs_then_calibrations():
    line = ml.load_line([ml.MachineLoad(0.02, 0.0), None], [ml.MachineLoad(0.351, 0.012)])
    assert line == "    machine beside (others/steal): runs 2%/0%, ?; calibrations 35%/1%"
    assert ml.load_line([None], []) is None


def test_memory_reported_to_the_host_is_read_where_the_kernel_reports(tmp_path):
    a = ml.Snapshot(ml.CpuTicks(0, 0, 0), 0.0, reported_kib=1000)
    b = ml.Snapshot(ml.CpuTicks(100, 100, 0), 1.0, reported_kib=1000 + 12 * 1024)
    load = ml.between(a, b, hz=100)
    assert load == ml.MachineLoad(others=0.0, steal=0.0, reported_mib=12.0)
    assert ml.load_line([load], [ml.MachineLoad(0.351, 0.012, 0.4)]) == (
        "    machine beside (others/steal/freed memory reported to the host): runs 0%/0%/12 MiB; "
        "calibrations 35%/1%/0 MiB")
    # one side without the counter: nothing said about it
    assert ml.between(a, snap(100, 100, 0, 1.0), hz=100).reported_mib is None
    stat = tmp_path / "stat"
    stat.write_text("cpu 1 0 1 5 0 0 0 0\n")
    counter = tmp_path / "reported_kib"
    counter.write_text("4096\n")
    assert ml.snapshot(stat, counter).reported_kib == 4096
    assert ml.snapshot(stat, tmp_path / "absent").reported_kib is None


def test_this_machine_is_read_between_two_snapshots():
    a = ml.snapshot()
    if a is None:
        pytest.skip("no /proc/stat")
    assert a.ticks.busy > 0 and a.children_cpu_s >= 0
    sum(i * i for i in range(300_000))  # some ticks of this process's own
    load = ml.between(a, ml.snapshot())
    assert load is None or (0.0 <= load.others <= 1.0 and 0.0 <= load.steal <= 1.0)


class FakeGuest:
    """A reported-KiB counter that grows by a given MiB in each settle window."""

    def __init__(self, mib_per_window: list[float]):
        self.kib = 1000
        self.steps = list(mib_per_window)
        self.t = 0.0

    def read(self):
        return self.kib

    def sleep(self, s):
        self.t += s
        self.kib += int(self.steps.pop(0) * 1024) if self.steps else 0

    def clock(self):
        return self.t


def test_settle_waits_until_a_window_reports_no_more_than_an_idle_guest():
    g = FakeGuest([300, 250, 120, 20, 300])  # passes above the cap, then an idle window
    waited, mib = ml.settle(g.read, g.sleep, g.clock)
    assert waited == 4 * ml.SETTLE_WINDOW_S and mib == 690  # stops at the 20 MiB window
    g = FakeGuest([10])
    assert ml.settle(g.read, g.sleep, g.clock) == (ml.SETTLE_WINDOW_S, 10)  # already settled: one window


def test_settle_gives_up_after_its_limit_and_never_waits_without_a_counter():
    g = FakeGuest([100] * 50)
    waited, mib = ml.settle(g.read, g.sleep, g.clock, max_s=10)
    assert waited == 4 * ml.SETTLE_WINDOW_S and mib == 400  # the first window at or past 10 s
    assert ml.settle(lambda: None, lambda s: pytest.fail("slept"), lambda: 0.0) == (0.0, 0.0)
