"""Measured hardware profiles (written by ``commsim calibrate``) as a cost model.

A profile replaces the spec-derived constants with measurements made with the same
backend the user will run: GEMM throughput by size, memory-bound bandwidth, copy
bandwidth, each collective kind's latency and bandwidth by group size and placement
(measured per kind, never derived from another: gloo's reduce-scatter, for instance,
costs a full all-reduce), the slowdown of compute while a collective runs, and
allocation costs. It also says what it measured, so that a prediction it cannot price
is refused rather than guessed (``commsim.api``): the backend, the devices, the ranks
per node and the nodes, and (the keys of its collectives table) the group sizes and
placements.

The document's format, and how its fields are read, are in ``commsim.hardware.profile_doc``.

The profile yields its ``Platform`` (``commsim.hardware.platform``): the backend says
how kernels, memory and collective order work; ``cpu_cores``, ``time_slice_ns`` and
``rank_noise`` complete it. With more ranks per node than ``cpu_cores``, the simulator runs the
node's OS scheduler: host threads and collectives' backend threads share the cores in
time slices of ``time_slice_ns``, and every cost above (measured with all ranks busy
at once, so with cores/ranks of a core each) is scaled to one core's worth.

``rank_noise``: how each rank's speed drifts, independently of the others, as an
Ornstein-Uhlenbeck process of log speed (standard deviation ``sd``, correlation time
``corr_ns``). Ranks of a CPU node share cores with each other's backend threads, the
OS and, on a VM, other tenants, so each synchronisation waits for whichever rank is
behind. With it the simulator runs every
rank (per-rank mode). calibrate measures it on CPU backends. ``rank_stalls``: the short
stalls each rank has on its own (``RankStalls``), which the drift's fit leaves out (it
keeps only what is correlated over 10 ms bins); also per-rank mode.

A collective of ``size_bytes`` over a group of ``p`` ranks takes ``latency_ns +
size_bytes / bytes_per_s`` alone (nccl-tests' algorithm bandwidth), from the fit of its
group's placement (all its ranks on one node, or not) and the nearest measured size;
concurrent collectives of one node share its one measured channel
(``LinkKind.CHANNEL``), so two at once each take longer.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

from commsim.hardware.links import CollectivePlan, Link, LinkKind
from commsim.hardware.sharing import IDLE, Taken
from commsim.hardware.platform import (DEFAULT_TIME_SLICE_NS, CpuCores, Platform, RankDrift, RankStalls,
                                       platform_of_backend)
from commsim.hardware.write_allocate import write_allocate_share
from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError

if TYPE_CHECKING:  # framework_kernels prices with this module's piecewise()
    from commsim.hardware.framework_kernels import FrameworkKernels

PROFILE_SCHEMA_VERSION = 2
INTRA_NODE, INTER_NODE = "intra_node", "inter_node"
PLACEMENTS = (INTRA_NODE, INTER_NODE)
_LINK_UNITS_PER_S = 1e9  # the shared link's capacity; demands are scaled to it


@dataclass(frozen=True)
class CollectiveFit:
    latency_ns: int
    bytes_per_s: float
    points: tuple[tuple[float, float], ...] = ()  # measured (bytes, seconds), ascending
    # measured (bytes, seconds) of the call alone (async_op=True until it returns): the
    # time the backend holds the calling thread; () where not measured (GPUs: an enqueue)
    call_points: tuple[tuple[float, float], ...] = ()
    # measured (bytes, seconds) of the collective as a step issues it (CPU backends:
    # started together, followed by compute on every rank); () where not measured
    in_step_points: tuple[tuple[float, float], ...] = ()

    def stall_seconds(self, size_bytes: float) -> float:
        """What a collective followed by compute takes beyond one followed by another
        (``points``, back to back): piecewise linear between measured sizes, never below
        0; 0 where either table is missing."""
        if len(self.in_step_points) < 2 or len(self.points) < 2:
            return 0.0
        return max(0.0, piecewise(self.in_step_points, size_bytes) - piecewise(self.points, size_bytes))

    def call_seconds(self, size_bytes: float) -> float:
        """Host time of the call: piecewise linear between measured sizes (0 unmeasured)."""
        if not self.call_points:
            return 0.0
        if len(self.call_points) < 2:
            return self.call_points[0][1]
        return max(0.0, piecewise(self.call_points, size_bytes))

    def seconds(self, size_bytes: float) -> float:
        """Transfer time beyond the latency: piecewise linear between measured sizes,
        the last segment's slope beyond them; the latency-bandwidth fit without points."""
        if len(self.points) < 2:
            return size_bytes / self.bytes_per_s
        return max(0.0, piecewise(self.points, size_bytes) - self.points[0][1])


