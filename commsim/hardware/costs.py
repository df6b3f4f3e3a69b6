"""What things cost on a machine: the ``CostModel`` protocol, and the one from public specs.

A cost model prices ops: a kernel's, a copy's and an allocation's time, a collective's
plan (latency plus byte demands on ``links``), link capacities, and how much compute
and communication slow each other. How a machine executes ops (queued or inline, the
caching allocator or malloc, issue order) is its ``platform``, which every cost model
carries. ``SpecCostModel`` derives everything from public specs (``specs``): kernels by
``gpu_kernels``, collectives by ``nccl``; ``profile.HardwareProfile`` from measurements.
"""

from __future__ import annotations

from typing import Protocol

from commsim.hardware.gpu_kernels import GpuKernels
from commsim.hardware.links import CollectivePlan, Link, LinkKind
from commsim.hardware.nccl import NcclModel
from commsim.hardware.platform import GPU, Platform
from commsim.hardware.sharing import IDLE, GpuResources, Taken
from commsim.hardware.specs import US, ClusterSpec
from commsim.ir import ops as O

__all__ = ["CostModel", "SpecCostModel", "CollectivePlan", "Link", "LinkKind"]


class CostModel(Protocol):
    """What things cost on one machine, and how it executes them (``platform``).

    Prices only: how ops are run (queued or inline, caching allocator or malloc, issue
    order, cores, drift) is the platform's to say, and the simulator's to act on."""

    platform: Platform
    ranks_per_node: int  # ranks (GPUs, or CPU processes) per node
    hbm_bytes: int  # device (or host) memory per rank
    describe: str

    # a GPU's SMs and HBM bandwidth that kernels and collectives share (None: the
    # model prices interference by measured factors instead: comm_slowdown, ...)
    gpu_resources: GpuResources | None

    def compute_ns(self, op: O.Compute, taken: Taken = IDLE) -> int: ...
    def kernel_hbm_bytes(self, op: O.Compute) -> float: ...
    def copy_ns(self, op: O.Copy) -> int: ...
    def collective(self, op: O.Collective) -> CollectivePlan: ...
    def link_capacity(self, link: Link) -> float: ...
    def node_of(self, rank: int) -> int: ...
    # an allocation with no cache in front, of which touch_bytes (None: all) get written
    def host_malloc_ns(self, size_bytes: int, touch_bytes: int | None = None) -> int: ...
    # a framework's tensors on a CPU: what one byte of fresh pages costs at its first
    # write (which bytes are fresh is the simulator's to say: sim.host_heap); None:
    # allocations are priced by size alone (host_malloc_ns)
    def fresh_page_ns_per_byte(self) -> float | None: ...
    # host pages written and handed back to the OS at a free (munmap, heap trim): their
    # teardown, on the freeing thread; 0 where blocks are cached
    def host_unmap_ns(self, nbytes: int) -> int: ...
    # a CPU rank in a virtual machine that reports free memory to its hypervisor: the
    # reporting period (ns) and a reported page's extra first-write cost (ns a byte);
    # None: no page is priced as reported (sim.returned_pages)
    def reported_pages(self) -> tuple[int, float] | None: ...
    # a framework's Python (hooks, bookkeeping), timed back to back, run by a rank whose
    # collectives ran since its last Python (``cold``): on a CPU rank the backend's
    # threads ran on its cores meanwhile and it finds its caches cold (profiles:
    # ``python_cold_factor``); on a GPU host the collectives run on the device
    def framework_python_ns(self, duration_ns: int, cold: bool) -> int: ...

    # interference by measured factors (profiles; a model with gpu_resources derives it
    # instead): compute runs this much slower while its rank communicates; a collective's
    # bandwidth, and its fixed latency, this much slower while its node computes
    comm_slowdown: float
    comm_slowdown_during_compute: float
    comm_latency_slowdown_during_compute: float
    issue_ns: int  # host time to hand one device op to its stream
    # the executor's loop per host op, by kind ("work", "sync", "alloc", "free"; absent:
    # 0), and inside a host work's and a sync's record ("work_record", "sync_record")
    def host_op_ns(self) -> dict[str, int]: ...
    # CPUs: what the host's next Python pays after a kernel ran on the host thread (its
    # data took the caches); 0 where kernels are queued on a device
    def python_after_kernel_ns(self, op: O.Compute | O.Copy) -> int: ...
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
        self.kernels = GpuKernels(self.gpu, node.pcie_bw_bytes_per_s, precision)
        self.gpu_resources = self.kernels.resources
        self.nvl_bw = node.nvlink_bw_bytes_per_s * node.nvlink_efficiency
        self.nic_bw = node.fabric.node_bw_bytes_per_s
        self.nccl = NcclModel(node)
        # interference comes from sharing gpu_resources (sharing.py), not from factors
        self.comm_slowdown = 1.0
        self.comm_slowdown_during_compute = 1.0
        self.comm_latency_slowdown_during_compute = 1.0
        # issuing a device op costs host time only through the schedule's own launch ops
        self.issue_ns = 0
        self.hbm_bytes = self.gpu.hbm_bytes
        self.describe = cluster.name

    def compute_ns(self, op: O.Compute, taken: Taken = IDLE) -> int:
        # An op's reuse_bytes / working_set_bytes are not priced here: the reuse they state
        # comes from torch's single-tensor optimizer, which runs on CPUs only (on GPUs its
        # AdamW is foreach, whose passes stream every parameter: no reuse stated).
        return self.kernels.compute_ns(op, taken)

    def kernel_hbm_bytes(self, op: O.Compute) -> float:
        return self.kernels.needs(op).hbm_bytes

    def copy_ns(self, op: O.Copy) -> int:
        return self.kernels.copy_ns(op)

    def host_malloc_ns(self, size_bytes: int, touch_bytes: int | None = None) -> int:
        # cudaMalloc maps the whole segment whatever is written later
        return self.malloc_base_ns + int(self.malloc_ns_per_byte * size_bytes)

    def fresh_page_ns_per_byte(self) -> float | None:
        return None  # GPUs: the caching allocator

    def reported_pages(self) -> tuple[int, float] | None:
        return None  # device memory: cudaMalloc's segments, cached

    def host_unmap_ns(self, nbytes: int) -> int:
        return 0  # the caching allocator keeps freed blocks

    def host_op_ns(self) -> dict[str, int]:
        return {}  # a framework's host costs are its schedule's host ops

    def python_after_kernel_ns(self, op: O.Compute | O.Copy) -> int:
        return 0  # kernels run on the device: the host's caches stay its own

    def framework_python_ns(self, duration_ns: int, cold: bool) -> int:
        return duration_ns  # NCCL runs on the device, not on the host's cores

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link_capacity(self, link: Link) -> float:
        if link.kind is LinkKind.NIC:
            return self.nic_bw
        return self.gpu_resources.hbm_bytes_per_s if link.kind is LinkKind.HBM else self.nvl_bw

    def collective(self, op: O.Collective) -> CollectivePlan:
        return self.nccl.plan(op, self.node_of, self.link_capacity, self.gpu.kernel_overhead_ns)
