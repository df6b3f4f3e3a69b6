"""Fitting the ranks' speed drift and stalls from a measurement (pure; calibrate
supplies the data).

Each rank ran the same kernel back to back; ``series[r][t]`` is the mean log of its
kernel times over their median, in time bin ``t``. The common part of all ranks (the
whole machine faster or slower for a while) delays no rank relative to another, so it
is removed: what is left is each rank's own drift plus the kernel-to-kernel noise of
the bin. The drift is modelled as the sum of up to two independent Ornstein-Uhlenbeck
processes (as the simulator runs it: a fast one of tens to hundreds of milliseconds,
and a slow one of seconds where the machine has it), fitted to the variance of the
ranks' means over windows of 10 ms to 4 s (``fit_rank_drift``), the quantity that sets
how far apart two ranks reach a synchronisation.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

# the equally likely stall lengths a profile keeps (RankStalls.lengths_ns)
STALL_SLICES = 32


def binned_log_series(starts_ns: Sequence[int], times_ns: Sequence[int], bin_ns: int, span_ns: int) -> list[float]:
    """One rank's series for ``fit_rank_drift``: per time bin, the mean log of the times
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


# Windows (in bins) over which the ranks' drift is measured: from one bin to a few
# seconds of 10 ms bins. What a drift does to a step is set by how far two ranks' mean
# speeds differ over the stretch of work between two synchronisations, so the fit
# matches these windows' variances, not the autocovariance at a few lags: on the
# development VM a fit to 4 s at lags of 10-300 ms under-predicted the sd of two
# ranks' mean speed difference over 0.5-3 s windows by 2x (bench/rank_drift.py).
DRIFT_WINDOWS = (1, 2, 5, 10, 20, 50, 100, 200, 400)
# A window is fitted only where the series holds at least this many of it.
MIN_WINDOWS = 4
# Window variances at most this (an sd of 1e-6) are no drift: the ranks ran alike.
NO_DRIFT_VAR = 1e-12
# The correlation times tried (bins): a log grid, 12 a decade.
_TAUS = tuple(10 ** (k / 12) for k in range(0, 49))


def ou_window_var(sd: float, corr: float, window: float) -> float:
    """The variance of an OU process's mean over a window (``corr`` and ``window`` in
    one unit): 2 sd^2 (tau / T)^2 (T / tau - 1 + exp(-T / tau))."""
    if sd <= 0 or corr <= 0 or window <= 0:
        return 0.0
    x = window / corr
    return 2 * sd * sd * (x + math.expm1(-x)) / (x * x)  # expm1: exact where x is tiny


def window_variances(series: Sequence[Sequence[float]]) -> list[tuple[int, float]]:
    """(window in bins, variance) for each of DRIFT_WINDOWS the series holds
    MIN_WINDOWS of: the variance of the means of consecutive windows of each rank's
    series less the ranks' common part, the mean over the ranks. Only the whole
    windows from the start are used, so that they tile a span exactly (the fit's
    expectation of the variance about their mean is then exact)."""
    n, m = len(series), len(series[0])
    assert n >= 2, "needs two ranks' series"
    assert all(len(s) == m for s in series), "every rank's series has the same bins"
    common = [sum(s[t] for s in series) / n for t in range(m)]
    dev = [[s[t] - common[t] for t in range(m)] for s in series]
    out = []
    for w in DRIFT_WINDOWS:
        k = m // w
        if k < MIN_WINDOWS:
            break
        var = 0.0
        for d in dev:
            means = [sum(d[i * w:(i + 1) * w]) / w for i in range(k)]
            mu = sum(means) / k
            var += sum((x - mu) ** 2 for x in means) / k
        out.append((w, var / n))
    return out


def expected_window_var(w: int, k: int, n: int, comps: Sequence[tuple[float, float]], white: float) -> float:
    """The expected variance ``window_variances`` measures for a window of ``w`` bins,
    ``k`` windows, ``n`` ranks, each rank's drift the sum of independent OU components
    ``comps`` ((sd, correlation in bins)) plus a bin-to-bin noise of variance ``white``
    (the kernels' own jitter, averaged in each bin): a rank's part not common to all is
    (1 - 1/n) of its variance, and the windows' own mean is removed (the variance of the
    mean over the k windows' span)."""
    span = w * k
    var = sum(ou_window_var(sd, tau, w) - ou_window_var(sd, tau, span) for sd, tau in comps)
    return (1 - 1 / n) * (var + white * (1 / w - 1 / span))


