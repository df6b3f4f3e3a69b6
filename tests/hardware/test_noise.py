"""Fitting the ranks' speed drift (an OU process's sd and correlation time come back)
and their stalls (each call over the median is a stall of the difference)."""

import math
import random

import pytest

from commsim.hardware.noise import STALL_SLICES, fit_rank_noise, fit_rank_stalls, pool_rank_stalls

BIN_NS = 10_000_000


def ou_series(rng, sd, corr_ns, bins, common=None):
    rho = math.exp(-BIN_NS / corr_ns)
    x, out = rng.gauss(0, sd), []
    for t in range(bins):
        x = x * rho + sd * math.sqrt(1 - rho * rho) * rng.gauss(0, 1)
        out.append(x + (common[t] if common else 0.0))
    return out


def test_fit_recovers_a_drift_under_kernel_noise_and_a_common_part():
    rng = random.Random(7)
    common = ou_series(rng, 0.3, 500_000_000, 4000)  # the whole machine: delays no rank
    series = [[v + rng.gauss(0, 0.05) for v in ou_series(rng, 0.1, 200_000_000, 4000, common)]
              for _ in range(2)]
    sd, corr_ns = fit_rank_noise(series, BIN_NS)
    assert abs(sd - 0.1) < 0.015, sd
    # the correlation time is the rougher estimate: over seeds 0-7 of this 40 s series
    # it came out at 132-284 ms
    assert 100_000_000 < corr_ns < 300_000_000, corr_ns


def test_no_drift_of_one_rank_against_another():
    rng = random.Random(3)
    common = ou_series(rng, 0.2, 300_000_000, 400)
    assert fit_rank_noise([common, list(common), list(common)], BIN_NS) == (0.0, 0)
    # kernel-to-kernel noise alone is not drift: lags past 0 carry (almost) nothing
    sd, _ = fit_rank_noise([[rng.gauss(0, 0.1) for _ in range(400)] for _ in range(2)], BIN_NS)
    assert sd < 0.03, sd


def test_too_short_a_series_finds_nothing():
    assert fit_rank_noise([[0.1, -0.1, 0.2], [-0.1, 0.1, -0.2]], BIN_NS) == (0.0, 0)


def test_stalls_are_the_calls_over_the_median():
    # 129 calls of 1000 ns (the median), 64 of them stalled: 32 by 10 ns, 32 by 1000 ns
    times = [1000] * 65 + [1010] * 32 + [2000] * 32
    rate, lengths = fit_rank_stalls(times)
    assert rate == pytest.approx(64 / (129 * 1000) * 1e9)  # per second of undisturbed work
    assert lengths == [10.0] * 16 + [1000.0] * 16 and len(lengths) == STALL_SLICES
    # the lengths keep the stalls' mean: loss = rate x mean length = stall time / work
    assert rate * sum(lengths) / len(lengths) / 1e9 == pytest.approx((32 * 10 + 32 * 1000) / 129_000)
    assert fit_rank_stalls([500] * 9) == (0.0, [])
    rate, lengths = fit_rank_stalls([100, 100, 100, 400])  # fewer stalls than slices: the one there is
    assert rate == pytest.approx(1 / 400 * 1e9) and lengths == [300] * STALL_SLICES


def test_ranks_stalls_pooled():
    a = (100.0, [1.0] * STALL_SLICES)
    b = (300.0, [3.0] * STALL_SLICES)
    assert pool_rank_stalls([a, b]) == (200.0, [2.0] * STALL_SLICES)
    assert pool_rank_stalls([a, (0.0, [])]) == (50.0, [1.0] * STALL_SLICES)  # the rate over every rank
    assert pool_rank_stalls([(0.0, []), (0.0, [])]) == (0.0, [])
