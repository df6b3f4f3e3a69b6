"""Fitting the ranks' speed drift and stalls from a measurement (pure; calibrate
supplies the data).

Each rank ran the same kernel back to back; ``series[r][t]`` is the mean log of its
kernel times over their median, in time bin ``t``. The common part of all ranks (the
whole machine faster or slower for a while) delays no rank relative to another, so it
is removed: what is left is each rank's own drift plus the kernel-to-kernel noise of
the bin. Modelled as an Ornstein-Uhlenbeck process (as the simulator runs it), the
drift's autocovariance at lag k >= 1 is sd^2 (1 - 1/n) rho^k; the per-kernel noise only
adds to lag 0, so the fit uses lags 1 and up: a least-squares line through
log C(k), k = 1 .. the last lag before the covariance first drops to zero (at most
``max_lag``). Its intercept gives sd, its slope the correlation time.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

# the equally likely stall lengths a profile keeps (RankStalls.lengths_ns)
STALL_SLICES = 32


def binned_log_series(starts_ns: Sequence[int], times_ns: Sequence[int], bin_ns: int, span_ns: int) -> list[float]:
    """One rank's series for ``fit_rank_noise``: per time bin, the mean log of the times
    of the kernels started in it over their median; a bin where no kernel started (the
    rank descheduled) repeats the previous bin's value."""
    assert starts_ns and len(starts_ns) == len(times_ns), "needs the kernels' starts and times"
    med = statistics.median(times_ns)
    nbins = max(1, span_ns // bin_ns)
    sums, counts = [0.0] * nbins, [0] * nbins
    for st, dt in zip(starts_ns, times_ns):
        b = min(st // bin_ns, nbins - 1)
        sums[b] += math.log(dt / med)
        counts[b] += 1
    out, last = [], 0.0
    for sm, c in zip(sums, counts):
        last = sm / c if c else last
        out.append(last)
    return out


def fit_rank_noise(series: Sequence[Sequence[float]], bin_ns: int, max_lag: int = 30) -> tuple[float, int]:
    """(sd of a rank's log speed, correlation time ns); (0, 0) when no correlated drift
    is found (fewer than two positive lags). A slope that does not decay within the
    fit's lags gives the length of the series as the correlation time (a lower bound)."""
    n = len(series)
    assert n >= 2 and bin_ns > 0, "needs two ranks' series and a bin width"
    m = len(series[0])
    assert all(len(s) == m for s in series), "every rank's series has the same bins"
    common = [sum(s[t] for s in series) / n for t in range(m)]
    dev = []
    for s in series:
        d = [s[t] - common[t] for t in range(m)]
        mean = sum(d) / m
        dev.append([x - mean for x in d])
    lags, logs = [], []
    for k in range(1, min(max_lag, m - 2) + 1):
        c = sum(d[t] * d[t + k] for d in dev for t in range(m - k)) / (n * (m - k))
        if c <= 0:
            break
        lags.append(k)
        logs.append(math.log(c))
    if len(lags) < 2:
        return 0.0, 0
    kx = sum(lags) / len(lags)
    ly = sum(logs) / len(logs)
    slope = sum((k - kx) * (y - ly) for k, y in zip(lags, logs)) / sum((k - kx) ** 2 for k in lags)
    intercept = ly - slope * kx
    sd = math.sqrt(math.exp(intercept) * n / (n - 1))
    length_ns = m * bin_ns
    return sd, min(int(-bin_ns / slope), length_ns) if slope < 0 else length_ns


def fit_rank_stalls(times_ns: Sequence[float]) -> tuple[float, list[float]]:
    """One rank's stalls, from its times of one kernel run back to back: each time over
    the median is that kernel's undisturbed time (the median) plus a stall of the
    difference, which the drift's fit leaves out (it keeps only what is correlated over
    bins of many kernels). Returns (stalls per second of undisturbed work, the means of
    STALL_SLICES equal slices of the sorted stall lengths, ns: equally likely values
    that keep the stalls' mean); (0, []) without stalls."""
    assert times_ns, "needs the kernel's times"
    med = statistics.median(times_ns)
    excess = sorted(t - med for t in times_ns if t > med)
    work_ns = sum(times_ns) - sum(excess)
    if not excess or work_ns <= 0:
        return 0.0, []
    n = len(excess)
    lengths = []
    for k in range(STALL_SLICES):
        chunk = excess[k * n // STALL_SLICES:(k + 1) * n // STALL_SLICES]
        # fewer stalls than slices: the stall at the slice's middle
        lengths.append(sum(chunk) / len(chunk) if chunk else excess[min(n - 1, (2 * k + 1) * n // (2 * STALL_SLICES))])
    return n / work_ns * 1e9, lengths


def pool_rank_stalls(per_rank: Sequence[tuple[float, Sequence[float]]]) -> tuple[float, list[float]]:
    """Every rank's (rate, lengths) as one process: the mean rate over the ranks, each
    slice's mean length over the ranks that stalled; (0, []) when none did."""
    assert per_rank, "needs at least one rank"
    stalled = [lengths for _, lengths in per_rank if lengths]
    if not stalled:
        return 0.0, []
    assert all(len(x) == STALL_SLICES for x in stalled), "every rank's lengths have STALL_SLICES values"
    rate = sum(r for r, _ in per_rank) / len(per_rank)
    return rate, [sum(x[k] for x in stalled) / len(stalled) for k in range(STALL_SLICES)]
