"""A simulated rank's speed: each op's time on this rank, drawn where the rank is not
clockwork. A kernel jittered per op (``SimConfig.jitter``); every kernel, copy and
collective call scaled by the rank's speed drift (an Ornstein-Uhlenbeck process of log
speed, ``RankDrift``); every piece of the rank's thread's work given the stalls that
arrive during it (``RankStalls``); a host op drawn with the host jitter (per-rank mode)
or kept for the lateness of the next collective (symmetric mode), then stopped by the
full garbage collections its work runs into (``host_gc``: the rank's own in per-rank
mode, the job's expected ones in symmetric mode). Each keeps the op's mean. A
framework's Python after its rank's collectives is priced cold first
(``CostModel.framework_python_ns``). A mixin of ``rank.RankSim``, whose state it uses."""

from __future__ import annotations

from math import exp

from commsim.ir import ops as O
from commsim.hardware.noise import ou_window_var

# host work that is a framework's own Python: its cost was timed back to back, and a
# collective between two of its calls takes its cores and caches (framework_python_ns)
FRAMEWORK_PYTHON = frozenset({O.HostKind.PYTHON, O.HostKind.MODULE_HOOK, O.HostKind.GRAD_HOOK, O.HostKind.DEBUG})


class RankSpeed:
    """Durations of one rank's ops; the attributes it reads are RankSim's."""

    def _jittered(self, dur: int) -> int:
        """A kernel time jittered per rank and scaled by the rank's speed now."""
        if self.jitter:
            dur = max(1, int(dur * max(0.5, self.rng.gauss(1.0, self.jitter))))
        return self._speed(dur)

    def _speed(self, dur: int) -> int:
        """A duration scaled by the rank's speed during it: each drift component's mean
        over the op (``commsim.sim.drift.OuDrift``), exp(sum - var/2) with var the
        components' variance over that length, so that the mean factor is 1."""
        if not self.drift:
            return self._stalled(dur)
        now = self.env.now
        x = sum(c.mean_over(now, dur) for c in self.drift)
        var = sum(ou_window_var(c.sd, c.corr_ns, dur) for c in self.drift)
        return self._stalled(max(1, int(dur * exp(x - var / 2))))

    def _stalled(self, dur: int) -> int:
        """``dur``, a measured mean that holds its share of the rank's stalls, as
        undisturbed work (``dur / (1 + loss)``) plus the stalls that arrive during it:
        Poisson arrivals, lengths drawn from the measured ones (RankStalls). The mean
        stays ``dur``; a sync after it waits for whichever rank stalled."""
        if self.stalls is None or dur <= 0:
            return dur
        rate_per_ns, work_share, lengths_ns = self.stalls
        work = dur * work_share
        rng = self.stall_rng
        t = rng.expovariate(rate_per_ns)
        extra = 0
        while t < work:
            extra += rng.choice(lengths_ns)
            t += rng.expovariate(rate_per_ns)
        return max(1, int(work) + extra)

    def _warmth_ns(self, op) -> int:
        """A host op's mean time: a framework's Python priced cold when a collective of
        this rank ran since its last Python (``CostModel.framework_python_ns``), else as
        given."""
        if op.kind not in FRAMEWORK_PYTHON:
            return op.duration_ns
        dur = self.cost.framework_python_ns(op.duration_ns, self.comm_since_python or self.comm_running > 0)
        self.comm_since_python = False
        return dur

    def _host_ns(self, duration_ns: int) -> int:
        """A host op's time on this rank: drawn (per-rank mode) or its mean, its variance
        kept for the lateness of the next collective (symmetric mode); plus the pauses of
        the full garbage collections its work runs into (host_gc)."""
        sd = self.host_sd
        if not sd:
            dur = self._stalled(duration_ns)
        elif self.lateness is not None:
            self.lateness.add(duration_ns)
            dur = duration_ns
        else:
            dur = self._stalled(max(0, int(duration_ns * exp(self.host_rng.gauss(0.0, sd) - sd * sd / 2))))
        pause = self.gc_clock.advance(duration_ns) if self.gc_clock is not None else 0
        if pause:
            self.result.gc_pause_ns += pause
        return dur + pause
