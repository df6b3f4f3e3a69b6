"""Whether this machine's guest kernel reports free memory to a hypervisor, how often,
and which of a run of fresh-page timings are the slow, reported kind (pure: no torch;
``calibrate_host.HostMeasurements.reported_pages`` does the touching).

Linux's free page reporting (``mm/page_reporting.c``) hands free pages of order
``page_reporting_order`` and up to a device that registered for them: virtio-balloon's
free page reporting (feature bit VIRTIO_BALLOON_F_REPORTING = 5, device id 5, in the
virtio spec and ``include/uapi/linux/virtio_balloon.h``), which Firecracker, QEMU and
cloud-hypervisor offer. The host drops a reported page; the guest's next write to it
faults in the hypervisor as well. A pass runs ``PAGE_REPORTING_DELAY`` (2 s,
``mm/page_reporting.c``) after a free asks for one, so while a process frees memory the
passes come every delay plus a pass; kernels that count their passes
(``/sys/module/page_reporting/parameters/passes``) let calibrate time them (2.05 s on
this project's VM). Some guests keep part of their freed memory unreported: this
project's Firecracker kernels list ``max_waiting_mib`` (1024) and report only what lies
above about that much, 100-330 MiB a pass (``bench/page_pool.py`` measures it).
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

# mm/page_reporting.c: `#define PAGE_REPORTING_DELAY (2*HZ)`: a pass runs this long
# after the free that requested it
PAGE_REPORTING_DELAY_S = 2.0
VIRTIO_ID_BALLOON = 5
VIRTIO_BALLOON_F_REPORTING = 5
# a piece slower than this many times the run's fast pieces is a reported one: the two
# kinds measured 0.36-0.68 and 2.5-4.0 ns a byte on this project's VM (traces/README.md)
SLOW_FACTOR = 2.5
# reported pieces needed before their rate is trusted
MIN_SLOW_PIECES = 2
# pieces timed before the probe may stop: the fast reference is the median of the
# fastest quarter, one piece below eight, which one outlier then sets
MIN_PIECES_TO_STOP = 8


def balloon_reports(sys_root: str = "/sys") -> bool:
    """A virtio-balloon device that offers free page reporting, and the kernel's page
    reporting built in: the guest hands the memory its processes free to its host."""
    if not Path(sys_root, "module/page_reporting").is_dir():
        return False
    for dev in sorted(Path(sys_root, "bus/virtio/devices").glob("*")):
        try:
            device = int(Path(dev, "device").read_text().strip(), 16)
            features = Path(dev, "features").read_text().strip()
        except (OSError, ValueError):
            continue
        if device == VIRTIO_ID_BALLOON and len(features) > VIRTIO_BALLOON_F_REPORTING \
                and features[VIRTIO_BALLOON_F_REPORTING] == "1":
            return True
    return False


def reporting_passes(sys_root: str = "/sys") -> int | None:
    """The kernel's count of reporting passes, where it keeps one (not upstream Linux)."""
    try:
        return int(Path(sys_root, "module/page_reporting/parameters/passes").read_text().strip())
    except (OSError, ValueError):
        return None


def reporting_period_s(pass_times_s: list[float]) -> float:
    """Seconds between passes while memory is being freed: the shortest interval between
    two counted passes (each free requests a pass, which runs the kernel's delay after;
    longer intervals are times nothing was freed), never below the delay; the delay
    where fewer than two passes were counted."""
    gaps = [b - a for a, b in zip(pass_times_s, pass_times_s[1:]) if b > a]
    return max(PAGE_REPORTING_DELAY_S, min(gaps)) if gaps else PAGE_REPORTING_DELAY_S


class PassWatch:
    """The times the kernel's pass counter moved, sampled every ``SAMPLE_S`` by a daemon
    thread from ``start`` to ``stop`` (nothing where the kernel keeps no count)."""

    SAMPLE_S = 0.02

    def __init__(self, sys_root: str = "/sys"):
        self.sys_root = sys_root
        self.times_s: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "PassWatch":
        # the count at start is read here, not on the thread, so that a move right after
        # start is not taken for the baseline when the thread is scheduled late
        first = reporting_passes(self.sys_root)
        if first is not None:
            self._thread = threading.Thread(target=self._run, args=(first,), name="page-reporting-passes",
                                            daemon=True)
            self._thread.start()
        return self

    def _run(self, first: int) -> None:
        last = first
        while not self._stop.wait(self.SAMPLE_S):
            now = reporting_passes(self.sys_root)
            if now is None:  # unreadable for a moment (a file being rewritten): keep the last count
                continue
            if now != last:
                self.times_s.append(time.perf_counter())
            last = now

    def stop(self) -> list[float]:
        """Stop sampling; the times the counter moved."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return list(self.times_s)


def slow_pieces(rates_ns_per_byte: list[float]) -> list[bool]:
    """Which of successive fresh pieces' first-write rates (ns a byte) are reported
    pages: slower than SLOW_FACTOR times the median of the fastest quarter."""
    ordered = sorted(rates_ns_per_byte)
    fast_ref = statistics.median(ordered[:max(1, len(ordered) // 4)]) if ordered else 0.0
    return [r > SLOW_FACTOR * fast_ref for r in rates_ns_per_byte]


def reported_met(rates_ns_per_byte: list[float]) -> bool:
    """Whether a probe of successive fresh pieces may stop: the last four reported
    pages, with at least MIN_PIECES_TO_STOP pieces timed."""
    return len(rates_ns_per_byte) >= MIN_PIECES_TO_STOP and all(slow_pieces(rates_ns_per_byte)[-4:])


def reported_extra(rates_ns_per_byte: list[float]) -> float | None:
    """The reported pieces' mean rate over the fast pieces' mean (``slow_pieces``), when
    at least four pieces were timed and MIN_SLOW_PIECES of them are slow; None when the
    run found no reported pages (every piece came from memory the guest had not
    reported yet)."""
    if len(rates_ns_per_byte) < 4:
        return None
    marks = slow_pieces(rates_ns_per_byte)
    slow = [r for r, s in zip(rates_ns_per_byte, marks) if s]
    fast = [r for r, s in zip(rates_ns_per_byte, marks) if not s]
    if len(slow) < MIN_SLOW_PIECES:
        return None
    return statistics.fmean(slow) - statistics.fmean(fast)
