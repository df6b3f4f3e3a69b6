"""Fitting the ranks' speed drift (up to two OU processes whose window variances come back)
and their stalls (each call over the median is a stall of the difference)."""

import math
import random

import pytest

from commsim.hardware.noise import (STALL_SLICES, expected_window_var, fit_rank_drift, fit_rank_stalls,
                                   mean_rank_drift, ou_window_var, pool_rank_stalls, window_variances)

BIN_NS = 10_000_000


def ou_series(rng, sd, corr_ns, bins, common=None):
    rho = math.exp(-BIN_NS / corr_ns)
    x, out = rng.gauss(0, sd), []
    for t in range(bins):
        x = x * rho + sd * math.sqrt(1 - rho * rho) * rng.gauss(0, 1)
        out.append(x + (common[t] if common else 0.0))
    return out


def window_sd_of(comps, window_bins, n=2):
    """A rank's sd (its part not common to the n ranks) over a window, with the fit's
    formula but no span (an infinitely long series)."""
    return math.sqrt((1 - 1 / n) * sum(ou_window_var(sd, c / BIN_NS, window_bins) for sd, c in comps))


def test_fit_recovers_two_drifts_under_kernel_noise_and_a_common_part():
    """A fast (60 ms) and a slow (1.5 s) drift under each bin's kernel noise and a
    whole-machine part: the fit finds two components, the faster below 200 ms and the
    slower above 500 ms, whose window sds match the true ones within 15% from 10 ms to
    4 s. (The components' own sds and times trade against each other: over seeds 0-7
    of this 160 s series the slow one's time came out at 0.8-3 s.)"""
    rng = random.Random(7)
    bins = 16_000
    common = ou_series(rng, 0.3, 500_000_000, bins)  # the whole machine: delays no rank
    series = [[f + sl + c + rng.gauss(0, 0.03) for f, sl, c in
               zip(ou_series(rng, 0.06, 60_000_000, bins), ou_series(rng, 0.05, 1_500_000_000, bins), common)]
              for _ in range(2)]
    comps = fit_rank_drift(series, BIN_NS)
    assert len(comps) == 2 and comps[0][1] < 200_000_000 < 500_000_000 < comps[1][1], comps
    truth = ((0.06, 60_000_000), (0.05, 1_500_000_000))
    for w in (1, 10, 100, 400):
        assert window_sd_of(comps, w) == pytest.approx(window_sd_of(truth, w), rel=0.15), w


def test_fit_of_one_drift_matches_its_window_sds():
    rng = random.Random(3)
    series = [[v + rng.gauss(0, 0.05) for v in ou_series(rng, 0.1, 200_000_000, 16_000)] for _ in range(2)]
    comps = fit_rank_drift(series, BIN_NS)
    truth = ((0.1, 200_000_000),)
    for w in (1, 10, 100):
        assert window_sd_of(comps, w) == pytest.approx(window_sd_of(truth, w), rel=0.15), w


def test_the_window_variances_and_their_expectation():
    # two ranks, one +1 / -1 in alternate windows of 2 bins, the other its mirror: the
    # common part is 0, each rank's deviation is +-1 over 2-bin windows
    a = [1.0, 1.0, -1.0, -1.0] * 4
    got = dict(window_variances([a, [-x for x in a]]))
    assert got[1] == 1.0 and got[2] == 1.0 and 5 not in got  # 3 windows of 5 bins: too few
    # the expectation: an OU process's window variance less its span's, and white noise over w
    assert expected_window_var(4, 4, 2, [(0.1, 1e9)], 0.0) == pytest.approx(0.5 * (0.01 - 0.01), abs=1e-6)
    assert expected_window_var(2, 8, 2, [], 1.0) == pytest.approx(0.5 * (1 / 2 - 1 / 16))
    assert ou_window_var(0.1, 1.0, 1e-6) == pytest.approx(0.01, rel=1e-4)  # a short window: the variance
    assert ou_window_var(0.1, 1.0, 1e6) == pytest.approx(0.01 * 2 / 1e6, rel=1e-4)  # long: 2 tau / T of it


def test_no_drift_of_one_rank_against_another():
    rng = random.Random(3)
    common = ou_series(rng, 0.2, 300_000_000, 400)
    assert fit_rank_drift([common, list(common), list(common)], BIN_NS) == ()
    # kernel-to-kernel noise alone is not drift: it is the bin-to-bin noise of the fit
    comps = fit_rank_drift([[rng.gauss(0, 0.1) for _ in range(1600)] for _ in range(2)], BIN_NS)
    assert window_sd_of(comps, 1) < 0.03, comps


def test_too_short_a_series_finds_nothing():
    assert fit_rank_drift([[0.1, -0.1, 0.2] * 3, [-0.1, 0.1, -0.2] * 3], BIN_NS) == ()


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


def test_two_fits_average_by_their_window_variances():
    """Two calibrations around a run: one found a fast component only, the other a fast
    and a slow one. Their mean has the mean window variances, within the fit's grid;
    averaging the components position by position would pair the first's fast
    component with the second's slow one."""
    a = ((0.10, 30_000_000),)
    b = ((0.05, 30_000_000), (0.08, 400_000_000))
    m = mean_rank_drift(a, b)
    assert mean_rank_drift(a, a) == a and mean_rank_drift((), ()) == ()

    def window_sd(comps, window_ns):
        return math.sqrt(sum(ou_window_var(sd, corr, window_ns) for sd, corr in comps))

    for window_ns in (10e6, 100e6, 1e9, 4e9):
        want = math.sqrt((window_sd(a, window_ns) ** 2 + window_sd(b, window_ns) ** 2) / 2)
        assert window_sd(m, window_ns) == pytest.approx(want, rel=0.05)
    positional = ((0.075, 30_000_000), (0.04, 200_000_000))  # what a field-by-field mean gave
    assert window_sd(positional, 1e9) < 0.8 * window_sd(m, 1e9)
    # one calibration found no drift: half the other's variance
    half = mean_rank_drift(a, ())
    assert window_sd(half, 100e6) == pytest.approx(window_sd(a, 100e6) / math.sqrt(2), rel=0.05)


def test_a_mean_profile_refits_the_drift():
    from commsim.hardware.profile_doc import mean_profile
    from tests.hardware.test_costs import PROFILE

    before = {**PROFILE, "rank_noise": {"sd": 0.10, "corr_ns": 30_000_000, "slow_sd": 0.0, "slow_corr_ns": 0}}
    after = {**PROFILE, "rank_noise": {"sd": 0.05, "corr_ns": 30_000_000, "slow_sd": 0.08, "slow_corr_ns": 400_000_000}}
    noise = mean_profile(before, after)["rank_noise"]
    fit = mean_rank_drift(((0.10, 30_000_000),), ((0.05, 30_000_000), (0.08, 400_000_000)))
    assert [(noise["sd"], noise["corr_ns"]), (noise["slow_sd"], noise["slow_corr_ns"])][:len(fit)] == list(fit)
    assert mean_profile(before, before)["rank_noise"] == before["rank_noise"]
