"""bench/rank_drift.py's pure parts and the binning it shares with calibrate
(``commsim.hardware.noise.binned_log_series``): the drift's window sd, window means."""

import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from rank_drift import drift_window_sd, window_sd  # noqa: E402

from commsim.hardware.noise import binned_log_series  # noqa: E402


def test_binning_is_calibrates():
    # calls of 1 and 4 ms in the first 10 ms bin, none in the second, 2 ms in the third:
    # log over the median (2 ms), the empty bin repeats the previous one
    starts = [0, 2_000_000, 20_000_000]
    times = [1_000_000, 4_000_000, 2_000_000]
    s = binned_log_series(starts, times, 10_000_000, 30_000_000)
    assert s == pytest.approx([(math.log(0.5) + math.log(2.0)) / 2, 0.0, 0.0])
    s = binned_log_series([0, 12_000_000], [1_000_000, 4_000_000], 10_000_000, 30_000_000)
    assert s == pytest.approx([math.log(0.4), math.log(1.6), math.log(1.6)])


def test_drift_window_sd_limits():
    sd, tau = 0.1, 1e8
    # a window much shorter than the correlation: the two ranks' instant difference
    assert drift_window_sd([(sd, tau)], 1e3) == pytest.approx(math.sqrt(2) * sd, rel=1e-3)
    # much longer: sd sqrt(2 tau / T) each, times sqrt(2) for the difference
    assert drift_window_sd([(sd, tau)], 1e12) == pytest.approx(math.sqrt(2) * sd * math.sqrt(2 * tau / 1e12), rel=1e-3)
    assert drift_window_sd([(0.0, tau)], 1e9) == 0.0 == drift_window_sd([], 1e9)
    # two components: their variances add
    assert drift_window_sd([(sd, tau), (sd, tau)], 1e3) == pytest.approx(2 * sd, rel=1e-3)


def test_drift_window_sd_matches_a_simulated_pair():
    # two independent discretised OU processes (10 ms steps, tau 200 ms): the sd of
    # their difference's 500 ms means agrees with the formula within sampling error
    rng = random.Random(7)
    sd, tau_ns, dt_ns, n = 0.1, 200e6, 10e6, 200_000
    rho = math.exp(-dt_ns / tau_ns)
    xs = []
    for _ in range(2):
        x, out = rng.gauss(0, sd), []
        for _ in range(n):
            x = x * rho + sd * math.sqrt(1 - rho * rho) * rng.gauss(0, 1)
            out.append(x)
        xs.append(out)
    diff = [a - b for a, b in zip(*xs)]
    assert window_sd(diff, 50) == pytest.approx(drift_window_sd([(sd, tau_ns)], 500e6), rel=0.08)


def test_window_sd():
    assert window_sd([1.0, 1.0, -1.0, -1.0], 2) == 1.0
    assert window_sd([0.5, -0.5, 0.5, -0.5], 2) == 0.0
    assert window_sd([1.0, 2.0], 2) == 0.0  # one window: no spread
