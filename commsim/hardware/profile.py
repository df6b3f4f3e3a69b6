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

Format (JSON), schema version 2::

    {"kind": "commsim-hw-profile", "schema_version": 2, "description": "...",
     "backend": "gloo",                 # the torch.distributed backend measured
     "devices": ["CPU: AMD EPYC"],      # every rank's device name, each once
     "world_size": 2, "ranks_per_node": 2, "nodes": 1,
     "memory_bytes": 8589934592,
     "kernel_overhead_ns": 20000,
     "gemm": [[flops, flops_per_s], ...],          # ascending flops
     "elementwise_bytes_per_s": 4e9,
     "copy": {"d2d_bytes_per_s": 4e9, "h2d_bytes_per_s": 4e9, "latency_ns": 2000,
              "d2h_bytes_per_s": 4e9, "d2h_latency_ns": 2000},  # d2h: optional, else h2d's
     "collectives": {"all_gather": {"intra_node": {"2": {"latency_ns": 200000, "bytes_per_s": 1e9}},
                                    "inter_node": {"4": {...}}}, ...},
     "comm_slowdown": 1.5,              # compute runs this much slower during a collective
     "comm_slowdown_during_compute": 2, # and collectives this much slower during compute (optional)
     "comm_latency_slowdown_during_compute": 3,  # and their fixed latency (optional)
     "issue_ns": 20000,                 # host time to issue one device op (optional)
     "cache": {"bytes": 33554432, "bytes_per_s": 6e10},  # CPU backends (optional): see below
     "cpu_cores": 2, "time_slice_ns": 4000000,  # CPU backends (optional): see below
     "rank_noise": {"sd": 0.1, "corr_ns": 300000000},  # ranks' speed drift (optional): see below
     "allocator": {"num_alloc_retries": 0, ...},  # GPUs (optional): torch.cuda.memory_stats after calibrating
     "alloc": {"malloc_base_ns": 5000, "malloc_ns_per_byte": 0.0,
               "free_base_ns": 5000, "free_ns_per_byte": 0.0,
               "points": [[bytes, seconds], ...]}}  # optional: host allocations by size

Version 1 profiles are refused with the fix (re-run ``commsim calibrate``), not read
with the new fields guessed: they do not say where their groups sat (inside a node or
across nodes) or on which devices, and on GPUs they were measured by the code this
version corrects (host<->device copies at half the memory bandwidth, every GEMM timed
with a device synchronise, contention measured as serialisation), so a GPU version-1
profile prices wrongly and has to be measured again anyway. The CPU profiles kept in
``traces/local-cpu`` were converted once (their groups were all inside one node).

Host allocations (CPU backends) are priced from ``alloc.points`` when present, piecewise
linear by size: glibc's malloc serves blocks below its mmap threshold (dynamic, up to
32 MiB on 64-bit Linux: mallopt(3), M_MMAP_THRESHOLD) from a heap whose pages are
already touched, so zeroing them costs a memset; larger blocks are fresh mmapped pages
every time and pay page faults, several times more per byte: one latency-plus-bandwidth
line through both regimes misprices both (traces/README.md has the figures).

``cache``: the last-level cache's size and the memory-bound kernel's rate on data in
it. A compute op's ``reuse_bytes`` (bytes the ops just before it touched) are priced
at that rate when the op's ``working_set_bytes`` fit in the rank's share of the cache
(its size over the ranks per node, which share it), the rest of its bytes from the
table: torch's single-tensor AdamW on CPUs keeps each parameter's arrays in the cache
across its eight passes. Without ``cache`` every byte is priced from the table.

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
rank (per-rank mode). calibrate measures it on CPU backends.

