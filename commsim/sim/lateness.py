"""How late a synchronisation's slowest rank is, when every rank's host time jitters.

Each host op's time varies by a relative standard deviation (the platform's
``host_jitter``), independently per op and per rank. A collective starts when its last
member issues it, so after k host ops of durations d_i since the ranks last waited for
one another, its start is late, against a noise-free rank, by the largest of n draws of
a normal variable of standard deviation sqrt(sum (sd d_i)^2): in expectation
sqrt(sum (sd d_i)^2) E[max of n standard normals]. That expectation grows with the
number of ranks (about sqrt(2 ln n)), which is why one noise-free rank underestimates a
many-rank step that synchronises often. Symmetric mode adds it; per-rank mode draws
every rank's host times instead, and the two agree (tests/sim/test_lateness.py).
"""

from __future__ import annotations

from functools import lru_cache
from math import erf, exp, pi, sqrt


@lru_cache(maxsize=None)
def expected_max_of_normals(n: int) -> float:
    """E[max of n independent standard normal variables] (0 for n <= 1), by quadrature
    of n x phi(x) Phi(x)^(n-1) over [-10, 10]."""
    if n <= 1:
        return 0.0
    steps = 8000
    lo, hi = -10.0, 10.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        phi = exp(-x * x / 2) / sqrt(2 * pi)
        cdf = 0.5 * (1 + erf(x / sqrt(2)))
        w = 0.5 if i in (0, steps) else 1.0
        total += w * x * n * phi * cdf ** (n - 1)
    return total * h


class HostLateness:
    """One rank's accumulated host-time variance since its host last waited."""

    __slots__ = ("sd", "var_ns2")

    def __init__(self, sd: float):
        self.sd = sd
        self.var_ns2 = 0.0

    def add(self, duration_ns: int) -> None:
        self.var_ns2 += (self.sd * duration_ns) ** 2

    def waited(self) -> None:
        """The host waited for the device or its peers: the ranks line up again."""
        self.var_ns2 = 0.0

    def slowest_of(self, n: int) -> int:
        """Expected lateness (ns) of the latest of ``n`` ranks issuing a collective now."""
        return int(sqrt(self.var_ns2) * expected_max_of_normals(n)) if self.var_ns2 else 0
