"""Micro-benchmarks that turn a machine into a hardware profile (commsim-hw-profile v2).

Every rank runs every benchmark at the same time, with the executor's own kernels and
backend, because that is how a schedule will run: on a shared CPU two ranks' matmuls
compete for the same cores, on GPUs each rank has its own.

Measured:
* GEMM throughput by size (the executor's batched matmul), as (flops, flops/s) points:
  up to 1024^3 on CPUs, up to 8192^3 on GPUs (where smaller ones do not fill the
  device), and each exact shape of the schedules given; every call reads its operands
  from memory (``runtime.kernels.ColdOperands``), as a step's GEMMs do;
* memory-bound kernels by size, on data not in the cache (as a step's tensors are):
  a table, and a fixed cost per kernel and bandwidth (a least-squares fit of time over
  bytes), used for elementwise ops and copies; on CPUs also the last-level cache's size
  and the same kernel's rate on data in it, for the bytes ops reuse;
* on GPUs, host<->device copies as the executor makes them (pinned, non-blocking, each
  direction), and a kernel's fixed device cost;
* each collective kind separately (all-gather, reduce-scatter, all-reduce, broadcast):
  latency and bandwidth from a fit of time over bytes, never assuming one kind from
  another (gloo's reduce-scatter, for one, costs an all-reduce), per group size and
  placement: the whole job, and when it spans nodes also every node's ranks together
  (inside a node) and one rank of each node (across nodes), all groups of a kind at once;
  on CPU backends timed as a step issues them (followed by compute on every rank), and
  also how long each call holds the calling thread before it returns (``call_points``:
  gloo's reduce-scatter does about half its work on the caller's thread); see
  ``runtime.calibrate_collectives``;
* how much slower compute runs while a collective is in flight, and the reverse (a
  collective's bandwidth and its latency separately): on GPUs with the kernels and the
  collectives on two streams of their own, overlapping on the device;
* the executor's own per-op costs: host time to issue a device op, and per-op overhead;
* allocation cost by size, in a step-like steady state (heap reuse vs fresh pages;
  cudaMalloc on GPUs, with the caching allocator's statistics), and on CPUs what the
  first write of a fresh page costs;
* on CPUs, a framework's own memory-bound kernels (add, reduction, LayerNorm, softmax,
  dropout, embedding; forward and backward) in fp32 and bf16, by size
  (``runtime.calibrate_classes``);
* on CPUs, the cores and, with more ranks than cores, the OS time slice; with at most
  one rank per core, how each rank's speed drifts apart from the others'
  (``runtime.calibrate_cpu``).

Device times come from a ``runtime.timing`` timer: the host clock where kernels run on
the host thread, CUDA events around batches of queued calls on GPUs. Every tensor the
ranks agree through (a result, a count) is on the process group's device: NCCL takes
CUDA tensors only. ``Calibrator.run`` runs them all, in a fixed order, and returns the
profile document (``runtime.calibrate_profile``). Which of them apply, and how memory is
allocated and kernels waited for, follows the backend's platform
(``commsim.hardware.platform``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from commsim.hardware.platform import KernelExecution, platform_of_backend
from commsim.ir import ops as O
from runtime.calibrate_cpu import cache, cpu_cores, rank_noise, time_slice
from runtime.calibrate_classes import FrameworkKernelMeasurements
from runtime.calibrate_collectives import CollectiveMeasurements
from runtime.calibrate_contention import ContentionMeasurements
from runtime.calibrate_host import HostMeasurements
from runtime.calibrate_profile import Measured, device_name, profile_document
from runtime.kernels import Kernels, PinnedCopies, default_precision, device_of
from runtime.page_reporting import PassWatch
from runtime.timing import MIN_CALLS, CudaTimer, HostTimer, latency_bandwidth, per_call

class Calibrator(CollectiveMeasurements, HostMeasurements, ContentionMeasurements, FrameworkKernelMeasurements):
    """One rank's calibration: the benchmarks, each run on every rank at once with the
    executor's own kernels and backend (``run`` runs them all); the collectives are
    ``CollectiveMeasurements``', the host-side ones
    (executor overheads, allocations, first touch) are ``HostMeasurements``', the
    contention between compute and collectives ``ContentionMeasurements``', a
    framework's memory-bound kernels ``FrameworkKernelMeasurements``'."""

    def __init__(self, rank: int, world: int, backend: str, quick: bool = False, log: Callable[[str], None] = print,
                 shapes: tuple[tuple[str, int, int, int, int], ...] = (), ranks_per_node: int | None = None,
                 nodes: int | None = None):
        self.rank, self.world, self.backend = rank, world, backend
        self.ranks_per_node = ranks_per_node or world
        self.nodes = nodes or -(-world // self.ranks_per_node)
        self.shapes = shapes  # (dtype, m, n, k, batch) of the GEMMs some schedules will run
        self.platform = platform_of_backend(backend)
        self.queued = self.platform.kernels is KernelExecution.QUEUED
        # The device of the kernels and buffers, and of every tensor handed to the process
        # group: NCCL refuses CPU tensors ("No backend type associated with device type
        # cpu"), so an agreement made on the host would end the calibration at once.
        self.device = device_of(self.platform)
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[default_precision(self.platform)]
        self.kernels = Kernels(self.device, self.dtype)
        if self.queued:
            # kernels and collectives each on a stream of their own, as the executor runs
            # them, so that contention is measured as overlap on the device
            self.compute_stream = torch.cuda.Stream(device=self.device)
            self.comm_stream = torch.cuda.Stream(device=self.device)
            self.timer: Any = CudaTimer(self.device, self.compute_stream)
            self.comm_timer: Any = CudaTimer(self.device, self.comm_stream)
        else:
            self.timer = self.comm_timer = HostTimer()
        self._shape_kernels: dict[str, Kernels] = {}
        self._shape_times: dict[tuple[str, int, int, int, int], list[float]] = {}
        self._spread: list[float] = []  # a rank's own figures: the slowest over the ranks' mean, less 1
        # quick (tests, a CPU rehearsal): figures of the right form and rough size
        self.min_s = 0.025 if quick else 0.2
        self.quick = quick
        self.log = log if rank == 0 else (lambda _m: None)

    def sync(self) -> None:
        """Wait for the kernels this rank queued (none are where they run inline)."""
        self.timer.sync()

    def values(self, xs: list[float]) -> torch.Tensor:
        """``xs`` as a tensor the process group can take (on its device)."""
        return torch.tensor(xs, dtype=torch.float64, device=self.device)

    def agree_all(self, xs: list[float]) -> list[float]:
        """The largest of every rank's value, element by element."""
        t = self.values(xs)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def agree(self, x: float) -> float:
        """The largest of every rank's ``x``."""
        return self.agree_all([x])[0]

    def mean_of_ranks(self, xs: list[float]) -> list[float]:
        """Every rank's ``xs``, averaged over the ranks element by element; how far the
        slowest rank's figure lay above the mean is kept for the log (``spread_line``)."""
        t = self.values(xs)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        mean = [float(v) / self.world for v in t.tolist()]
        self._spread += [hi / m - 1.0 for hi, m in zip(self.agree_all(xs), mean) if m > 0]
        return mean

    def spread_line(self) -> str:
        """How far apart the ranks measured their own work: the slowest rank's figure over
        the ranks' mean (what an agreement on the slowest would have priced more)."""
        if not self._spread or self.world < 2:
            return "ranks apart: one rank"
        s = sorted(self._spread)
        return (f"ranks apart: the slowest rank's figure {100 * statistics.median(s):.1f}% above the ranks' mean "
                f"(median of {len(s)} figures; p90 {100 * s[int(0.9 * (len(s) - 1))]:.1f}%)")

    def rank_mean(self, x: float) -> float:
        """The ranks' mean of ``x`` (a rank's own cost: see ``_together``)."""
        return self.mean_of_ranks([x])[0]

    def _together(self, fn: Callable[[], Any], timer: Any = None, min_calls: int = MIN_CALLS,
                  slowest: bool = False) -> float:
        """Seconds per call of ``fn`` on all ranks at once (``runtime.timing.per_call``).
        Every rank runs the same number of calls (a collective inside must match on all
        ranks). A rank's own work (a kernel, an allocation) counts the ranks' mean: the
        simulator draws each rank's speed drift and makes a collective wait for its
        slowest member (``commsim.sim.rank_speed``), so the slowest rank's figure would
        count the drift twice (each window of a benchmark is shorter than the drift's
        correlation time: with the ranks' drift measured at sd 15%, the slowest rank's
        figure lay a median 5.4% above the ranks' mean, p90 20%: traces/README.md, "The
        slowest rank's figures"; every calibration logs it, ``spread_line``). With
        ``slowest`` the slowest rank's mean counts: a call with a collective inside,
        which ends on every rank together, and a figure compared with others agreed
        that way (a slowdown's baseline)."""
        dist.barrier()
        return per_call(timer or self.timer, fn, self.min_s, self.agree, min_calls,
                        result=None if slowest else self.rank_mean)

    # ------------------------------------------------------------ compute
    def _gemm_shapes(self, dtype: torch.dtype) -> list[tuple[int, int, int, int]]:
        if self.queued:
            # A GPU needs large GEMMs to fill its SMs: up to 8192^3 (and transformer
            # layers' shapes of hidden 1024 to 4096); batched ones up to 2048.
            sizes = [128, 512, 2048, 8192] if self.quick else [64, 128, 256, 512, 1024, 2048, 4096, 8192]
            shapes = [(n, n, n, 1) for n in sizes] + [(n, n, n, 8) for n in sizes if n <= 2048]
            if not self.quick:
                shapes += [(t, 4 * h, h, 1) for t in (2048, 8192) for h in (1024, 4096)]
                shapes += [(4 * h, h, t, 1) for t in (2048, 8192) for h in (1024, 4096)]
            return shapes
        sizes = [16, 32, 64, 128, 256, 512] if self.quick else [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024]
        cpu_bf16 = dtype == torch.bfloat16
        if cpu_bf16:
            # slow on CPUs without bf16 units (a large batched GEMM takes seconds); the
            # curve is flat well before these sizes
            sizes = [s for s in sizes if s <= (128 if self.quick else 256)]
        # square matmuls, batched ones, and the tall-and-skinny shapes of transformer
        # layers (tokens x hidden x 4*hidden and their gradients)
        shapes = [(n, n, n, b) for n in sizes for b in (1, 8)]
        if not self.quick and not cpu_bf16:
            shapes += [(t, 4 * h, h, 1) for t in (256, 1024) for h in (256, 512)]
            shapes += [(4 * h, h, t, 1) for t in (256, 1024) for h in (256, 512)]
        return shapes

    def gemm(self, dtype: torch.dtype) -> list[list[float]]:
        kernels = Kernels(self.device, dtype, cold_gemms=True)  # operands from memory, as in a step
        points = []
        for m, n, k, batch in self._gemm_shapes(dtype):
            op = O.Compute(O.OpId(0), "c", "", O.ComputeKind.GEMM, 2 * m * n * k * batch, 0, 0,
                           O.GemmShape(m, n, k, batch))
            t = self._together(lambda op=op: kernels.run(op))
            points.append([float(op.flops), op.flops / t])
        # one rate per flop count (shapes of equal work measured with and without batching)
        by_flops: dict[float, list[float]] = {}
        for f, r in points:
            by_flops.setdefault(f, []).append(r)
        points = sorted([f, statistics.mean(rs)] for f, rs in by_flops.items())
        self.log(f"gemm {str(dtype).removeprefix('torch.')}: {points[0][1] / 1e9:.1f} .. "
                 f"{max(p[1] for p in points) / 1e9:.1f} GFLOP/s")
        return points

    def gemm_shapes_round(self) -> None:
        """Time each exact GEMM shape of the schedules given (``calibrate --schedule``)
        once more, on all ranks at once like every other benchmark: a rate by flops
        alone misses how a shape uses caches (an LM head's long, thin GEMM and a batched
        square one of similar flops run at very different rates)."""
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        for shape in self.shapes:
            dt, m, n, k, batch = shape
            kernels = self._shape_kernels.setdefault(dt, Kernels(self.device, dtypes[dt], cold_gemms=True))
            op = O.Compute(O.OpId(0), "c", "", O.ComputeKind.GEMM, 2 * m * n * k * batch, 0, 0, O.GemmShape(m, n, k, batch))
            t = self._together(lambda op=op, kernels=kernels: kernels.run(op))
            self._shape_times.setdefault(shape, []).append(t)

    def gemm_shapes(self) -> dict[str, list[list[float]]]:
        """Each exact shape's rate from the mean of its rounds. The rounds lie apart (at
        the start, the middle and the end of a calibration): on a shared machine a
        kernel's speed drifts over seconds (traces/README.md, runs M to P), and a step's
        GEMMs run across all of it, so one short window misprices all of them at once."""
        out: dict[str, list[list[float]]] = {}
        for (dt, m, n, k, batch), times in self._shape_times.items():
            out.setdefault(dt, []).append([m, n, k, batch, 2 * m * n * k * batch / statistics.fmean(times)])
        if self.shapes:
            rounds = len(next(iter(self._shape_times.values())))
            self.log(f"gemm shapes: {len(self.shapes)} measured, {rounds} rounds each")
        return out

    def memory(self) -> tuple[float, float, list[list[float]]]:
        """Memory-bound kernels by size (a table), as the executor runs them: each call on
        the next region of a ring larger than the last-level cache, so its data comes
        from memory, as a step's tensors do (``Kernels``); below a few MiB the cost is
        mostly the call's fixed overhead and the cold cache lines' latency."""
        sizes = [4 << 10, 64 << 10, 1 << 20, 8 << 20] + ([] if self.quick else [32 << 20, 128 << 20])
        if self.queued and not self.quick:
            sizes.append(512 << 20)  # well past a GPU's L2 (40-60 MB): HBM's own rate
        pts = []
        for nbytes in sizes:
            op = O.Compute(O.OpId(0), "c", "", O.ComputeKind.ELEMENTWISE, 0, nbytes // 2, nbytes // 2)
            pts.append((float(nbytes), self._together(lambda op=op: self.kernels.run(op))))
        a, bw = latency_bandwidth(pts)
        self.log(f"memory-bound kernels: {a * 1e6:.1f} us + {bw / 1e9:.2f} GB/s "
                 f"({pts[-1][0] / pts[-1][1] / 1e9:.2f} GB/s at {pts[-1][0] / 2**20:.0f} MiB)")
        return a, bw, [[int(x), y] for x, y in pts]

    def kernel_overhead_ns(self) -> int | None:
        """GPUs: a kernel's fixed device cost, from a batch of the smallest memory-bound
        kernels queued behind a held stream (``CudaTimer``), so that neither the host's
        launch nor a synchronise round trip is in it. None on CPUs, whose per-kernel cost
        comes from the executor's per-op overhead (``executor_overheads``)."""
        if not self.queued:
            return None
        op = O.Compute(O.OpId(0), "c", "", O.ComputeKind.ELEMENTWISE, 0, 32, 32)
        t = self._together(lambda: self.kernels.run(op))
        self.log(f"kernel overhead: {t * 1e6:.2f} us per kernel on the device")
        return int(t * 1e9)

    def copies(self) -> dict[str, dict[str, Any]] | None:
        """GPUs: host->device and device->host copies as the executor makes them (pinned
        host memory, non-blocking, ``runtime.kernels.PinnedCopies``), by size: latency
        and bandwidth of each direction (PCIe's, not HBM's). None on CPUs, where a copy
        is the memory-bound kernel over its bytes read and written, whose table
        ``memory`` measured."""
        if not self.queued:
            return None
        sizes = [64 << 10, 1 << 20, 16 << 20] + ([64 << 20] if self.quick else [128 << 20, 512 << 20])
        copies = PinnedCopies(self.device, max(sizes))
        out: dict[str, dict[str, Any]] = {}
        for direction in (O.CopyDirection.H2D, O.CopyDirection.D2H):
            pts = [(float(n), self._together(lambda n=n, d=direction, c=copies: c.run(d, n))) for n in sizes]
            a, bw = latency_bandwidth(pts)
            out[direction.value] = {"latency_ns": int(a * 1e9), "bytes_per_s": bw,
                                    "points": [[int(x), y] for x, y in pts]}
            self.log(f"{direction.value} copies (pinned): {a * 1e6:.1f} us + {bw / 1e9:.2f} GB/s")
        del copies
        self.sync()
        return out

    def devices(self) -> list[str]:
        """Every rank's device name, each once, in order of first appearance."""
        names: list[Any] = [None] * self.world
        dist.all_gather_object(names, device_name(self.device))
        return list(dict.fromkeys(str(n) for n in names))

    # ------------------------------------------------------------ all
    def run(self) -> dict[str, Any]:
        """Every benchmark, in an order that spreads the exact GEMM shapes' rounds over
        the calibration; returns the profile document."""
        t0 = time.perf_counter()
        passes = PassWatch().start()  # the guest's page-reporting passes (reported_pages)
        devices = self.devices()
        gemm_by_dtype = {"fp32": self.gemm(torch.float32), "bf16": self.gemm(torch.bfloat16)}
        self.gemm_shapes_round()  # exact shapes: at the start, the middle and the end (not quick)
        mem_a, mem_bw, mem_points = self.memory()
        in_cache = cache(self)
        kernel_ns = self.kernel_overhead_ns()
        copies = self.copies()
        colls = self.collectives()
        if not self.quick:
            self.gemm_shapes_round()
        slow_c, slow_n, slow_lat = self.contention()
        loop = self.executor_overheads()
        launches = self.launch_costs()
        alloc_a, alloc_per_byte, alloc_points = self.alloc()
        first_touch, unmap = self.first_touch()
        if not self.quick:
            self.gemm_shapes_round()
        shapes = self.gemm_shapes()
        cores = cpu_cores()
        slice_ns = time_slice(self, cores)
        noise, stalls = rank_noise(self, cores)
        allocator = self.allocator_stats()
        # late: its operand rings (hundreds of MB, allocated and freed per kernel class)
        # would change the heap that the allocation benchmarks above see
        classes = self.framework_kernels()
        # after everything else: it holds and then frees up to gigabytes a rank, which the
        # guest then reports to its host in passes that take the node's cores for a while
        reported = self.reported_pages(passes.stop())
        self.log(self.spread_line())
        self.log(f"calibration took {time.perf_counter() - t0:.0f} s")
        measured = Measured(
            gemm_by_dtype=gemm_by_dtype, gemm_shapes_by_dtype=shapes, mem_latency_s=mem_a, mem_bytes_per_s=mem_bw,
            mem_points=mem_points, collectives=colls, comm_slowdown=slow_c, comm_slowdown_during_compute=slow_n,
            comm_latency_slowdown_during_compute=slow_lat, issue_ns=loop.issue_ns, inline_kernel_ns=loop.kernel_ns,
            host_op_ns=loop.host_op_ns, cold_points=loop.cold_points,
            alloc_latency_s=alloc_a, alloc_s_per_byte=alloc_per_byte, alloc_points=alloc_points,
            first_touch_s_per_byte=first_touch, unmap_s_per_byte=unmap, reported_pages=reported, cpu_cores=cores,
            time_slice_ns=slice_ns, rank_noise=noise, rank_stalls=stalls,
            devices=devices, nodes=self.nodes, kernel_overhead_ns=kernel_ns, copies=copies,
            allocator=allocator, cache=in_cache, host_costs=launches, framework_kernels=classes)
        return profile_document(measured, self.platform, self.device, self.world, self.ranks_per_node)