A collective of ``size_bytes`` over a group of ``p`` ranks takes ``latency_ns +
size_bytes / bytes_per_s`` alone (nccl-tests' algorithm bandwidth), from the fit of its
group's placement (all its ranks on one node, or not) and the nearest measured size;
concurrent collectives of one node share its one measured channel
(``LinkKind.CHANNEL``), so two at once each take longer.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from commsim.hardware.links import CollectivePlan, Link, LinkKind
from commsim.hardware.sharing import IDLE, Taken
from commsim.hardware.platform import DEFAULT_TIME_SLICE_NS, CpuCores, Platform, RankDrift, platform_of_backend
from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from commsim.util.files import read_json

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

    def call_seconds(self, size_bytes: float) -> float:
        """Host time of the call: piecewise linear between measured sizes (0 unmeasured)."""
        if not self.call_points:
            return 0.0
        if len(self.call_points) < 2:
            return self.call_points[0][1]
        return max(0.0, _piecewise(self.call_points, size_bytes))

    def seconds(self, size_bytes: float) -> float:
        """Transfer time beyond the latency: piecewise linear between measured sizes,
        the last segment's slope beyond them; the latency-bandwidth fit without points."""
        if len(self.points) < 2:
            return size_bytes / self.bytes_per_s
        return max(0.0, _piecewise(self.points, size_bytes) - self.points[0][1])


def _piecewise(pts: tuple[tuple[float, float], ...], x: float) -> float:
    """Linear between the measured (x, y) points (ascending, at least two); the first or
    last segment extended beyond them."""
    i = min(max(bisect.bisect_left([p for p, _ in pts], x), 1), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


# glibc malloc.c DEFAULT_MMAP_THRESHOLD_MAX (4 MiB * sizeof(long): 32 MiB on 64-bit):
# the dynamic mmap threshold never exceeds it, so larger blocks are always mmapped,
# fresh pages (calibrate's allocation table shows the jump across it).
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
    issue_ns: int
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
    # host memory: the first write of a fresh page (fault, kernel zeroing) and its unmap
    # at free, per byte, over what a write to touched memory costs (calibrate measures
    # it; 0: not measured, the allocation table's large-size cost per byte stands in)
    first_touch_ns_per_byte: float = 0.0
    # a collective's fixed latency while its node computes, over its latency alone: on a
    # CPU backend the collective's thread waits for a core at each message (calibrate)
    comm_latency_slowdown_during_compute: float = 1.0
    # each rank's speed drift: sd of its log speed and its correlation time (0: none)
    rank_noise_sd: float = 0.0
    rank_noise_corr_ns: int = 0
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

    @property
    def groups_measured(self) -> tuple[tuple[str, int], ...]:
        """Every (placement, group size) some collective kind was measured with."""
        return tuple(sorted({key for fits in self.collectives.values() for key in fits}))

    def placement(self, group: tuple[int, ...]) -> str:
        """Where a group's ranks sit on this profile's nodes."""
        return INTRA_NODE if len({self.node_of(r) for r in group}) == 1 else INTER_NODE

    def host_malloc_ns(self, size_bytes: int, touch_bytes: int | None = None) -> int:
        """An allocation without a caching allocator in front: measured by size when
        calibrate recorded points, else the latency-bandwidth line. The table was
        measured with zero-filled blocks (every page written). A block of which only
        ``touch_bytes`` are ever written: above glibc's mmap threshold it is fresh pages
        and pays the first touch of what is written; below it the heap's pages are
        already touched and only the fixed cost remains."""
        partial = touch_bytes is not None and touch_bytes < size_bytes
        pts = self.alloc_points
        if len(pts) < 2:  # the line, over the bytes that get written
            return self.malloc_base_ns + int(self.malloc_ns_per_byte * (touch_bytes if partial else size_bytes))
        (x_lo, y_lo), (x_hi, y_hi) = pts[0], pts[-1]
        if partial:
            if size_bytes <= GLIBC_MMAP_THRESHOLD_MAX_BYTES:
                return int(y_lo * 1e9)
            per_byte = self.first_touch_ns_per_byte or y_hi / x_hi * 1e9
            return int(y_lo * 1e9 + per_byte * touch_bytes)
        if size_bytes > x_hi:  # beyond the largest measured size: its cost per byte
            return int(y_hi * size_bytes / x_hi * 1e9)
        if size_bytes < x_lo:  # below the smallest: a fixed cost dominates there
            return int(y_lo * 1e9)
        return max(0, int(_piecewise(pts, size_bytes) * 1e9))

    @cached_property
    def platform(self) -> Platform:
        """The backend's platform, with the cores and rank drift this profile measured."""
        cpu = None
        if self.cpu_cores:
            cpu = CpuCores(self.cpu_cores, self.ranks_per_node, self.time_slice_ns or DEFAULT_TIME_SLICE_NS)
        return platform_of_backend(self.backend, cpu, RankDrift(self.rank_noise_sd, self.rank_noise_corr_ns),
                                   self.caching_allocator)

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
        return max(0.0, _piecewise(pts, nbytes) - pts[0][1])

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
        reused = self._reused_in_cache(op)
        mem_s = self._memory_s(op.bytes_read + op.bytes_written - reused)
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
                              call_ns=int(fit.call_seconds(op.size_bytes) * 1e9))


def _num(obj: dict[str, Any], key: str, where: str, positive: bool = True) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and v <= 0) or v < 0:
        raise CommsimInputError(f"{where}: field {key!r} must be a {'positive' if positive else 'non-negative'} "
                                f"number, got {v!r}")
    return float(v)


