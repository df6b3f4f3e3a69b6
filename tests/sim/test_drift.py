"""A drift component read over each op's duration (commsim.sim.drift.OuDrift): its draws
have the Ornstein-Uhlenbeck process's window variances, ops in sequence continue one
another exactly, and an op beside another leaves the state where it was."""

import math
import random
import statistics

import pytest

from commsim.hardware.noise import ou_window_var
from commsim.sim.drift import OuDrift, integral_var

SD, TAU = 0.1, 20_000_000  # 10%, 20 ms


def draws(dur_ns, n=20_000, seed=1):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        out.append(OuDrift(SD, TAU, rng).mean_over(0, dur_ns))  # a stationary start each time
    return out


@pytest.mark.parametrize("dur_ns", [2_000_000, 20_000_000, 100_000_000])
def test_an_ops_mean_speed_varies_as_the_process_over_its_length(dur_ns):
    """From a stationary start, the mean over T has the window variance: a 100 ms op
    (5 correlation times) varies by a third of an instant's sd, a 2 ms one by nearly
    all of it (sampling error of 20,000 draws: about 1% in variance)."""
    got = statistics.pvariance(draws(dur_ns))
    assert got == pytest.approx(ou_window_var(SD, TAU, dur_ns), rel=0.05)
    assert statistics.fmean(draws(dur_ns, seed=2)) == pytest.approx(0.0, abs=0.01)


def test_ops_in_sequence_are_the_same_process_as_one_op_over_both():
    """Two 20 ms ops back to back: the mean of their two means varies as one 40 ms op
    does, and the state after them is stationary again; an op that starts 30 ms after
    the last one ended correlates with it by the process's own rho."""
    rng = random.Random(3)
    pair, ends, first, later = [], [], [], []
    for _ in range(20_000):
        d = OuDrift(SD, TAU, rng)
        a, b = d.mean_over(0, 20_000_000), d.mean_over(20_000_000, 20_000_000)
        pair.append((a + b) / 2)
        ends.append(d.x)
        first.append(b)
        later.append(d.mean_over(70_000_000, 1))  # 30 ms after b's end, an instant
    assert statistics.pvariance(pair) == pytest.approx(ou_window_var(SD, TAU, 40_000_000), rel=0.05)
    assert statistics.pvariance(ends) == pytest.approx(SD * SD, rel=0.05)
    # cov(mean over [20, 40] ms, x at 70 ms) = s^2 tau (1 - rho_20) / 20 ms x rho_30
    want = SD * SD * TAU * (1 - math.exp(-1)) / 20_000_000 * math.exp(-1.5)
    got = statistics.fmean(x * y for x, y in zip(first, later)) - statistics.fmean(first) * statistics.fmean(later)
    assert got == pytest.approx(want, rel=0.1)


def test_an_op_beside_another_leaves_the_state():
    d = OuDrift(SD, TAU, random.Random(5))
    d.mean_over(0, 50_000_000)
    x, t = d.x, d.t_ns
    assert t == 50_000_000
    d.mean_over(10_000_000, 5_000_000)  # another stream's op, during the first
    assert (d.x, d.t_ns) == (x, t)
    d.mean_over(60_000_000, 0)  # a later op of no length: the state advanced to its start
    assert d.t_ns == 60_000_000 and d.x != x


def test_the_integrals_variance_is_continuous_where_its_series_takes_over():
    u = 0.999e-3  # the series' side: it agrees with the closed form (still exact to ~1e-7 here)
    closed = 2 * u - 3 + 4 * math.exp(-u) - math.exp(-2 * u)
    assert integral_var(1.0, 1.0, u) == pytest.approx(closed, rel=1e-5)
    # long: 2 s^2 tau T, the variance of the mean 2 s^2 tau / T
    assert integral_var(SD, TAU, 1000 * TAU) == pytest.approx(SD * SD * TAU * TAU * (2000 - 3), rel=1e-9)
