"""What else the machine did while a local validation run measured: the share of its CPU
time the hypervisor gave to other tenants (``steal`` in /proc/stat) and the share other
processes used (every busy tick less what the run's own processes used).

A grid on a 2-core VM compares a prediction made from a calibration with a run minutes
later; work beside the run (a test suite, an editor's indexer, another tenant on the
same physical cores) slows the run and not the calibration, or the other way round.
Rows whose runs shared the machine are then read as model errors. validate_local wraps
each run in two ``snapshot()`` calls and prints ``between()`` for it, so a reader sees
which rows ran on a busy machine.

In a virtual machine whose balloon reports freed memory to the host (Linux's page
reporting: /sys/module/page_reporting), the memory reported while a run measured is read
too: a reported page is unmapped by the host, so a process that is handed it later faults
it in through the hypervisor (2-3 ns a byte here against 0.35 for a page the guest kept;
traces/README.md, "DeepSpeed's routines inside a real step"), and the kernel keeps
reporting long after a process frees memory (about 16 MiB a second for 20 s after a
two-rank calibration exits on this VM, and some MiB a second while idle).

Such a guest keeps some of its freed memory unreported (about 1 GiB here: its
``max_waiting_mib``) and reports what lies above that, a pass about every 2 s, 100-330
MiB a pass (``bench/page_pool.py``; traces/README.md, "The guest's unreported memory").
A calibration's probes and a run's exit free gigabytes, so the next run or calibration
would measure beside tens of seconds of passes, which may report pages its ranks freed a
moment before (slow when taken again). ``settle`` waits until the passes report no more
than an idle guest's few MiB, so that every run and calibration starts from the same
state, the steady one a training job is in.

``snapshot`` reads the kernel's counters (Linux; elsewhere it returns None and nothing
is reported); ``between``, ``parse_proc_stat`` and ``settle`` (given its clock) are pure.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class CpuTicks:
    """The first line of /proc/stat, in clock ticks summed over every CPU."""
    busy: int  # user + nice + system + irq + softirq (the guest columns are inside user / nice)
    idle: int  # idle + iowait
    steal: int


@dataclass(frozen=True)
class Snapshot:
    ticks: CpuTicks
    children_cpu_s: float  # CPU time of this process's waited-for descendants (the runs)
    reported_kib: int | None = None  # freed memory the guest has reported to its host so far


REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")
# settle: a window longer than one reporting period (2.05 s measured), and what an idle
# guest's passes report in one (4-22 MiB a pass measured; 100-330 while above its cap)
SETTLE_WINDOW_S = 3.0
SETTLE_QUIET_MIB = 32.0
SETTLE_MAX_S = 90.0


@dataclass(frozen=True)
class MachineLoad:
    """Shares of all CPUs' time over an interval, 0..1."""
    others: float  # busy in processes that were not the run's (nor this script's)
    steal: float  # taken by the hypervisor for other virtual machines
    reported_mib: float | None = None  # freed memory reported to the host meanwhile (None: no counter)

    def short(self) -> str:
        return f"{self.others:.0%}/{self.steal:.0%}" + \
            (f"/{self.reported_mib:.0f} MiB" if self.reported_mib is not None else "")


def load_line(runs: list[MachineLoad | None], calibrations: list[MachineLoad | None]) -> str | None:
    """A row's line: each run's and each calibration's others/steal shares (None when
    nothing was measured)."""
    def part(loads: list[MachineLoad | None]) -> str:
        return ", ".join(x.short() if x else "?" for x in loads)

    if not any(runs) and not any(calibrations):
        return None
    reported = any(x is not None and x.reported_mib is not None for x in runs + calibrations)
    what = "others/steal/freed memory reported to the host" if reported else "others/steal"
    return f"    machine beside ({what}): runs {part(runs)}; calibrations {part(calibrations)}"


def parse_proc_stat(text: str) -> CpuTicks:
    """The aggregate ``cpu`` line of /proc/stat (proc(5): user nice system idle iowait
    irq softirq steal guest guest_nice)."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            v = [int(x) for x in fields[1:]] + [0] * 8
            user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
            return CpuTicks(busy=user + nice + system + irq + softirq, idle=idle + iowait, steal=steal)
    raise ValueError("/proc/stat: no aggregate 'cpu' line")


def snapshot(stat: Path = Path("/proc/stat"), reported: Path = REPORTED_KIB) -> Snapshot | None:
    """The machine's counters now; None where there is no /proc/stat (the reported
    memory None where the kernel does no page reporting)."""
    try:
        ticks = parse_proc_stat(stat.read_text())
    except OSError:
        return None
    try:
        reported_kib = int(reported.read_text())
    except (OSError, ValueError):
        reported_kib = None
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    # this script's own time counts as the run's: it only waits while a run measures
    return Snapshot(ticks, ch.ru_utime + ch.ru_stime + me.ru_utime + me.ru_stime, reported_kib)


def between(a: Snapshot | None, b: Snapshot | None, hz: int | None = None) -> MachineLoad | None:
    """The machine's load between two snapshots (None if either is missing or no time
    passed). ``hz``: clock ticks a second (the kernel's USER_HZ by default)."""
    if a is None or b is None:
        return None
    hz = hz or os.sysconf("SC_CLK_TCK")
    total = (b.ticks.busy - a.ticks.busy) + (b.ticks.idle - a.ticks.idle) + (b.ticks.steal - a.ticks.steal)
    if total <= 0:
        return None
    own = (b.children_cpu_s - a.children_cpu_s) * hz
    others = max(0.0, (b.ticks.busy - a.ticks.busy) - own) / total
    reported = (None if a.reported_kib is None or b.reported_kib is None
                else max(0, b.reported_kib - a.reported_kib) / 1024)
    return MachineLoad(others=min(1.0, others), steal=(b.ticks.steal - a.ticks.steal) / total, reported_mib=reported)


def reported_kib_now(path: Path = REPORTED_KIB) -> int | None:
    """The guest's reported memory so far, KiB (None where the kernel keeps no count)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def settle(read: Callable[[], int | None] = reported_kib_now, sleep: Callable[[float], None] = time.sleep,
           clock: Callable[[], float] = time.monotonic, max_s: float = SETTLE_MAX_S) -> tuple[float, float]:
    """Wait until a window of ``SETTLE_WINDOW_S`` reports at most ``SETTLE_QUIET_MIB``
    (or ``max_s`` passed); (seconds waited, MiB reported meanwhile). No wait where the
    kernel keeps no count."""
    first = prev = read()
    if first is None:
        return 0.0, 0.0
    start = clock()
    while True:
        sleep(SETTLE_WINDOW_S)
        now = read()
        if now is None or (now - prev) / 1024 <= SETTLE_QUIET_MIB or clock() - start >= max_s:
            break
        prev = now
    return clock() - start, max(0, (now if now is not None else prev) - first) / 1024