def _points(pts: Any, where: str) -> tuple[tuple[float, float], ...]:
    if not isinstance(pts, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) and x >= 0 for x in p) for p in pts):
        raise CommsimInputError(f"{where} must be a list of [bytes, seconds] pairs")
    return tuple(sorted((float(a), float(b)) for a, b in pts))


def _gemm_points(gemm: Any, where: str) -> tuple[tuple[float, float], ...]:
    if not isinstance(gemm, list) or not gemm or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) and x > 0 for x in p) for p in gemm):
        raise CommsimInputError(f"{where} must be a non-empty list of [flops, flops_per_s] pairs")
    return tuple(sorted((float(a), float(b)) for a, b in gemm))


def profile_from_dict(obj: Any, where: str, precision: str | None = None) -> HardwareProfile:
    """``precision`` (fp32 / bf16 / fp16) picks the GEMM curve measured in that dtype."""
    if not isinstance(obj, dict) or obj.get("kind") != "commsim-hw-profile":
        raise CommsimInputError(f"{where}: not a commsim hardware profile (missing \"kind\": \"commsim-hw-profile\")")
    if obj.get("schema_version") != PROFILE_SCHEMA_VERSION:
        raise CommsimInputError(f"{where}: unsupported profile schema version {obj.get('schema_version')!r}; "
                                f"this commsim reads {PROFILE_SCHEMA_VERSION} (it records the devices, nodes and "
                                "group placements measured): re-run commsim calibrate")
    gemm_t = _gemm_points(obj.get("gemm"), f"{where}: field 'gemm'")
    by_dtype = obj.get("gemm_by_dtype", {})
    key = {"fp16": "bf16"}.get(precision or "", precision or "")  # fp16 and bf16 run alike
    if isinstance(by_dtype, dict) and key in by_dtype:
        gemm_t = _gemm_points(by_dtype[key], f"{where}: field 'gemm_by_dtype.{key}'")
    shapes: dict[tuple[int, int, int, int], float] = {}
    table = obj.get("gemm_shapes_by_dtype", {})
    if not isinstance(table, dict):
        raise CommsimInputError(f"{where}: gemm_shapes_by_dtype must be an object of dtype: [[m, n, k, batch, flops_per_s]]")
    dkey = key or str(obj.get("default_dtype", "fp32"))
    for row in table.get(dkey, []):
        if not (isinstance(row, list) and len(row) == 5 and all(isinstance(x, (int, float)) and x > 0 for x in row)):
            raise CommsimInputError(f"{where}: gemm_shapes_by_dtype.{dkey}: rows are [m, n, k, batch, flops_per_s]")
        shapes[(int(row[0]), int(row[1]), int(row[2]), int(row[3]))] = float(row[4])
    copy = obj.get("copy", {})
    alloc = obj.get("alloc", {})
    colls = _collectives(obj.get("collectives", {}), where)
    backend = obj.get("backend")
    if not isinstance(backend, str) or not backend:
        raise CommsimInputError(f"{where}: field 'backend' must name the torch.distributed backend measured "
                                "(nccl, gloo)")
    devices = obj.get("devices")
    if not isinstance(devices, list) or not devices or not all(isinstance(d, str) and d for d in devices):
        raise CommsimInputError(f"{where}: field 'devices' must be a non-empty list of device names")
    return HardwareProfile(
        description=str(obj.get("description", "")),
        backend=backend,
        devices=tuple(devices),
        world_size=_count(obj, "world_size", where),
        nodes=_count(obj, "nodes", where),
        ranks_per_node=_count(obj, "ranks_per_node", where),
        hbm_bytes=int(_num(obj, "memory_bytes", where)),
        kernel_overhead_ns=int(_num(obj, "kernel_overhead_ns", where, positive=False)),
        gemm=gemm_t,
        gemm_shapes=shapes,
        elementwise_bytes_per_s=_num(obj, "elementwise_bytes_per_s", where),
        elementwise_points=tuple(sorted((float(a), float(b)) for a, b in obj.get("elementwise_points", []))),
        d2d_bytes_per_s=_num(copy, "d2d_bytes_per_s", f"{where}: copy"),
        h2d_bytes_per_s=_num(copy, "h2d_bytes_per_s", f"{where}: copy"),
        copy_latency_ns=int(_num(copy, "latency_ns", f"{where}: copy", positive=False)),
        d2h_bytes_per_s=_num(copy, "d2h_bytes_per_s", f"{where}: copy") if "d2h_bytes_per_s" in copy else 0.0,
        d2h_latency_ns=int(_num(copy, "d2h_latency_ns", f"{where}: copy", positive=False))
        if "d2h_latency_ns" in copy else None,
        allocator=_allocator(obj.get("allocator", {}), f"{where}: allocator"),
        collectives=colls,
        comm_slowdown=_num(obj, "comm_slowdown", where),
        comm_slowdown_during_compute=_num(obj, "comm_slowdown_during_compute", where) if
        "comm_slowdown_during_compute" in obj else 1.0,
        comm_latency_slowdown_during_compute=_num(obj, "comm_latency_slowdown_during_compute", where)
        if "comm_latency_slowdown_during_compute" in obj else 1.0,
        issue_ns=int(_num(obj, "issue_ns", where, positive=False)) if "issue_ns" in obj else 0,
        caching_allocator=bool(obj.get("caching_allocator", obj.get("backend") == "nccl")),
        malloc_base_ns=int(_num(alloc, "malloc_base_ns", f"{where}: alloc", positive=False)),
        malloc_ns_per_byte=_num(alloc, "malloc_ns_per_byte", f"{where}: alloc", positive=False),
        free_base_ns=int(_num(alloc, "free_base_ns", f"{where}: alloc", positive=False)),
        free_ns_per_byte=_num(alloc, "free_ns_per_byte", f"{where}: alloc", positive=False),
        alloc_points=_points(alloc.get("points", []), f"{where}: alloc.points"),
        cpu_cores=int(_num(obj, "cpu_cores", where)) if obj.get("cpu_cores") is not None else None,
        time_slice_ns=int(_num(obj, "time_slice_ns", where)) if obj.get("time_slice_ns") is not None else 0,
        first_touch_ns_per_byte=_num(alloc, "first_touch_ns_per_byte", f"{where}: alloc", positive=False)
        if "first_touch_ns_per_byte" in alloc else 0.0,
        **_rank_noise(obj.get("rank_noise"), f"{where}: rank_noise"),
        **_cache(obj.get("cache"), f"{where}: cache"),
    )


