"""What only a CPU platform's calibration measures: the cores a rank may run on, the
OS time slice when a node has more ranks than cores, how each rank's speed drifts
apart from the others' when it has a core of its own, the last-level cache's size and
the memory-bound kernel's rate on data in it, and how much slower Python runs right
after a blocking collective than back to back.

Each measurement runs on every rank at once (a collective gathers or agrees on the
result) and returns None where it does not apply: on platforms whose kernels are queued
on a GPU, and where the cores are not shared (time slice) or are (drift). Times in ns.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from commsim.hardware.noise import (STALL_SLICES, binned_log_series, fit_rank_drift, fit_rank_stalls,
                                    pool_rank_stalls)
from commsim.hardware.platform import RankStalls
from commsim.ir import ops as O
from runtime.kernels import last_level_cache_bytes

if TYPE_CHECKING:
    from runtime.calibrate import Calibrator


def cpu_cores() -> int:
    """Cores this process (and the ranks started like it) may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rank_noise(cal: Calibrator, cores: int) -> tuple[dict[str, float] | None, dict[str, object] | None]:
    """How each rank's speed drifts on its own, and how it stalls (CPU backends, at most
    one rank per core): every rank runs the same GEMM back to back for a few seconds;
    the mean log time over the median, in 10 ms bins, is gathered and fitted as up to
    two OU processes by the variances of its window means (``fit_rank_drift``), and
    each call over the median is a stall of the difference
    (commsim.hardware.noise). (profile's ``rank_noise``, ``rank_stalls``); (None, None)
    on GPUs (kernel times vary by ~1%, the simulator's default jitter), with more ranks
    than cores (the simulated time slicing is that noise) and with one rank (nothing
    to drift apart from, nobody to wait)."""
    if not cal.platform.inline_kernels or cal.ranks_per_node > cores or cal.world < 2:
        return None, None
    bin_ns = 10_000_000
    # 16 s: windows of up to 4 s, four of them, where a core's slow stretches of seconds
    # show (a 4 s span's own mean took most of them away: bench/rank_drift.py)
    span_ns = 1_000_000_000 if cal.quick else 16_000_000_000
    op = O.Compute(O.OpId(0), "c", "", O.ComputeKind.GEMM, 2 * 256 ** 3, 0, 0, O.GemmShape(256, 256, 256, 1))
    for _ in range(10):
        cal.kernels.run(op)
    starts, times = [], []
    dist.barrier()
    t0 = time.perf_counter_ns()
    while True:
        t = time.perf_counter_ns()
        if t - t0 >= span_ns:
            break
        cal.kernels.run(op)
        starts.append(t - t0)
        times.append(time.perf_counter_ns() - t)
    med = statistics.median(times)
    series = binned_log_series(starts, times, bin_ns, span_ns)
    mine = torch.tensor(series, dtype=torch.float64, device=cal.device)  # on the group's device
    every = [torch.empty_like(mine) for _ in range(cal.world)]
    dist.all_gather(every, mine)
    comps = fit_rank_drift([e.tolist() for e in every], bin_ns)
    (sd, corr_ns), (slow_sd, slow_corr_ns) = (list(comps) + [(0.0, 0), (0.0, 0)])[:2]
    cal.log("ranks' speed drift: " + (" and ".join(f"sd {s:.1%}, correlation {c / 1e6:.0f} ms" for s, c in comps)
                                       or "none") + f" ({len(times)} GEMMs of {med / 1e6:.2f} ms on rank 0)")
    rate, lengths = fit_rank_stalls(times)
    mine = torch.tensor([rate] + (lengths or [0.0] * STALL_SLICES), dtype=torch.float64, device=cal.device)
    every = [torch.empty_like(mine) for _ in range(cal.world)]
    dist.all_gather(every, mine)
    rate, lengths = pool_rank_stalls([(e[0].item(), e[1:].tolist() if e[0].item() else []) for e in every])
    loss = RankStalls(rate, tuple(lengths)).loss
    cal.log(f"ranks' stalls: {rate:.0f} a second of work, mean {loss / rate * 1e9 / 1e3 if rate else 0:.0f} us, "
            f"longest slice {max(lengths, default=0) / 1e6:.2f} ms; {loss:.1%} of the time")
    noise = {"sd": sd, "corr_ns": corr_ns, "slow_sd": slow_sd, "slow_corr_ns": slow_corr_ns}
    return noise, {"rate_per_s": rate, "lengths_ns": [round(x) for x in lengths]}


