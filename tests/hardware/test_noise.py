"""Fitting the ranks' speed drift: an OU process's sd and correlation time come back."""

import math
import random

from commsim.hardware.noise import fit_rank_noise

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