def _count(obj: dict[str, Any], key: str, where: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CommsimInputError(f"{where}: field {key!r} must be a positive integer, got {v!r}")
    return v


def _collectives(table: Any, where: str) -> dict[str, dict[tuple[str, int], CollectiveFit]]:
    """kind -> placement -> group size -> fit, read into kind -> (placement, size) -> fit."""
    allowed = {k.value for k in O.CollectiveKind}
    if not isinstance(table, dict):
        raise CommsimInputError(f"{where}: collectives must be an object kind -> placement -> group size -> fit")
    colls: dict[str, dict[tuple[str, int], CollectiveFit]] = {}
    for kind, by_place in table.items():
        if kind not in allowed:
            raise CommsimInputError(f"{where}: collectives.{kind}: not one of {', '.join(sorted(allowed))}")
        if not isinstance(by_place, dict):
            raise CommsimInputError(f"{where}: collectives.{kind}: an object placement -> group size -> fit")
        colls[kind] = {}
        for place, sizes in by_place.items():
            if place not in PLACEMENTS or not isinstance(sizes, dict):
                raise CommsimInputError(f"{where}: collectives.{kind}.{place}: placements are {' and '.join(PLACEMENTS)},"
                                        " each an object group size -> fit")
            for p, fit in sizes.items():
                w = f"{where}: collectives.{kind}.{place}.{p}"
                if not str(p).isdigit() or int(p) < 2 or not isinstance(fit, dict):
                    raise CommsimInputError(f"{w}: group sizes are integers >= 2, each with a fit object")
                pts = {}
                for key in ("points", "call_points"):
                    q = fit.get(key, [])
                    if not isinstance(q, list) or not all(isinstance(x, list) and len(x) == 2 for x in q):
                        raise CommsimInputError(f"{w}: {key} must be a list of [bytes, seconds] pairs")
                    pts[key] = tuple(sorted((float(a), float(b)) for a, b in q))
                colls[kind][(place, int(p))] = CollectiveFit(int(_num(fit, "latency_ns", w, positive=False)),
                                                             _num(fit, "bytes_per_s", w), pts["points"],
                                                             pts["call_points"])
    return colls


def _allocator(stats: Any, where: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(stats, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in stats.values()):
        raise CommsimInputError(f"{where}: must be an object of integer statistics (torch.cuda.memory_stats)")
    return tuple(sorted(stats.items()))


def _rank_noise(noise: Any, where: str) -> dict[str, Any]:
    if noise is None:
        return {}
    if not isinstance(noise, dict):
        raise CommsimInputError(f"{where}: must be an object {{\"sd\": >= 0, \"corr_ns\": > 0 (>= 0 when sd is 0)}}")
    sd = _num(noise, "sd", where, positive=False)
    corr = _num(noise, "corr_ns", where, positive=bool(sd))
    return {"rank_noise_sd": sd, "rank_noise_corr_ns": int(corr)}


def _cache(cache: Any, where: str) -> dict[str, Any]:
    if cache is None:
        return {}
    if not isinstance(cache, dict) or not isinstance(cache.get("bytes"), int) or isinstance(cache["bytes"], bool) \
            or cache["bytes"] < 1:
        raise CommsimInputError(f"{where}: must be an object {{\"bytes\": a positive integer, "
                                "\"bytes_per_s\": a positive number}")
    return {"cache_bytes": cache["bytes"], "cache_bytes_per_s": _num(cache, "bytes_per_s", where)}


def load_profile(path: str | Path, precision: str | None = None) -> HardwareProfile:
    return profile_from_dict(read_json(path, CommsimInputError), str(path), precision)


def mean_profile(a: Any, b: Any, where: str = "profile") -> Any:
    """The mean of two profile documents from the same calibration command (say, one
    taken right before a run and one right after, on a machine whose speed drifts):
    every number averaged (integers rounded), lists element by element, objects key
    by key; strings and booleans must agree. Measured sizes (the bytes or shapes
    that tables are keyed by) are equal in both, so they average to themselves. A
    different structure is an error naming the first place that differs."""
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or a is None:
        if a != b:
            raise CommsimInputError(f"{where}: {a!r} differs from {b!r}; average profiles of one calibration command")
        return a
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        m = (a + b) / 2
        return round(m) if isinstance(a, int) and isinstance(b, int) else m
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [mean_profile(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return {k: mean_profile(a[k], b[k], f"{where}.{k}") for k in a}
    raise CommsimInputError(f"{where}: the two profiles differ in structure here; "
                            "average profiles of one calibration command")
