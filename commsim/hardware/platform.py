"""How a machine executes a schedule: one typed value, apart from what things cost.

A GPU and a CPU run the same schedule differently, and the difference is one idea:

* **kernels**: a GPU queues them on its streams and the host thread runs ahead; a CPU
  (gloo) runs each one on the host thread when the host reaches it, after its inputs;
* **memory**: a GPU's allocations go through PyTorch's caching allocator (a miss maps a
  segment, a miss with no room flushes the cache); a CPU's go to malloc every time,
  each priced by its size;
* **collective issue order**: NCCL launches a stream's collective when that stream
  reaches it; gloo matches a group's collectives by call order, so they reach the
  backend in the order the host issued them, whatever stream they are on;
* **cores**: on a CPU node with more ranks than cores, the OS time-slices every rank's
  host thread and the backend's threads (``CpuCores``);
* **rank drift**: a CPU rank's speed drifts apart from the others' (other threads, the
  OS and, on a VM, other tenants share its core), measured by ``commsim calibrate``;
* **rank stalls**: and, on a short time scale, each rank loses time in stalls of its
  own (a kernel interrupted by the OS, another thread or the hypervisor), which every
  later synchronisation makes the other ranks wait out (``RankStalls``).

A preset (``SpecCostModel``) or a measured profile (``HardwareProfile``) yields one; the
simulator (``commsim.sim``) and the executor (``runtime``) pick their rank behaviour
from it, and the cost model keeps only the prices.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from commsim.ir.errors import CommsimInputError


# Linux's time slice between runnable threads, for profiles that did not measure it:
# EEVDF's base slice (0.75 ms x (1 + log2 cores), kernel/sched/fair.c) is enforced at
# the scheduler tick, 4 ms at CONFIG_HZ=250. `commsim calibrate` measures it.
DEFAULT_TIME_SLICE_NS = 4_000_000


class KernelExecution(enum.Enum):
    QUEUED = "queued"  # kernels queued on device streams; the host runs ahead (GPUs)
    INLINE = "inline"  # kernels run on the host thread when it reaches them (CPUs)


class MemoryModel(enum.Enum):
    CACHING_ALLOCATOR = "caching_allocator"  # PyTorch's CUDA caching allocator
    MALLOC = "malloc"  # host malloc every time, priced by size


class CollectiveOrder(enum.Enum):
    STREAM = "stream"  # each stream's collectives start when the stream reaches them (NCCL)
    PROGRAM = "program"  # collectives reach the backend in the host's issue order (gloo)


@dataclass(frozen=True, slots=True)
class CpuCores:
    """A CPU node's cores shared by its ranks, and the OS time slice between threads."""

    cores: int
    ranks_per_node: int
    time_slice_ns: int

    def __post_init__(self) -> None:
        assert self.cores >= 1 and self.ranks_per_node >= 1 and self.time_slice_ns > 0, self

    @property
    def oversubscribed(self) -> bool:
        """More ranks than cores: their time slices shape the step."""
        return self.ranks_per_node > self.cores

    @property
    def core_share(self) -> float:
        """The share of a core each rank had while all of them were busy at once."""
        return self.cores / self.ranks_per_node


@dataclass(frozen=True, slots=True)
class RankDrift:
    """Each rank's speed drifting on its own: an Ornstein-Uhlenbeck process of log speed
    with this standard deviation and correlation time (sd 0: no drift), plus a second,
    slower one where the machine has it (``slow_sd``, ``slow_corr_ns``: a core running
    slower for seconds), independent of the first."""

    sd: float = 0.0
    corr_ns: int = 0
    slow_sd: float = 0.0
    slow_corr_ns: int = 0

    def __post_init__(self) -> None:
        for sd, corr in ((self.sd, self.corr_ns), (self.slow_sd, self.slow_corr_ns)):
            if sd < 0 or (sd and corr <= 0):
                raise CommsimInputError(f"rank drift sd {sd}, correlation {corr} ns: the sd must be >= 0 "
                                        "and, when it is not 0, the correlation time > 0")

    def __bool__(self) -> bool:
        return self.sd > 0 or self.slow_sd > 0


NO_DRIFT = RankDrift()


