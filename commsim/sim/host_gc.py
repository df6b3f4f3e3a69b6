"""Python's full garbage-collection passes as host stalls.

Each rank runs its own interpreter, and CPython's collector runs its full pass (every
tracked object visited) once the objects promoted to its oldest generation since the
last one exceed a quarter of those that survived it (gcmodule.c; the thresholds
gc.get_threshold() gives). In a training loop the promotions come from the step's own
allocations, so a rank passes every ``period_steps`` steps' worth of its host work and
stops its host for ``pause_ns`` each time (``bench/gc_pauses.py`` measures both for a
DeepSpeed release; traces/README.md, "host-costs/", ``gc/``). A rank's pause delays
every collective it joins after it, unless its host was far enough ahead of its device
to absorb it.

Where the ranks' passes fall (``HostGc.aligned``):

* aligned (the default but for ZeRO-2): ranks that run the same program allocate
  alike, so their collectors trigger at the same point of it. Measured on a real
  DeepSpeed ZeRO-3 job (``bench/gc_alignment.py``, 2 and 4 gloo ranks: every collection
  of every rank at the same step and module hook, the full passes' starts a fraction of
  a pause apart, and their step one to two pauses longer, not one per rank). The job
  pays one rank's passes, whatever its size.
* independent: each rank at its own phase in the period, as in a script whose ranks do
  different Python work: ZeRO-2, whose backward keeps or drops each gradient by the
  rank's slice of the flat partition (measured: 2 ZeRO-2 ranks passed 13 steps apart),
  rank-dependent data handling. The job pays every rank's passes, which grows with the
  ranks.

Per-rank mode draws the phase (one for all ranks when aligned) and stops a rank's host
where its work crosses a trigger (``GcClock``). Symmetric mode, one rank standing for
all, counts the expected stops over its host ops (``expected_pause_ns``: with ``w`` of
host work in an op and ``p = w / (period x work per step)``, every rank passes
floor(p) times for sure and once more with probability frac(p), so the latest of the n
ranks that pass independently pays ``pause x (floor(p) + 1 - (1 - frac(p))^n)``; n = 1
when aligned) and stops its own host for a whole pause each time one stop has accrued
(``ExpectedStops``; the step's fraction of one at its first host op), each absorbed only
as far as the host had run ahead of its device, as a real one is. Independent, it counts
two ranks' passes that fall close together twice where a real job pays about one, and
places the stops evenly; per-rank mode has neither approximation. The two agree where
stops are rare (tests/sim/test_host_gc.py; the seed at 64 GPUs within 3%); with dozens a
step symmetric mode runs high (the seed's 0.6.0 at 256 GPUs, independent: 8.33 against
6.95 s, docs/deepspeed-versions.md).
Training loops of today avoid the cost by turning the collector off and collecting on
every rank at the same step (torchtitan's ``GarbageCollection``); the default is no
pass at all, as for such a loop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from math import floor


@dataclass(frozen=True, slots=True)
class HostGc:
    """A rank's full collections: one every ``period_steps`` steps of host work, each
    stopping its host for ``pause_ns``; every rank's at the same point of the program
    (``aligned``) or each at its own phase."""

    period_steps: float
    pause_ns: int
    aligned: bool = True

    @property
    def alignment(self) -> str:
        return "aligned" if self.aligned else "independent"

    def passing_ranks(self, ranks: int) -> int:
        """How many ranks' passes the job pays: one when they fall together."""
        return 1 if self.aligned else ranks

    def __post_init__(self) -> None:
        if not self.period_steps > 0 or self.pause_ns < 0:
            raise ValueError(f"host GC every {self.period_steps} steps, {self.pause_ns} ns: the period must be "
                             "positive and the pause non-negative")


def expected_pause_ns(gc: HostGc, work_ns: float, work_per_step_ns: float, ranks: int) -> int:
    """Expected pause of the latest of ``ranks`` ranks over the same ``work_ns`` of host
    work (one op's), each rank with its own uniform phase in its period."""
    if work_ns <= 0 or work_per_step_ns <= 0 or ranks < 1 or not gc.pause_ns:
        return 0
    p = work_ns / (gc.period_steps * work_per_step_ns)
    whole = floor(p)
    return round(gc.pause_ns * (whole + 1 - (1 - (p - whole)) ** ranks))