def _nonneg_lsq(cols: list[list[float]], y: list[float]) -> tuple[list[float], float]:
    """Least squares of y on the columns with every coefficient >= 0 (few columns: every
    subset solved unconstrained, the best feasible one kept). (coefficients, residual)."""
    best: tuple[list[float], float] = ([0.0] * len(cols), sum(v * v for v in y))
    for mask in range(1, 1 << len(cols)):
        idx = [j for j in range(len(cols)) if mask >> j & 1]
        a = [[sum(cols[i][t] * cols[j][t] for t in range(len(y))) for j in idx] for i in idx]
        b = [sum(cols[i][t] * y[t] for t in range(len(y))) for i in idx]
        coef = _solve(a, b)
        if coef is None or any(c < 0 for c in coef):
            continue
        full = [0.0] * len(cols)
        for j, c in zip(idx, coef):
            full[j] = c
        res = sum((y[t] - sum(full[j] * cols[j][t] for j in range(len(cols)))) ** 2 for t in range(len(y)))
        if res < best[1]:
            best = (full, res)
    return best


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_rank_drift(series: Sequence[Sequence[float]], bin_ns: int) -> tuple[tuple[float, int], ...]:
    """Each rank's speed drift as up to two independent OU components, ((sd, correlation
    ns), ...), fastest first; () when no drift is found. Fitted to the variances of the
    ranks' window means (``window_variances``) in relative least squares: for each
    pair of correlation times on a log grid (the slower at least 2x the faster, at most
    a quarter of the series), the components' variances and a bin-to-bin noise are the
    non-negative least-squares solution (``expected_window_var``); the best pair wins.
    A component whose variance comes out 0 is dropped; the bin-to-bin noise is the
    kernels' own jitter, left to the stall fit and the simulator's jitter."""
    n, m = len(series), len(series[0])
    assert bin_ns > 0, "needs a bin width"
    return _fit_window_vars(window_variances(series), m, n, bin_ns)


def _fit_window_vars(measured: list[tuple[int, float]], m: int, n: int, bin_ns: int) -> tuple[tuple[float, int], ...]:
    """``fit_rank_drift``'s fit of window variances ``measured`` ((window in bins,
    variance)) of ``n`` ranks' series of ``m`` bins."""
    if len(measured) < 3 or min(v for _, v in measured) <= NO_DRIFT_VAR:
        return ()
    taus = [t for t in _TAUS if t <= m / MIN_WINDOWS]  # longer is the series' own mean
    y = [1.0] * len(measured)  # relative: each model value over its measurement
    best: tuple[float, tuple[tuple[float, int], ...]] | None = None
    for i, fast in enumerate(taus):
        for slow in [None] + [t for t in taus[i + 1:] if t >= 2 * fast]:
            comps = [fast] if slow is None else [fast, slow]
            cols = [[expected_window_var(w, m // w, n, [(1.0, tau)], 0.0) / v for w, v in measured] for tau in comps]
            cols.append([expected_window_var(w, m // w, n, [], 1.0) / v for w, v in measured])
            coef, res = _nonneg_lsq(cols, y)
            if best is None or res < best[0] - 1e-12:
                found = tuple((math.sqrt(a), int(tau * bin_ns)) for a, tau in zip(coef, comps) if a > 0)
                best = (res, found)
    assert best is not None
    return best[1]


# Two fits averaged (``mean_rank_drift``) are matched over calibrate's windows: 10 ms
# bins over 16 s, two ranks.
MEAN_BIN_NS = 10_000_000
MEAN_SPAN_BINS = 1600


def mean_rank_drift(a: Sequence[tuple[float, int]], b: Sequence[tuple[float, int]]) -> tuple[tuple[float, int], ...]:
    """The drift between two fits' ((sd, correlation ns), ...: two calibrations around a
    run): the fit (``fit_rank_drift``'s) of the mean of their expected window
    variances over calibrate's windows. Averaging the components position by position
    would blend one fit's fast component with the other's slow one where a second
    component appeared or the two swapped roles; what each fit stands for is its window
    variances. Equal fits are their own mean."""
    if tuple(a) == tuple(b):
        return tuple(a)
    m, n = MEAN_SPAN_BINS, 2

    def curve(comps: Sequence[tuple[float, int]]) -> list[float]:
        in_bins = [(sd, corr / MEAN_BIN_NS) for sd, corr in comps if sd > 0 and corr > 0]
        return [expected_window_var(w, m // w, n, in_bins, 0.0) for w in DRIFT_WINDOWS if m // w >= MIN_WINDOWS]

    windows = [w for w in DRIFT_WINDOWS if m // w >= MIN_WINDOWS]
    mean = [(w, (x + y) / 2) for w, x, y in zip(windows, curve(a), curve(b))]
    return _fit_window_vars(mean, m, n, MEAN_BIN_NS)


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
