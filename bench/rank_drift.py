"""How far two ranks' speeds drift apart over seconds, against what calibrate's drift fit says.

    python bench/rank_drift.py                  # two processes, one a core, 40 s of GEMMs
    python bench/rank_drift.py --seconds 20 --size 256

Each process (pinned to a core of its own where there are enough) runs the GEMM that
calibrate's drift measurement runs (``runtime.calibrate_cpu.rank_noise``: 256^3 fp32,
one thread) back to back for ``--seconds``, all starting together. Their calls are
binned as calibrate bins them (the mean log time over the median, 10 ms bins) and
fitted with calibrate's fit (``commsim.hardware.noise.fit_rank_drift``: up to two OU
components) twice: over the first 16 s (what a full calibration measures) and over the
whole span. Then, for windows from 0.1 s to 3 s, the standard deviation of the two
ranks' mean log-speed difference over each window, measured and as each fit predicts
it (``drift_window_sd``): what decides how far apart two ranks reach a
synchronisation after that much work. Last, the 1 s means of the difference, where a
stretch of one core running slower for seconds shows. Figures from this machine are in
traces/README.md ("The communication split into the collectives' own time and the waits
for peers").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from commsim.hardware.noise import binned_log_series, fit_rank_drift, ou_window_var  # noqa: E402

CALIBRATE_SPAN_NS = 16_000_000_000  # a full calibration's drift span (runtime/calibrate_cpu.py)
WINDOWS_S = (0.1, 0.5, 1.0, 1.5, 3.0)

_WORKER = r"""
import json, os, sys, time, torch
torch.set_num_threads(1)
core, size, span_ns, start_at, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
if core >= 0:
    os.sched_setaffinity(0, {core})
a, b, c = torch.randn(size, size), torch.randn(size, size), torch.empty(size, size)
for _ in range(10):
    torch.mm(a, b, out=c)
while time.time() < start_at:
    pass
starts, times = [], []
t0 = time.perf_counter_ns()
while True:
    t = time.perf_counter_ns()
    if t - t0 >= span_ns:
        break
    torch.mm(a, b, out=c)
    starts.append(t - t0)
    times.append(time.perf_counter_ns() - t)
json.dump({"starts": starts, "times": times}, open(out, "w"))
"""


def drift_window_sd(comps: Sequence[tuple[float, int]], window_ns: float) -> float:
    """The sd of the difference of two independent ranks' log-speed drifts, each the sum
    of the OU components ``comps`` ((sd, correlation ns)), averaged over a window: twice
    one rank's window variance (``commsim.hardware.noise.ou_window_var``)."""
    return math.sqrt(2 * sum(ou_window_var(sd, corr, window_ns) for sd, corr in comps))


def window_sd(diff: Sequence[float], bins: int) -> float:
    """The sd of the means of consecutive, non-overlapping windows of ``bins`` values."""
    assert bins >= 1
    means = [sum(diff[i:i + bins]) / bins for i in range(0, len(diff) - bins + 1, bins)]
    return statistics.pstdev(means) if len(means) > 1 else 0.0


def measure(seconds: float, size: int, ranks: int) -> list[dict[str, list[int]]]:
    """Every process's call starts and times (ns), the processes started together."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    start_at = time.time() + 5.0  # after every process has imported torch and warmed up
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(ranks)]
        procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(r if ranks <= cores else -1), str(size),
                                   str(int(seconds * 1e9)), repr(start_at), str(out)])
                 for r, out in enumerate(outs)]
        for p in procs:
            if p.wait() != 0:
                sys.exit(f"rank_drift: a worker failed (exit {p.returncode})")
        return [json.loads(o.read_text()) for o in outs]


def report(calls: list[dict[str, list[int]]], seconds: float) -> None:
    span_ns = int(seconds * 1e9)
    fits = {}
    for name, span in (("calibrate's: first 16 s", min(span_ns, CALIBRATE_SPAN_NS)), ("the whole span", span_ns)):
        # the calls started within the fitted span alone, as calibrate sees them (its median too)
        series = [binned_log_series(*zip(*[(st, dt) for st, dt in zip(c["starts"], c["times"]) if st < span]),
                                    10_000_000, span) for c in calls]
        fits[name] = fit_rank_drift(series, 10_000_000)
        print(f"fit, {name}: " + (", ".join(f"sd {sd:.1%} correlation {corr / 1e6:.0f} ms" for sd, corr in fits[name])
                                  or "no drift"))
    for r, c in enumerate(calls):
        print(f"rank {r}: {len(c['times'])} calls, median {statistics.median(c['times']) / 1e3:.0f} us")
    s10 = [binned_log_series(c["starts"], c["times"], 10_000_000, span_ns) for c in calls]
    diff = [a - b for a, b in zip(s10[0], s10[1])]
    print(f"{'window':>8}{'measured':>10}" + "".join(f"{n.split(':')[0][:22]:>24}" for n in fits))
    for w in WINDOWS_S:
        bins = int(round(w * 100))
        if bins * 2 > len(diff):
            continue
        print(f"{w:>7.1f}s{window_sd(diff, bins):>10.3f}"
              + "".join(f"{drift_window_sd(comps, w * 1e9):>24.3f}" for comps in fits.values()))
    print("1 s means of rank 0's log speed over rank 1's: "
          + " ".join(f"{sum(diff[i:i + 100]) / 100:+.2f}" for i in range(0, len(diff) - 99, 100)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="how long each process runs its GEMMs (default 40)")
    ap.add_argument("--size", type=int, default=256, help="the GEMM's side (default 256, calibrate's)")
    args = ap.parse_args()
    if args.seconds < 8:
        ap.error(f"--seconds {args.seconds}: at least 8 (two windows of the longest, 3 s)")
    if args.size < 16:
        ap.error(f"--size {args.size}: at least 16")
    report(measure(args.seconds, args.size, 2), args.seconds)


if __name__ == "__main__":
    main()