class ExpectedStops:
    """Symmetric mode's stand-in for every rank's passes: the job's expected stops (a pass
    on any of its ranks) over a step, paid as whole pauses where they accrue over the
    host's work, so that the host's slack absorbs a pause as it would absorb a real one
    (little) and not a thin expected share of it (all); the step's fraction of a stop is
    paid at its first host op."""

    __slots__ = ("gc", "work_per_step_ns", "ranks", "per_step", "owed", "fraction_due")

    def __init__(self, gc: HostGc, work_per_step_ns: float, ranks: int, op_work_ns: list[int]):
        self.gc = gc
        self.work_per_step_ns = work_per_step_ns
        self.ranks = ranks
        # the expected stops of one step: its host ops' in turn
        self.per_step = sum(expected_pause_ns(gc, w, work_per_step_ns, ranks) for w in op_work_ns) / gc.pause_ns \
            if gc.pause_ns else 0.0
        self.start_step()

    def start_step(self) -> None:
        self.owed = 0.0
        self.fraction_due = self.per_step - floor(self.per_step)

    def advance(self, work_ns: int) -> int:
        """The pause (ns) due by the end of this much more host work."""
        if not self.gc.pause_ns:
            return 0
        pause = 0
        if self.fraction_due:
            pause, self.fraction_due = round(self.fraction_due * self.gc.pause_ns), 0.0
        self.owed += expected_pause_ns(self.gc, work_ns, self.work_per_step_ns, self.ranks) / self.gc.pause_ns
        whole = floor(self.owed + 1e-9)
        self.owed -= whole
        return pause + whole * self.gc.pause_ns


class GcClock:
    """One rank's collector in per-rank mode: its phase drawn once, then a pause each
    time its host work crosses a multiple of the period (in ns of work)."""

    __slots__ = ("gc", "period_ns", "next_ns", "done_ns")

    def __init__(self, gc: HostGc, work_per_step_ns: float, rng: random.Random):
        self.gc = gc
        self.period_ns = gc.period_steps * work_per_step_ns
        self.next_ns = rng.uniform(0.0, self.period_ns) if self.period_ns > 0 else float("inf")
        self.done_ns = 0.0

    def advance(self, work_ns: int) -> int:
        """The pause (ns) this much more host work runs into."""
        if self.period_ns <= 0:
            return 0
        self.done_ns += work_ns
        pause = 0
        while self.done_ns >= self.next_ns:
            pause += self.gc.pause_ns
            self.next_ns += self.period_ns
        return pause


ALIGNMENTS = ("aligned", "independent")


def aligned_by_default(strategy: str | None) -> bool:
    """Whether a strategy's ranks collect together (measured with bench/gc_alignment.py):
    those of ZeRO-3 and FSDP2, which hold the same shard of every parameter, and of
    ZeRO-1 do; ZeRO-2's, whose backward keeps or drops each gradient by the rank's slice
    of the flat partition, do not (its ranks promote 100 and 96 objects a step and pass
    at different steps). Plain data parallelism's identical ranks are taken as aligned."""
    return strategy != "zero2"


def parse_host_gc(text: str, default_aligned: bool = True) -> HostGc:
    """``PERIOD_STEPS:PAUSE_MS[:aligned|independent]`` (e.g. ``30:200``; without the
    third part ``default_aligned``, the strategy's: ``aligned_by_default``) as a HostGc;
    ValueError naming what is wrong."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ALIGNMENTS):
            raise ValueError
        gc = HostGc(float(parts[0]), int(round(float(parts[1]) * 1e6)),
                    aligned=default_aligned if len(parts) == 2 else parts[2] == "aligned")
    except ValueError:
        raise ValueError(f"{text!r}: PERIOD_STEPS:PAUSE_MS[:aligned|independent], a positive number of steps, a "
                         "non-negative pause in ms and where the ranks' passes fall, e.g. 30:200 or "
                         "30:200:independent") from None
    return gc