def time_slice(cal: Calibrator, cores: int) -> int | None:
    """With more ranks than cores (CPU backends), how long the OS lets a rank run
    before another takes its core: every rank spins, noting each jump of its clock
    (a time it did not run); the median stretch between jumps is the slice."""
    if not cal.platform.inline_kernels or cal.world <= cores:
        return None
    runs: list[int] = []
    dist.barrier()
    last = start = time.perf_counter_ns()
    end = last + (300_000_000 if cal.quick else 1_000_000_000)
    while last < end:
        now = time.perf_counter_ns()
        if now - last > 200_000:  # descheduled: far longer than a loop iteration
            runs.append(last - start)
            start = now
        last = now
    med = statistics.median(runs[1:]) if len(runs) > 2 else 0
    slice_ns = int(cal.agree(float(med)))
    cal.log(f"OS time slice: {slice_ns / 1e6:.2f} ms ({cal.world} ranks on {cores} cores)")
    return slice_ns or None


def cache(cal: Calibrator) -> dict[str, float] | None:
    """The last-level cache (CPU backends): its size (Linux sysfs, as the executor's ring
    is sized) and the rate of the executor's memory-bound kernel on data in it, for the
    bytes an op reuses (``reuse_bytes``). Every rank runs the kernel at once, each
    over and over on one region of its own (the reused path of ``runtime.kernels
    .ring_step``), at a sixteenth and a quarter of its share of the cache (the ranks of
    a node share it): well inside it, and past a core's L2. The rate is the slope
    between the two, so the kernel's fixed cost (priced apart) is not in it. None on
    GPUs (their optimizers run foreach: nothing states reuse) and where the size is
    unknown. With them, ``python_cold_factor`` (``python_cold_factor()``)."""
    size = last_level_cache_bytes(cal.device)
    if not cal.platform.inline_kernels or not size:
        return None
    share = size // max(1, cal.ranks_per_node)
    pts = []
    for nbytes in (share // 16, share // 4):
        op = O.Compute(O.OpId(0), "c", "", O.ComputeKind.ELEMENTWISE, 0, nbytes // 2, nbytes // 2,
                       reuse_bytes=nbytes, working_set_bytes=nbytes)
        cal.kernels.run(op)  # brings the region in
        pts.append((float(nbytes), cal._together(lambda op=op: cal.kernels.run(op))))
    (x0, y0), (x1, y1) = pts
    rate = (x1 - x0) / (y1 - y0) if y1 > y0 else x1 / max(y1, 1e-9)
    cal.log(f"memory-bound kernels in the cache ({size / 2**20:.0f} MiB): {rate / 1e9:.2f} GB/s")
    cold = python_cold_factor(cal)
    return {"bytes": size, "bytes_per_s": rate, "python_cold_factor": cold}


# the collectives after which Python is timed: a layer's gather or a bucket's reduction
# on the small models (MiB), where gloo's threads copy and send for milliseconds
COLD_SIZES = (1 << 20, 4 << 20)


def _module_walk() -> "Callable[[], int]":
    """A framework hook's kind of Python: a walk over a transformer-shaped module tree's
    parameters (twelve layers of attention, LayerNorm, MLP and dropout modules, as
    DeepSpeed's fetch and release and FSDP2's hooks walk them), a set and a sum."""
    layers = torch.nn.ModuleList(
        torch.nn.ModuleDict({"attn": torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)),
                             "ln": torch.nn.LayerNorm(8), "drop": torch.nn.Dropout(0.1),
                             "mlp": torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                                        torch.nn.Linear(32, 8))})
        for _ in range(12))
    modules = list(layers.modules())

    def walk() -> int:
        seen, n = set(), 0
        for m in modules:
            for _, p in m.named_parameters(recurse=False):
                seen.add(id(p))
                n += p.numel()
        return n

    return walk


def python_cold_factor(cal: "Calibrator") -> float:
    """How much slower a framework's Python runs right after a blocking collective than
    back to back: the time of one walk (``_module_walk``) right after an all-reduce of
    every rank over the world (gloo's threads ran on the node's cores meanwhile, and
    the other ranks' Python) over its time right after another walk, medians over
    calls, the median over ``COLD_SIZES``; every rank at once, the largest rank's
    factor agreed. A framework's host costs are timed back to back (calibrate
    --deepspeed-host-costs, --fsdp2-host-costs); a step runs them between collectives
    (``HardwareProfile.framework_python_ns``). On this 2-core VM: 1.35x after 4 KiB,
    1.9-2.5x after 1-4 MiB."""
    walk = _module_walk()
    calls = 20 if cal.quick else 60
    factors = []
    for size in COLD_SIZES:
        x = torch.zeros(size // 4, device=cal.device)  # on the group's device, as every tensor it is handed
        warm, cold = [], []
        dist.barrier()
        for _ in range(calls):
            walk()
            t = time.perf_counter_ns()
            walk()
            warm.append(time.perf_counter_ns() - t)
            dist.all_reduce(x)
            t = time.perf_counter_ns()
            walk()
            cold.append(time.perf_counter_ns() - t)
        factors.append(statistics.median(cold) / max(1, statistics.median(warm)))
    factor = max(1.0, cal.agree(statistics.median(factors)))
    cal.log(f"Python right after a collective: {factor:.2f}x its time back to back")
    return round(factor, 3)
