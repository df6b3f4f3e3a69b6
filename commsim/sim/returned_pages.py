"""Host pages a CPU rank gave back to the OS, and which of them its virtual machine's
free-page reporting has since handed to the hypervisor.

A block at or above glibc's mmap ceiling (32 MiB) is mapped at malloc and unmapped at
free: its pages go back to the guest kernel's free lists, and the next large block is
served from there, the pages freed last first (the buddy allocator hands out the head
of its free lists, where freed pages go). A guest with free-page reporting (Linux
``mm/page_reporting.c`` with a virtio-balloon that offers it) reports pages that stay
free to its host, which drops them; the next touch of such a page then faults in the
hypervisor as well, several times the guest's own first-touch cost.

Measured on this project's VMs (traces/README.md, "Which fresh pages come back slow" and
"Returned pages after the executor fix"): probes found a 256 MiB block freed and
written again 0.2-5 s later fast every time, while a 2 GiB one came back partly slow
0.7 s after its free: the guest keeps about max_waiting_mib (1024 MiB) of free memory
unreported and reports what lies beyond it at its next pass (``bench/page_pool.py``).
Over the 1,584 large allocations of seven executor rows (run BG, both ranks, steps 1 on,
``bench/returned_pages_fit.py``), returns reused 0-2.5 s after their free came back
fast (1-2.5% of their bytes slow, the rate's noise); no ramp fits them better than none.
Modelled: a return's pages are fast until ``FAST_FOR_PERIODS`` reporting periods after
its free (calibrate measures the period; 2.4 periods of this VM's 2.05 s is the 5 s
the probes found fast) and reported from then on; any page beyond what the rank gave
back is reported (its growth comes from the guest's free memory at large, reported
long ago). Not modelled: returns of more than the guest's unreported pool at once (a
node freeing over a GiB between two large allocations), whose excess is reported at the
next pass. Pages that stay in glibc's heap are not the OS's and never reported.

An earlier rule (a share rising from 0.75 to 1.5 periods) was fitted on executor runs
that still kept a waited reduce-scatter's buffers past the schedule's free: their slow
blocks were memory beyond what the rank had really returned, which this rule prices as
reported too.

Each rank keeps its own returns: a rank's frees serve its own next blocks (in symmetric
mode every rank of a node frees and allocates alike, so a node-wide pool serves each
rank its own share). Which pages the guest reports depends on its free lists, of which
this keeps only the ages: two plain processes replaying one of those runs' timelines
never met the slow mode until each held gigabytes, as training processes do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A return's pages are fast this many reporting periods after its free, reported from
# then on: 5 s (the longest gap the probes found fast, traces/README.md) at this VM's
# 2.05 s period (see the module docstring).
FAST_FOR_PERIODS = 2.4


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
        returns how many of those bytes are reported pages. The returns still kept are
        all fast (``_forget`` drops the reported ones), so that is what they do not
        cover."""
        self._forget(now_ns)
        need = nbytes
        while need and self.stack:
            top = self.stack[-1]
            got = min(need, top[0])
            top[0] -= got
            need -= got
            if top[0] == 0:
                self.stack.pop()
        return need

    def reported_share(self, age_ns: int) -> float:
        """The share of pages freed ``age_ns`` ago that the guest has reported: none
        before FAST_FOR_PERIODS periods, all from then."""
        return 0.0 if age_ns < FAST_FOR_PERIODS * self.period_ns else 1.0

    def _forget(self, now_ns: int) -> None:
        """Reported returns, the oldest ones, are the same as none (the guest's free
        memory at large), so they are not kept."""
        old = 0
        while old < len(self.stack) and self.reported_share(now_ns - self.stack[old][1]) == 1.0:
            old += 1
        if old:
            del self.stack[:old]

    def held_bytes(self) -> int:
        """Returned bytes kept (for tests and reports)."""
        return sum(b for b, _ in self.stack)

    def clone(self, shift_ns: int = 0) -> "ReturnedPages":
        """A copy whose times are moved by ``shift_ns`` (another simulation's clock)."""
        return ReturnedPages(self.period_ns, [[b, t + shift_ns] for b, t in self.stack])
