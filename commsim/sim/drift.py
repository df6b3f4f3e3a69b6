"""A rank's speed drift as the simulator samples it: an Ornstein-Uhlenbeck process of log
speed, read as its mean over each op's duration.

A kernel's time is its work at the rank's speed *during* it. Where kernels are much
shorter than the drift's correlation time the speed at the kernel's start would do, but
calibrate finds components of 10-40 ms on the development VM (``noise.fit_rank_drift``)
beside kernels of tens of milliseconds, and one draw per kernel would give a 50 ms kernel
the variance of an instant (a 10% sd where its mean over 50 ms varies by 7.6% at a 26 ms
correlation time). So each op draws the process's mean over its duration, jointly with
the state at its end (a bivariate normal given the state at its start), and the next op
continues from that end state: the draws are exactly the process's, for ops in sequence.
An op that starts before the previous one's end (another stream's, at the same time)
draws its mean from the state already drawn and leaves that state as it is.

For an OU process of stationary sd s and correlation time tau, over a duration T with
rho = exp(-T / tau), given the state x0 at the start:

    end state:  mean x0 rho,                    variance s^2 (1 - rho^2)
    integral:   mean x0 tau (1 - rho),          variance s^2 tau^2 (2T/tau - 3 + 4 rho - rho^2)
    covariance of the two: s^2 tau (1 - rho)^2

Times in ns.
"""

from __future__ import annotations

import random
from math import exp, sqrt

# below this T / tau the integral's variance is taken from its series (the closed form
# loses every digit to cancellation): (2/3) u^3 - (1/2) u^4
_SMALL_U = 1e-3


def integral_var(sd: float, corr_ns: float, dur_ns: float) -> float:
    """Variance of the integral of the process over ``dur_ns`` given its start (ns^2)."""
    u = dur_ns / corr_ns
    if u < _SMALL_U:
        f = (2.0 / 3.0) * u ** 3 - 0.5 * u ** 4
    else:
        rho = exp(-u)
        f = 2 * u - 3 + 4 * rho - rho * rho
    return sd * sd * corr_ns * corr_ns * max(f, 0.0)


class OuDrift:
    """One component of a rank's drift: its state and when it holds, its draws."""

    __slots__ = ("sd", "corr_ns", "rng", "x", "t_ns")

    def __init__(self, sd: float, corr_ns: int, rng: random.Random):
        assert sd > 0 and corr_ns > 0, "a drift component needs an sd and a correlation time"
        self.sd, self.corr_ns, self.rng = sd, corr_ns, rng
        self.x = rng.gauss(0.0, sd)  # stationary at the start
        self.t_ns = 0

    def mean_over(self, now_ns: int, dur_ns: int) -> float:
        """The process's mean over [now, now + dur], and the state moved to its end (an
        op that starts before the state's time, beside another, leaves it there)."""
        s, tau = self.sd, self.corr_ns
        beside = now_ns < self.t_ns
        if now_ns > self.t_ns:  # the state at this op's start
            rho = exp(-(now_ns - self.t_ns) / tau)
            self.x = self.x * rho + s * sqrt(1.0 - rho * rho) * self.rng.gauss(0.0, 1.0)
            self.t_ns = now_ns
        if dur_ns <= 0:
            return self.x
        x0 = self.x
        rho = exp(-dur_ns / tau)
        end_var = s * s * (1.0 - rho * rho)
        end = x0 * rho + sqrt(end_var) * self.rng.gauss(0.0, 1.0)
        mean = x0 * tau * (1.0 - rho) / dur_ns
        cov = s * s * tau * (1.0 - rho) ** 2 / dur_ns  # of the mean and the end state
        var = integral_var(s, tau, dur_ns) / (dur_ns * dur_ns)
        rest = max(var - cov * cov / end_var, 0.0) if end_var > 0 else var
        avg = mean + (cov / end_var * (end - x0 * rho) if end_var > 0 else 0.0) + sqrt(rest) * self.rng.gauss(0.0, 1.0)
        if not beside:
            self.x, self.t_ns = end, now_ns + dur_ns
        return avg
