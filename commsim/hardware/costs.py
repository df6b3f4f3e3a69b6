"""Cost functions: how long a kernel, a copy or a collective takes on given hardware.

Pure functions of the op and the hardware, unit-tested without SimPy. Collectives are
described as a fixed latency plus byte *demands* on links (a node's NICs, a GPU's
NVLink), so the simulator can share link bandwidth between concurrent transfers.

Kernels: a roofline with a GEMM efficiency that falls for small GEMMs by wave
quantisation (output tiles of 128x128 spread over the SMs: a GEMM of fewer tiles than
SMs leaves SMs idle), plus a fixed per-kernel device overhead.

Collectives follow NCCL's cost model (NVIDIA/nccl src/graph/tuning.cc): time =
latency + bytes / bandwidth, ring latency = base + intra_steps x NVLink hop +
inter_steps x network hop, with the LL protocol (lower latency, half the bandwidth:
8-byte lines carry 4 data bytes) and Simple (full bandwidth); tree for all-reduce
across nodes; the cheapest is chosen per call, as NCCL does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from math import ceil, log2
from typing import NamedTuple, Protocol

from commsim.hardware.platform import GPU, Platform
from commsim.hardware.specs import US, ClusterSpec
from commsim.ir import ops as O

# NCCL tuning.cc (2.18+): base latency per algorithm/protocol and per-hop latencies, us.
NCCL_BASE_LAT_US = {("ring", "LL"): 6.6, ("ring", "Simple"): 8.4, ("tree", "LL"): 6.8, ("tree", "Simple"): 6.8}
NCCL_NVLINK_HOP_US = {("ring", "LL"): 0.6, ("ring", "Simple"): 3.4, ("tree", "LL"): 0.6, ("tree", "Simple"): 4.0}
NCCL_NET_HOP_US = {("ring", "LL"): 2.7, ("ring", "Simple"): 14.0, ("tree", "LL"): 5.0, ("tree", "Simple"): 14.0}
PROTOCOL_BW_FACTOR = {"LL": 0.5, "Simple": 1.0}  # LL: 4 data bytes per 8-byte line
GEMM_TILE = 128  # cuBLAS tensor-core CTA tile edge for large bf16 GEMMs
NCCL_CHANNELS = 8  # CTAs (SMs) NCCL occupies while a collective runs (NCCL_MIN_NCHANNELS class)
SMALL_COPY_LATENCY_NS = 10 * US  # a small cudaMemcpy across PCIe, end to end


class LinkKind(enum.Enum):
    NIC = "nic"  # a node's network interfaces to the other nodes, pooled
    NVLINK = "nvlink"  # a GPU's NVLink / NVSwitch port inside the node
    CHANNEL = "channel"  # a measured profile's one communication channel per node (all kinds share it)


class Link(NamedTuple):
    """A link whose bandwidth concurrent transfers share: its kind and its node.
    (A named tuple: the simulator hashes links on every rate change.)"""

    kind: LinkKind
    node: int


@dataclass(frozen=True, slots=True)
class CollectivePlan:
    """How a collective runs: algorithm, fixed latency, and bytes each link must carry."""

    algorithm: str  # e.g. "ring/Simple"
    latency_ns: int
    demands: tuple[tuple[Link, float], ...]  # (link, bytes) pairs


class CostModel(Protocol):
    """What things cost on one machine, and how it executes them (``platform``).

    Prices only: how ops are run (queued or inline, caching allocator or malloc, issue
    order, cores, drift) is the platform's to say, and the simulator's to act on."""

    platform: Platform
    ranks_per_node: int  # ranks (GPUs, or CPU processes) per node
    hbm_bytes: int  # device (or host) memory per rank
    describe: str

    def compute_ns(self, op: O.Compute) -> int: ...
    def copy_ns(self, op: O.Copy) -> int: ...
    def collective(self, op: O.Collective) -> CollectivePlan: ...
    def link_capacity(self, link: Link) -> float: ...
    def node_of(self, rank: int) -> int: ...
    # an allocation with no cache in front, of which touch_bytes (None: all) get written
    def host_malloc_ns(self, size_bytes: int, touch_bytes: int | None = None) -> int: ...

    # interference: compute runs this much slower while its rank communicates; a
    # collective's bandwidth, and its fixed latency, this much slower while its node computes
    comm_slowdown: float
    comm_slowdown_during_compute: float
    comm_latency_slowdown_during_compute: float
    issue_ns: int  # host time to hand one device op to its stream
    # caching allocator misses: cudaMalloc / cudaFree of a segment
    malloc_base_ns: int
    malloc_ns_per_byte: float
    free_base_ns: int
    free_ns_per_byte: float


class SpecCostModel:
    """Costs from public specs (hardware presets)."""

    # cudaMalloc / cudaFree: "tens of microseconds to milliseconds" (reference/
    # allocator.md); modelled as a fixed part plus a part growing with the size
    # (page-table mapping), about 1 ms per 2 GiB. Calibration replaces these.
    malloc_base_ns = 30 * US
    malloc_ns_per_byte = 1e6 / 2**31
    free_base_ns = 30 * US
    free_ns_per_byte = 1e6 / 2**31

    def __init__(self, cluster: ClusterSpec, precision: str = "bf16"):
        self.cluster = cluster
        node = cluster.node
        self.gpu = node.gpu
        self.gpus_per_node = self.ranks_per_node = node.gpus_per_node
        self.platform = GPU
        peak = self.gpu.peak_tensor_flops_per_s
        # fp32 training runs its GEMMs as TF32: half the bf16 tensor peak on A100/H100.
        self.gemm_peak = peak / 2 if precision == "fp32" else peak
        self.mem_bw = self.gpu.hbm_bw_bytes_per_s * self.gpu.hbm_efficiency
        self.nvl_bw = node.nvlink_bw_bytes_per_s * node.nvlink_efficiency
        self.nic_bw = node.fabric.node_bw_bytes_per_s
        self.comm_slowdown = 1.0 + NCCL_CHANNELS / self.gpu.sm_count
        # NCCL's copies run on their own SMs and DMA: collectives are not slowed by compute
        self.comm_slowdown_during_compute = 1.0
        self.comm_latency_slowdown_during_compute = 1.0
        # issuing a device op costs host time only through the schedule's own launch ops
        self.issue_ns = 0
        self.hbm_bytes = self.gpu.hbm_bytes
        self.describe = cluster.name

    # ------------------------------------------------------------ kernels
    def _wave_efficiency(self, g: O.GemmShape) -> float:
        tiles = ceil(g.m / GEMM_TILE) * ceil(g.n / GEMM_TILE) * g.batch
        waves = ceil(tiles / self.gpu.sm_count)
        return tiles / (waves * self.gpu.sm_count)

    def compute_ns(self, op: O.Compute) -> int:
        mem_s = (op.bytes_read + op.bytes_written) / self.mem_bw
        if op.kind in (O.ComputeKind.GEMM, O.ComputeKind.ATTENTION) and op.gemm is not None:
            eff = self.gpu.gemm_max_efficiency * self._wave_efficiency(op.gemm)
            flop_s = op.flops / (self.gemm_peak * eff)
        else:
            flop_s = op.flops / self.gpu.peak_fp32_flops_per_s
        return self.gpu.kernel_overhead_ns + int(max(mem_s, flop_s) * 1e9)

    def copy_ns(self, op: O.Copy) -> int:
        if op.direction is O.CopyDirection.D2D:
            return self.gpu.kernel_overhead_ns + int(2 * op.size_bytes / self.mem_bw * 1e9)
        return SMALL_COPY_LATENCY_NS + int(op.size_bytes / self.cluster.node.pcie_bw_bytes_per_s * 1e9)

    # ------------------------------------------------------------ collectives
    def host_malloc_ns(self, size_bytes: int, touch_bytes: int | None = None) -> int:
        # cudaMalloc maps the whole segment whatever is written later
        return self.malloc_base_ns + int(self.malloc_ns_per_byte * size_bytes)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link_capacity(self, link: Link) -> float:
        return self.nic_bw if link.kind is LinkKind.NIC else self.nvl_bw

    def collective(self, op: O.Collective) -> CollectivePlan:
        group = op.group
        p = len(group)
        nodes = sorted({self.node_of(r) for r in group})
        n = len(nodes)
        g = max(sum(1 for r in group if self.node_of(r) == nd) for nd in nodes)
        s = float(op.size_bytes)
        if p == 1:
            return CollectivePlan("local", self.gpu.kernel_overhead_ns, ())
        kind = op.kind
        # Bytes through each link, one direction, for a ring: every rank sends (p-1)/p of
        # the buffer per pass (two passes for all-reduce); a node's NICs carry what its
        # ring crosses (nccl-tests PERFORMANCE.md busbw factors).
        passes = 2.0 if kind is O.CollectiveKind.ALL_REDUCE else 1.0
        ring_bytes = passes * s * (p - 1) / p
        if kind is O.CollectiveKind.BROADCAST:
            ring_bytes = s
        steps = int(passes * (p - 1))
        inter_steps = int(passes * (n - 1))
        options = []
        for proto in ("LL", "Simple"):
            lat_us = (NCCL_BASE_LAT_US[("ring", proto)] + (steps - inter_steps) * NCCL_NVLINK_HOP_US[("ring", proto)]
                      + inter_steps * NCCL_NET_HOP_US[("ring", proto)])
            lat_ns = int(lat_us * US) + inter_steps * self.cluster.node.fabric.latency_ns
            demand = ring_bytes / PROTOCOL_BW_FACTOR[proto]
            dem = [(Link(LinkKind.NVLINK, nd), demand) for nd in nodes]
            if n > 1:
                dem += [(Link(LinkKind.NIC, nd), demand) for nd in nodes]
            options.append((f"ring/{proto}", lat_ns, tuple(dem)))
            if kind is O.CollectiveKind.ALL_REDUCE and n > 1:
                # Double binary tree: a node sends and receives the buffer once each way;
                # intra-node chain of g ranks, log2(n) network hops, up and down.
                lat_us = (NCCL_BASE_LAT_US[("tree", proto)]
                          + 2 * ((g - 1) * NCCL_NVLINK_HOP_US[("tree", proto)]
                                 + ceil(log2(n)) * NCCL_NET_HOP_US[("tree", proto)]))
                lat_ns = int(lat_us * US) + 2 * ceil(log2(n)) * self.cluster.node.fabric.latency_ns
                tdem = s / PROTOCOL_BW_FACTOR[proto]
                options.append((f"tree/{proto}", lat_ns,
                                tuple([(Link(LinkKind.NVLINK, nd), tdem) for nd in nodes]
                                      + [(Link(LinkKind.NIC, nd), tdem) for nd in nodes])))

        def est(o: tuple[str, int, tuple]) -> float:
            return o[1] + max(b / self.link_capacity(l) for l, b in o[2]) * 1e9

        algo, lat, dem = min(options, key=est)
        return CollectivePlan(algo, lat, dem)