def piecewise(pts: tuple[tuple[float, float], ...], x: float) -> float:
    """Linear between the measured (x, y) points (ascending, at least two); the first or
    last segment extended beyond them."""
    i = min(max(bisect.bisect_left([p for p, _ in pts], x), 1), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


# glibc malloc.c DEFAULT_MMAP_THRESHOLD_MAX (4 MiB * sizeof(long): 32 MiB on 64-bit):
# the dynamic mmap threshold never exceeds it, so blocks of it and more (their chunk, with
# its header, exceeds it) are always mmapped, fresh pages (calibrate's allocation table
# shows the jump across it).
GLIBC_MMAP_THRESHOLD_MAX_BYTES = 32 << 20


@dataclass(frozen=True)
class HardwareProfile:
    description: str
    backend: str
    ranks_per_node: int
    hbm_bytes: int
    kernel_overhead_ns: int
    gemm: tuple[tuple[float, float], ...]  # for the schedule's precision when measured, else the default
    # exact shapes measured (calibrate --schedule): (m, n, k, batch) -> flops/s, same precision
    gemm_shapes: dict[tuple[int, int, int, int], float]
    elementwise_bytes_per_s: float
    elementwise_points: tuple[tuple[float, float], ...]  # measured (bytes, seconds) of memory-bound kernels
    d2d_bytes_per_s: float
    h2d_bytes_per_s: float
    copy_latency_ns: int
    # kind -> (placement, group size) -> fit; placement INTRA_NODE or INTER_NODE
    collectives: dict[str, dict[tuple[str, int], CollectiveFit]]
    comm_slowdown: float
    comm_slowdown_during_compute: float
    issue_ns: int  # the executor's host time per device op beyond its record (runtime.executor_loop)
    caching_allocator: bool  # False: every allocation pays the measured cost (host malloc)
    malloc_base_ns: int
    malloc_ns_per_byte: float
    free_base_ns: int
    free_ns_per_byte: float
    alloc_points: tuple[tuple[float, float], ...] = ()  # measured (bytes, seconds) of host allocations
    # CPU backends: cores the node's ranks share, and the OS time slice between them
    # (measured by calibrate). More ranks than cores: the simulator time-slices them.
    cpu_cores: int | None = None
    time_slice_ns: int = 0
    # host memory: the first write of a fresh page (fault, kernel zeroing), per byte, over
    # what a write to touched memory costs (calibrate measures it; 0: not measured, the
    # allocation table's large-size cost per byte stands in); and handing a written page
    # back to the OS (munmap of an mmapped block, or glibc's trim of its heap) at free,
    # per byte. Profiles older than that split: 0, their first touch includes the unmap.
    first_touch_ns_per_byte: float = 0.0
    unmap_ns_per_byte: float = 0.0
    # the executor's loop per host op, by kind (work, sync, alloc, free; absent: 0), and
    # inside a host work's and a sync's record (work_record, sync_record)
    executor_host_op_ns: tuple[tuple[str, int], ...] = ()
    # CPUs: the Python after a kernel that ran on the host thread, over its time after a
    # tiny one (the interpreter's caches refill): (bytes moved, ns) of memory-bound
    # kernels and copies, (flops, ns) of GEMMs (runtime.executor_loop; absent: 0)
    python_after_memory_points: tuple[tuple[float, float], ...] = ()
    python_after_gemm_points: tuple[tuple[float, float], ...] = ()
    # a virtual machine that reports free memory to its hypervisor: its reporting period
    # and what a reported page's first write costs over a fast one, per byte (calibrate,
    # where the guest reports; 0: not measured, no page is priced as reported)
    page_report_period_ns: int = 0
    reported_page_extra_ns_per_byte: float = 0.0
    # a collective's fixed latency while its node computes, over its latency alone: on a
    # CPU backend the collective's thread waits for a core at each message (calibrate)
    comm_latency_slowdown_during_compute: float = 1.0
    # each rank's speed drift: sd of its log speed and its correlation time (0: none),
    # and a slower second component where calibrate found one (0: none)
    rank_noise_sd: float = 0.0
    rank_noise_corr_ns: int = 0
    rank_noise_slow_sd: float = 0.0
    rank_noise_slow_corr_ns: int = 0
    # each rank's short stalls: per second of undisturbed work, and their lengths (RankStalls)
    rank_stalls_rate_per_s: float = 0.0
    rank_stalls_lengths_ns: tuple[int, ...] = ()
    # what was measured: every rank's device, the job's shape
    devices: tuple[str, ...] = ()
    world_size: int = 0
    nodes: int = 1
    d2h_bytes_per_s: float = 0.0  # 0: as h2d
    d2h_latency_ns: int | None = None  # None: as h2d
    allocator: tuple[tuple[str, int], ...] = ()  # GPUs: torch.cuda.memory_stats after calibrating
    # the last-level cache's size and the memory-bound kernel's rate in it (0: not measured)
    cache_bytes: int = 0
    cache_bytes_per_s: float = 0.0
    # a framework's Python run right after a blocking collective, over the same Python
    # run back to back (calibrate, CPUs; 1.0: not measured): its host costs are timed
    # back to back; a step runs them between collectives (framework_python_ns)
    python_cold_factor: float = 1.0
    # a framework's own memory-bound kernels by class, direction and dtype (calibrate,
    # CPUs), priced where the profile prices a framework's run (``framework``), in the
    # step's ``precision`` (the one this profile was loaded for)
    framework_kernels: FrameworkKernels | None = None
    precision: str = "fp32"
    framework: bool = False

    @property
    def groups_measured(self) -> tuple[tuple[str, int], ...]:
        """Every (placement, group size) some collective kind was measured with."""
        return tuple(sorted({key for fits in self.collectives.values() for key in fits}))

    def placement(self, group: tuple[int, ...]) -> str:
        """Where a group's ranks sit on this profile's nodes."""
        return INTRA_NODE if len({self.node_of(r) for r in group}) == 1 else INTER_NODE

    def framework_python_ns(self, duration_ns: int, cold: bool) -> int:
        """A framework's Python (``duration_ns`` as timed back to back) on a CPU rank:
        at the measured cold cost when a collective of the rank ran since its last
        Python (``cold``: gloo's threads copied and sent on the node's cores meanwhile,
        taking them and their caches from the rank's thread), else as timed. Only where
        the profile prices a framework's run (``framework``)."""
        if not cold or not self.framework or self.python_cold_factor <= 1.0:
            return duration_ns
        return int(duration_ns * self.python_cold_factor)

    def host_malloc_ns(self, size_bytes: int, touch_bytes: int | None = None) -> int:
        """An allocation without a caching allocator in front: measured by size when
        calibrate recorded points, else the latency-bandwidth line. The table was
        measured with zero-filled blocks (every page written). A block of which only
        ``touch_bytes`` are ever written: above glibc's mmap threshold it is fresh pages
        and pays the first touch of what is written; below it the heap's pages are
        already touched and only the fixed cost remains. (A framework's allocations are
        priced by their fresh pages instead: ``fresh_page_ns_per_byte``.)"""
        partial = touch_bytes is not None and touch_bytes < size_bytes
        pts = self.alloc_points
        if len(pts) < 2:  # the line, over the bytes that get written
            return self.malloc_base_ns + int(self.malloc_ns_per_byte * (touch_bytes if partial else size_bytes))
        (x_lo, y_lo), (x_hi, y_hi) = pts[0], pts[-1]
        mmapped = size_bytes >= GLIBC_MMAP_THRESHOLD_MAX_BYTES
        if partial:
            if not mmapped:
                return int(y_lo * 1e9)
            per_byte = self.first_touch_ns_per_byte or y_hi / x_hi * 1e9
            return int(y_lo * 1e9 + per_byte * touch_bytes)
        if size_bytes > x_hi:  # beyond the largest measured size: its cost per byte
            return int(y_hi * size_bytes / x_hi * 1e9)
        if size_bytes < x_lo:  # below the smallest: a fixed cost dominates there
            return int(y_lo * 1e9)
        # within one regime (heap or mmap) only: a line between a heap size and an mmapped
        # one prices a block that is either as neither
        side = tuple(p for p in pts if (p[0] >= GLIBC_MMAP_THRESHOLD_MAX_BYTES) == mmapped)
        if len(side) == 1:
            return int(side[0][1] * size_bytes / side[0][0] * 1e9)
        return max(0, int(piecewise(side if side else pts, size_bytes) * 1e9))

    def host_op_ns(self) -> dict[str, int]:
        """The executor's loop per host op, by kind (``executor_host_op_ns``)."""
        return dict(self.executor_host_op_ns)

    def python_after_kernel_ns(self, op: O.Compute | O.Copy) -> int:
        """What the host's next Python pays after ``op`` ran on the host thread (CPUs),
        by the bytes a memory-bound kernel or copy moved or a GEMM's flops: piecewise
        between calibrate's points, from 0 below the first, the largest beyond the last
        (the caches are all taken). 0 where kernels are queued on a device."""
        if isinstance(op, O.Compute) and op.gemm is not None and op.kind in (O.ComputeKind.GEMM,
                                                                             O.ComputeKind.ATTENTION):
            pts, x = self.python_after_gemm_points, float(op.flops)
        else:
            pts = self.python_after_memory_points
            x = float(op.bytes_read + op.bytes_written) if isinstance(op, O.Compute) else 2.0 * op.size_bytes
        if not pts or not self.platform.inline_kernels:
            return 0
        if x >= pts[-1][0]:
            return int(pts[-1][1])
        return max(0, int(piecewise(((0.0, 0.0),) + pts if x < pts[0][0] else pts, x)))

    def host_unmap_ns(self, nbytes: int) -> int:
        """Handing ``nbytes`` of written host pages back to the OS at a free (munmap of
        a block above glibc's mmap threshold, or a trim of the heap's top): the kernel
        tears each written page down (calibrate's ``first_touch`` times it). 0 with a
        caching allocator (a cached block is not unmapped) or where the profile
        predates the figure."""
        if self.caching_allocator:
            return 0
        return int(self.unmap_ns_per_byte * nbytes)

    def fresh_page_ns_per_byte(self) -> float | None:
        """A framework's allocation (``framework``, on a malloc platform) is a
        ``torch.empty`` that the op making it writes (the generators emit a fill op where
        the framework zeroes one): it costs nothing beyond that op's dispatch but the
        first write of fresh pages, which the simulator finds from glibc's fixed 32 MiB
        ceiling or, asked to, by tracking glibc's heap (``sim.host_heap``), at the
        calibrated first touch (fault and kernel zeroing; in profiles older than
        ``unmap_ns_per_byte``, also the unmap or trim that hands the page back) per byte. torch's sqrt into a new 4 KiB-30 MiB tensor took as long
        as into an existing one (within 3%), into a new 34 / 64 MiB one 10.5 / 22.2 ms
        longer (0.33 ns a byte; bench/framework_alloc.py); the allocation table,
        zero-filled in a barrier's wake, prices a 4 KiB block at tens of us. Without a
        first-touch figure, the largest measured size's cost per byte. None: the
        executor's zero-filled allocations, priced by the table."""
        if not self.framework or self.caching_allocator:
            return None
        pts = self.alloc_points
        return self.first_touch_ns_per_byte or (pts[-1][1] / pts[-1][0] * 1e9 if pts else self.malloc_ns_per_byte)

    def reported_pages(self) -> tuple[int, float] | None:
        """(reporting period ns, extra ns a byte) of a guest that reports the host memory
        its processes free to its hypervisor: the share of a large block's pages that the
        guest has reported by the time the rank reuses them, which grows with their age
        in periods, comes back at the extra cost (``sim.returned_pages``).
        None: not measured, or a caching allocator (device memory)."""
        if self.caching_allocator or self.page_report_period_ns <= 0 or self.reported_page_extra_ns_per_byte <= 0:
            return None
        return self.page_report_period_ns, self.reported_page_extra_ns_per_byte

    def run_by_framework(self) -> "HardwareProfile":
        """This profile pricing a framework's run of a schedule instead of commsim's
        executor's: without the executor's own per-op costs, which calibrate measures
        (``executor_overheads``) and no framework pays. ``issue_ns`` and
        ``executor_host_op_ns`` are the executor's loop between its records (a
        framework's is the schedule's launch and Python host ops);
        where kernels run inline (CPUs) the kernel's fixed cost is the executor's per-op
        time (its loop and the stand-in kernel's Python), of which a framework's op pays
        the launch host op's dispatch only (``host_costs.launch_ns``, a torch op's
        dispatch timed by calibrate). On GPUs the fixed cost is the device's own and stays.
        Its memory-bound ops run the framework's own kernels, priced from
        ``framework_kernels`` by class and dtype where calibrate measured them, and its
        allocations are empty ones (``host_malloc_ns``)."""
        inline = self.platform.inline_kernels
        return replace(self, issue_ns=0, executor_host_op_ns=(),
                       kernel_overhead_ns=0 if inline else self.kernel_overhead_ns, framework=True)

    @cached_property
    def platform(self) -> Platform:
        """The backend's platform, with the cores and rank drift this profile measured."""
        cpu = None
        if self.cpu_cores:
            cpu = CpuCores(self.cpu_cores, self.ranks_per_node, self.time_slice_ns or DEFAULT_TIME_SLICE_NS)
        return platform_of_backend(self.backend, cpu, RankDrift(self.rank_noise_sd, self.rank_noise_corr_ns,
                                                                      self.rank_noise_slow_sd,
                                                                      self.rank_noise_slow_corr_ns),
                                   self.caching_allocator,
                                   RankStalls(self.rank_stalls_rate_per_s, self.rank_stalls_lengths_ns))

    @property
    def describe(self) -> str:
        return f"profile: {self.description}"

    # ------------------------------------------------------------ CostModel
    def _gemm_rate(self, flops: float, shape: O.GemmShape | None = None) -> float:
        if shape is not None:
            rate = self.gemm_shapes.get((shape.m, shape.n, shape.k, shape.batch))
            if rate is not None:  # this very kernel was measured
                return rate
        xs = [math.log(f) for f, _ in self.gemm]
        x = math.log(max(flops, 1.0))
        i = bisect.bisect_left(xs, x)
        if i <= 0:
            return self.gemm[0][1]
        if i >= len(xs):
            return self.gemm[-1][1]
        t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return self.gemm[i - 1][1] * (1 - t) + self.gemm[i][1] * t

    def _memory_s(self, nbytes: float) -> float:
        """Memory-bound time: piecewise linear over the measured sizes (cache to DRAM)."""
        pts = self.elementwise_points
        if len(pts) < 2:
            return nbytes / self.elementwise_bytes_per_s
        return max(0.0, piecewise(pts, nbytes) - pts[0][1])

    # interference is priced by the measured factors (comm_slowdown, ...), not by sharing
    gpu_resources = None

    def kernel_hbm_bytes(self, op: O.Compute) -> float:
        return float(op.bytes_read + op.bytes_written)

    def compute_ns(self, op: O.Compute, taken: Taken = IDLE) -> int:
        """A kernel's measured time; with collectives in flight (``taken``), slowed by the
        measured contention factor."""
        ns = self._compute_alone_ns(op)
        return int(ns * self.comm_slowdown) if taken else ns

    def _reused_in_cache(self, op: O.Compute) -> int:
        """Of ``op``'s bytes, those it reuses from the cache: its ``reuse_bytes`` where
        its working set fits in a rank's share of the cache (ranks of a node share it)."""
        if not op.reuse_bytes or not self.cache_bytes_per_s:
            return 0
        return op.reuse_bytes if op.working_set_bytes <= self.cache_bytes // max(1, self.ranks_per_node) else 0

    def _compute_alone_ns(self, op: O.Compute) -> int:
        if self.framework and self.framework_kernels is not None:
            measured = self.framework_kernels.kernel_s(op, self.precision)
            if measured is not None:  # the framework's own kernel of this class and dtype
                return self.kernel_overhead_ns + int(measured * 1e9)
        reused = self._reused_in_cache(op)
        mem_s = self._memory_s(op.bytes_read + op.bytes_written - reused)
        if op.in_place_bytes and self.framework and self.platform.inline_kernels:
            mem_s *= write_allocate_share(op)  # the table timed copies, whose writes are fresh
        if reused:
            mem_s += reused / self.cache_bytes_per_s
        flop_s = op.flops / self._gemm_rate(op.flops, op.gemm) if op.kind in (O.ComputeKind.GEMM, O.ComputeKind.ATTENTION) \
            else 0.0
        return self.kernel_overhead_ns + int(max(mem_s, flop_s) * 1e9)

    def copy_ns(self, op: O.Copy) -> int:
        if self.elementwise_points and (op.direction is O.CopyDirection.D2D or self.platform.inline_kernels):
            # the executor copies with the memory-bound kernel: read + write the bytes
            return self.kernel_overhead_ns + int(self._memory_s(2 * op.size_bytes) * 1e9)
        if op.direction is O.CopyDirection.D2D:
            return self.copy_latency_ns + int(op.size_bytes / self.d2d_bytes_per_s * 1e9)
        if op.direction is O.CopyDirection.D2H and self.d2h_bytes_per_s:
            latency = self.copy_latency_ns if self.d2h_latency_ns is None else self.d2h_latency_ns
            return latency + int(op.size_bytes / self.d2h_bytes_per_s * 1e9)
        return self.copy_latency_ns + int(op.size_bytes / self.h2d_bytes_per_s * 1e9)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def link_capacity(self, link: Link) -> float:
        return _LINK_UNITS_PER_S

    def collective(self, op: O.Collective) -> CollectivePlan:
        p = len(op.group)
        if p == 1:
            return CollectivePlan("local", self.kernel_overhead_ns, ())
        fits = self.collectives.get(op.kind.value)
        if not fits:
            raise CommsimInputError(f"hardware profile ({self.description}): no measurement of {op.kind.value}; "
                                    "re-run commsim calibrate")
        # The group's own placement, and of its sizes the one nearest to p (ties: the
        # larger, the more conservative). A placement never measured (reachable only
        # when a prediction was asked to extrapolate) takes the other one's fits.
        where = self.placement(op.group)
        sizes = [q for pl, q in fits if pl == where]
        if not sizes:
            where = INTER_NODE if where == INTRA_NODE else INTRA_NODE
            sizes = [q for pl, q in fits if pl == where]
        size = min(sizes, key=lambda q: (abs(q - p), -q))
        fit = fits[(where, size)]
        seconds = fit.seconds(op.size_bytes)
        nodes = sorted({self.node_of(r) for r in op.group})
        return CollectivePlan(f"measured/{where}/{size}", fit.latency_ns,
                              tuple((Link(LinkKind.CHANNEL, n), seconds * _LINK_UNITS_PER_S) for n in nodes),
                              call_ns=int(fit.call_seconds(op.size_bytes) * 1e9),
                              stall_ns=int(fit.stall_seconds(op.size_bytes) * 1e9))
