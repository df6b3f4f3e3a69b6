"""How ``runtime.ds_host_costs`` times routines: per-call thread CPU time with counts of
what each call did, each call's minimum over the steps, a least-squares fit of time over
the counts, and counters wrapped around a release's gather, queue and wait paths."""

from __future__ import annotations

import collections
import platform
import statistics
import time
import types
import warnings
from pathlib import Path

# ---------------------------------------------------------------- timing

# The calling thread's CPU time: what the routine itself costs, even while other
# processes on this (shared) machine take the core away from it now and then.
clock = time.thread_time_ns


class Recorder:
    """Per-call times and counts of wrapped routines, per step."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[int, dict[str, int]]]] = collections.defaultdict(list)
        self.counts: collections.Counter = collections.Counter()
        self.exclude_ns = 0

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] += n

    def wrap(self, name: str, fn, features):
        """A wrapper timing ``fn``; ``features(args)`` gives counts known before the call
        (the counters bumped inside add the rest). Nested timed calls are excluded from
        the outer one (a flush inside a gradient hook is timed as a flush)."""
        rec = self

        def timed(*args, **kwargs):
            outer_counts, outer_excl = rec.counts, rec.exclude_ns
            rec.counts = collections.Counter(features(args) if features else {})
            rec.exclude_ns = 0
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                rec.calls[name].append((dt - rec.exclude_ns, dict(rec.counts)))
                rec.counts, rec.exclude_ns = outer_counts, outer_excl + dt

        return timed

    def reset(self) -> None:
        self.calls.clear()


def min_over_steps(per_step: list[dict[str, list]]) -> dict[str, list[tuple[int, dict[str, int]]]]:
    """Each call's minimum time over the steps (calls repeat in the same order with the
    same counts in every steady-state step)."""
    out = {}
    for name in per_step[0]:
        runs = [s[name] for s in per_step if len(s.get(name, ())) == len(per_step[0][name])]
        out[name] = [(min(r[i][0] for r in runs), runs[0][i][1]) for i in range(len(runs[0]))]
    return out


def fit(calls: list[tuple[int, dict[str, int]]], features: list[str], relative: bool = False) -> dict:
    """Least squares: time = fixed + sum(coef x count), coefficients kept >= 0 (a
    negative one is dropped and the rest refitted). ``relative``: each call's residual
    relative to its time (weights 1 / time), for calls whose times span orders of
    magnitude: this machine's speed drifts by a factor (10-30% between processes), so
    an absolute fit lets the largest calls' drift swamp the small calls' fixed cost."""
    import numpy as np

    names = list(features)
    y = np.array([float(t) for t, _ in calls])
    w = 1.0 / np.maximum(y, 1.0) if relative else np.ones_like(y)
    intercept = True
    while True:
        X = np.array([([1.0] if intercept else []) + [float(c.get(f, 0)) for f in names] for _, c in calls])
        coef, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
        if intercept and coef[0] < 0 and names:
            intercept = False
            continue
        neg = [f for f, v in zip(names, coef[1 if intercept else 0:]) if v < 0]
        if not neg:
            break
        names = [f for f in names if f not in neg]
    pred = X @ coef
    if not intercept:
        coef = np.concatenate([[0.0], coef])
    resid = y - pred
    out = {"fixed_ns": round(float(coef[0])), "calls": len(calls),
           "median_call_ns": round(float(np.median(y))),
           "rms_residual_ns": round(float(np.sqrt(np.mean(resid ** 2)))),
           "r2": round(float(1 - np.sum(resid ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-9)), 3)}
    for f in features:
        out[f"per_{f}_ns"] = round(float(coef[1 + names.index(f)])) if f in names else 0
    out["total_counts"] = {f: int(sum(c.get(f, 0) for _, c in calls)) for f in features}
    return out


def time_call(fn, n: int = 20000, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean time of ``n`` calls, in ns."""
    for _ in range(n // 10):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(n):
            fn()
        runs.append((clock() - t0) / n)
    return statistics.median(runs)


# Views torch.chunk is timed making (against 2): enough that the per-view cost is 99% of
# the call (about 0.19 ms here), so its minimum is good to ~1%.
CHUNK_VIEWS = 512


def primitives(torch, world: int) -> dict:
    """One small PyTorch op's dispatch, one c10d collective call on the fake backend, and
    ``torch.chunk``'s cost per view: DeepSpeed's bucket flush chunks its flat buffer into
    one view per rank once per flush (reduce_scatter_coalesced), its only per-rank work
    that does not also grow with the gradients. Timed alone, it is a stable figure (three
    processes within 1%, 0.37 us here); fitted as the flush's per-rank intercept it was
    not (the sweep's one-gradient calls take a path without the rank loop: 0.21-0.30 us,
    39% apart over three calibrations)."""
    import torch.distributed as dist

    x = torch.zeros(256)
    # the fake backend's world, or (torch 1.x: ds_host_setup.fake_world) a real one-rank
    # gloo group under torch 1.x's name for the call
    fake = dist.get_backend() == "fake"
    gather = dist.all_gather_into_tensor if hasattr(dist, "all_gather_into_tensor") else dist._all_gather_base
    y = torch.zeros((world if fake else 1) * 4)
    z = torch.zeros(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c10d = time_call(lambda: gather(y, z, async_op=True), n=2000)
    flat = torch.zeros(CHUNK_VIEWS * 64)
    chunk = (time_call(lambda: torch.chunk(flat, CHUNK_VIEWS), n=500)
             - time_call(lambda: torch.chunk(flat, 2), n=500)) / (CHUNK_VIEWS - 2)
    return {"torch_op_ns": round(time_call(lambda: x.mul_(1.0))),
            "torch_empty_ns": round(time_call(lambda: torch.empty(256))),
            "c10d_all_gather_ns": round(c10d),
            "chunk_view_ns": round(chunk)}


def count_gathers(model, rec: Recorder) -> None:
    """Count the parameters each ``all_gather_coalesced`` call gathers (every parameter's
    bound method wrapped; the call itself unchanged)."""
    for _, p in model.named_parameters():
        f = p.all_gather_coalesced

        def agc(params, *a, _f=f, **k):
            params = list(params)
            rec.count("gathered", len(params))
            return _f(params, *a, **k)

        p.all_gather_coalesced = agc


def count_queue_pops(module, rec: Recorder) -> None:
    """Count the trace-queue pops of a release's coordinator ``module``: its ``collections``
    name replaced by a copy whose deque counts ``popleft`` (the module's own code is
    untouched, and other modules keep the real deque)."""
    base = collections.deque

    class CountingDeque(base):
        def popleft(self):
            rec.count("scanned")
            return base.popleft(self)

    module.collections = types.SimpleNamespace(**{k: getattr(collections, k) for k in dir(collections)
                                                  if not k.startswith("__")})
    module.collections.deque = CountingDeque


def count_waits(pp, rec: Recorder) -> None:
    """Count the parameters whose gather a fetch completes: a coalesced handle's first
    wait() unflattens each of its parameters (a loop over the ranks each), so that cost
    falls on the fetch that waits, not on the one that gathered."""
    for cls_name in ("AllGatherCoalescedHandle", "AllGatherHandle"):
        cls = getattr(pp, cls_name, None)
        if cls is None or getattr(cls.wait, "_counted", False):
            continue
        orig = cls.wait

        def wait(self, *a, _orig=orig, _name=cls_name, **k):
            done = getattr(self, "complete", None)
            if done is None:
                done = getattr(self, f"_{_name}__complete", False)
            if not done:
                params = getattr(self, "params", None) or getattr(self, f"_{_name}__params", None)
                rec.count("waited", len(params) if params is not None else 1)
            return _orig(self, *a, **k)

        wait._counted = True
        cls.wait = wait


def cpu_name() -> str:
    """This machine's CPU as /proc/cpuinfo names it (the measurements' context)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    fields = {}
    for line in info:
        k, _, v = line.partition(":")
        fields.setdefault(k.strip(), v.strip())
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model "
            f"{fields.get('model', '?')}, {fields.get('cpu MHz', '?')} MHz)")