@dataclass(frozen=True, slots=True)
class RankStalls:
    """Each rank's stalls, independent of the other ranks': they arrive at
    ``rate_per_s`` per second of the rank's undisturbed work (Poisson), each as long as
    a draw from ``lengths_ns`` (equally likely values: quantiles of the measured stall
    lengths). A kernel's measured mean time already holds its share of them, so the
    simulator runs ``mean / (1 + loss)`` of undisturbed work plus the stalls drawn for
    it: the mean stays, and each synchronisation pays for whichever rank stalled.
    Measured by calibrate on CPU backends (``runtime.calibrate_cpu.rank_noise``)."""

    rate_per_s: float = 0.0
    lengths_ns: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.rate_per_s < 0 or (self.rate_per_s and not self.lengths_ns) \
                or any(x < 0 for x in self.lengths_ns):
            raise CommsimInputError(f"rank stalls rate {self.rate_per_s}/s, lengths {list(self.lengths_ns)} ns: "
                                    "the rate must be >= 0 and, when it is not 0, the lengths non-empty and >= 0")

    @property
    def loss(self) -> float:
        """Stall time per unit of undisturbed work: rate x mean length."""
        if not self.rate_per_s:
            return 0.0
        return self.rate_per_s * sum(self.lengths_ns) / len(self.lengths_ns) / 1e9

    def __bool__(self) -> bool:
        return self.rate_per_s > 0 and any(self.lengths_ns)


NO_STALLS = RankStalls()


@dataclass(frozen=True, slots=True)
class Platform:
    """How one machine kind executes a schedule (see the module docstring)."""

    backend: str  # the torch.distributed backend: "nccl" or "gloo"
    kernels: KernelExecution
    memory: MemoryModel
    collective_order: CollectiveOrder
    # cudaMalloc synchronises the device before mapping a new segment (allocator.md)
    malloc_syncs_device: bool
    cpu: CpuCores | None = None  # CPU backends whose cores were measured
    drift: RankDrift = NO_DRIFT
    stalls: RankStalls = NO_STALLS
    # the relative standard deviation of one host op's time (the framework's Python, the
    # OS, the allocator), independent per op and rank: each synchronisation then waits
    # for whichever rank's host is latest (0: not measured, hosts run like clockwork)
    host_jitter: float = 0.0

    @property
    def inline_kernels(self) -> bool:
        return self.kernels is KernelExecution.INLINE

    @property
    def caching_allocator(self) -> bool:
        return self.memory is MemoryModel.CACHING_ALLOCATOR

    @property
    def program_order_collectives(self) -> bool:
        return self.collective_order is CollectiveOrder.PROGRAM

    @property
    def time_sliced(self) -> bool:
        """More ranks on a node than cores: the simulator runs the OS scheduler."""
        return self.cpu is not None and self.cpu.oversubscribed

    @property
    def describe(self) -> str:
        if self.kernels is KernelExecution.QUEUED:
            return f"{self.backend}: kernels queued on streams, caching allocator"
        out = f"{self.backend}: kernels on the host thread, malloc, collectives in program order"
        if self.cpu is not None:
            out += f", {self.cpu.ranks_per_node} ranks per node on {self.cpu.cores} cores"
        return out


GPU = Platform("nccl", KernelExecution.QUEUED, MemoryModel.CACHING_ALLOCATOR, CollectiveOrder.STREAM,
               malloc_syncs_device=True)
CPU = Platform("gloo", KernelExecution.INLINE, MemoryModel.MALLOC, CollectiveOrder.PROGRAM,
               malloc_syncs_device=False)

BACKENDS = {"nccl": GPU, "gloo": CPU}


def platform_of_backend(backend: str, cpu: CpuCores | None = None, drift: RankDrift = NO_DRIFT,
                        caching_allocator: bool | None = None, stalls: RankStalls = NO_STALLS) -> Platform:
    """The platform a torch.distributed backend runs on: NCCL on GPUs, anything else
    (gloo, mpi) on CPUs. ``cpu``, ``drift`` and ``stalls`` apply to CPU backends
    (measured); ``caching_allocator`` overrides the memory model where a profile says so."""
    base = GPU if backend == "nccl" else CPU
    memory = base.memory
    if caching_allocator is not None:
        memory = MemoryModel.CACHING_ALLOCATOR if caching_allocator else MemoryModel.MALLOC
    if base is GPU:
        return Platform(backend, base.kernels, memory, base.collective_order, base.malloc_syncs_device, None, drift)
    return Platform(backend or "gloo", base.kernels, memory, base.collective_order, base.malloc_syncs_device, cpu,
                    drift, stalls)
