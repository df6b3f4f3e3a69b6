"""Host pages a CPU rank gave back to the OS, and which of them its virtual machine's
free-page reporting has since handed to the hypervisor.

A block at or above glibc's mmap ceiling (32 MiB) is mapped at malloc and unmapped at
free: its pages go back to the guest kernel's free lists, and the next large block is
served from there, the pages freed last first (the buddy allocator hands out the head
of its free lists, where freed pages go). A guest with free-page reporting (Linux
``mm/page_reporting.c`` with a virtio-balloon that offers it) reports pages that stay
free to its host, which drops them; the next touch of such a page then faults in the
hypervisor as well, several times the guest's own first-touch cost.

Measured on this project's VM (traces/README.md, "Which fresh pages come back slow"):
over the large allocations of seven executor rows (three grid runs, both ranks), pages
the rank had freed less than a second earlier came back at the fast first-touch rate,
pages freed 1-1.75 s earlier slow for 7-30% of their bytes, 2 s earlier 42%, and from
2.5 s on nearly all; the guest's reporting pass ran every 2.01-2.05 s. Modelled: the
share of a return's pages reported by the time they are reused rises linearly from none
at three quarters of a reporting period (calibrate measures it) to all at one and a half
(``REPORTED_FROM``, ``REPORTED_BY``: where those allocations put it; their executor still
kept a waited reduce-scatter's buffers past the schedule's free, fixed since), i.e. a return is
reported about a period after its free, at a phase the step does not set; any page
beyond what the rank gave back is reported (its growth comes from the guest's free
memory at large, reported long ago). Pages that stay in glibc's heap are not the OS's
and never reported. The share is an expectation: a real step meets the slow mode in some
steps and not others, and the simulated step pays its mean.

Each rank keeps its own returns: a rank's frees serve its own next blocks (in symmetric
mode every rank of a node frees and allocates alike, so a node-wide pool serves each
rank its own share). Which pages the guest reports depends on its free lists, of which
this keeps only the ages: two plain processes replaying one of those runs' timelines
never met the slow mode until each held gigabytes, as training processes do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The reported share of a return by its age, in reporting periods: none before
# REPORTED_FROM, all from REPORTED_BY. From the per-allocation data of three grid runs on
# this project's VM (1,680 large allocations of seven executor rows, the period 2.01 s):
# the least-squares ramp starts at 1.55 s and is 1.6 s wide (traces/README.md, "Which
# fresh pages come back slow").
REPORTED_FROM = 0.75
REPORTED_BY = 1.5


@dataclass
class ReturnedPages:
    """One rank's returned large blocks, newest last: [bytes, freed at ns]."""

    period_ns: int  # the guest's reporting period (see reported_share)
    stack: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.period_ns > 0, "a reporting period is positive"

    def returned(self, now_ns: int, nbytes: int) -> None:
        """A large block's pages went back to the OS at ``now_ns``."""
        if nbytes > 0:
            self.stack.append([nbytes, now_ns])

    def take(self, now_ns: int, nbytes: int) -> int:
        """Fresh pages for ``nbytes`` written at ``now_ns``, the newest returns first:
        returns how many of those bytes are (expected to be) reported pages: each
        return's ``reported_share`` by its age, and all beyond what was returned."""
        self._forget(now_ns)
        need, reported = nbytes, 0.0
        while need and self.stack:
            top = self.stack[-1]
            got = min(need, top[0])
            reported += got * self.reported_share(now_ns - top[1])
            top[0] -= got
            need -= got
            if top[0] == 0:
                self.stack.pop()
        return int(reported) + need

    def reported_share(self, age_ns: int) -> float:
        """The expected share of pages freed ``age_ns`` ago that the guest has reported:
        none before REPORTED_FROM periods, all from REPORTED_BY, linear between."""
        start = REPORTED_FROM * self.period_ns
        return min(1.0, max(0.0, (age_ns - start) / ((REPORTED_BY - REPORTED_FROM) * self.period_ns)))

    def _forget(self, now_ns: int) -> None:
        """Returns REPORTED_BY periods old are all reported: the same as none (the
        guest's free memory at large), so they need not be kept."""
        old = 0
        while old < len(self.stack) and now_ns - self.stack[old][1] >= REPORTED_BY * self.period_ns:
            old += 1
        if old:
            del self.stack[:old]

    def held_bytes(self) -> int:
        """Returned bytes kept (for tests and reports)."""
        return sum(b for b, _ in self.stack)

    def clone(self, shift_ns: int = 0) -> "ReturnedPages":
        """A copy whose times are moved by ``shift_ns`` (another simulation's clock)."""
        return ReturnedPages(self.period_ns, [[b, t + shift_ns] for b, t in self.stack])
