"""What a simulation produces: per-op records, host blocks, per-rank and step results.

Times are integer nanoseconds. After a run they are relative to the start of the
measured step (the first rank's); the warm-up steps before it leave no records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from commsim.ir import ops as O
from commsim.sim.allocator import CachingAllocator
from commsim.sim.host_gc import HostGc

HOST = "host"  # the stream name under which a rank's host ops are recorded


@dataclass(frozen=True, slots=True)
class SimConfig:
    mode: str = "auto"  # "symmetric", "per-rank" or "auto"
    seed: int = 0
    # Relative standard deviation of compute-kernel durations per rank (None: 1% in
    # per-rank mode, 0 in symmetric mode). Run-to-run kernel variation of about 1% is
    # typical on datacenter GPUs; `commsim calibrate` measures it.
    jitter: float | None = None
    # A rank's speed drifting over time (per-rank mode): every kernel and copy of a rank
    # is scaled by exp(x(t)), x an Ornstein-Uhlenbeck process of this standard deviation
    # and correlation time, independent per rank. None: the platform's measured drift
    # (``commsim calibrate`` on CPU backends, with its slow component), else none; set,
    # it replaces the platform's drift whole.
    rank_noise_sd: float | None = None
    rank_noise_corr_ns: int | None = None
    # Each rank's short stalls of its own, as the platform measured them (RankStalls),
    # drawn per kernel and host op in per-rank mode; False: none.
    rank_stalls: bool = True
    # A framework's CPU tensors: which get fresh pages. False: glibc's fixed ceiling only
    # (heap sizes reuse touched pages, 32 MiB and up are mapped afresh); True: the rank's
    # heap as glibc runs it (host_heap.py: thresholds, growth, trims), whose input is the
    # schedule's allocations alone (see traces/README.md for how each fares).
    host_heap: bool = False
    # Relative sd of each host op's time, per rank (None: the platform's). Per-rank mode
    # draws it; symmetric mode adds the expected lateness of a collective's slowest member
    # (order statistics, see rank.py).
    host_jitter: float | None = None
    # Each rank's full garbage collections (host_gc.HostGc: a pause every so many steps of
    # its host work, every rank's at the same point or each at its own phase). None:
    # none, as in a loop that turned the collector off and collects on every rank at once.
    host_gc: HostGc | None = None
    launch_queue_depth: int = 1024  # CUDA's pending-launch queue holds about 1024 kernels
    alloc_hit_ns: int = 1_000  # caching-allocator hit: about 1 us of host time (allocator.md)
    keep_trace: bool = True
    # Steps simulated before the measured one, so the caching allocator starts the
    # measured step warm, as in steady-state training. None: until the allocator has
    # settled (GPU platforms): a step that still adds a segment (a cudaMalloc or a
    # flush) is not steady state and the next one is measured instead, up to
    # warmup.SETTLE_MAX_STEPS; CPU platforms warm up one step, as the executor does.
    warmup_steps: int | None = None


@dataclass(slots=True)
class OpRecord:
    rank: int
    stream: str
    op: O.Op
    issue_ns: int
    start_ns: int
    end_ns: int
    wait_peers_ns: int = 0  # collective: time waiting for the slowest member
    last_dep: O.OpId | None = None  # which dep finished last (None: none, or issue was last)
    ready_ns: int = 0  # when deps and stream order allowed it to start


@dataclass(slots=True)
class HostBlock:
    """An interval in which the host was blocked, and why."""

    start_ns: int
    end_ns: int
    reason: str


@dataclass
class RankResult:
    rank: int
    start_ns: int = 0  # when the measured step began on this rank
    records: list[OpRecord] = field(default_factory=list)
    host_blocks: list[HostBlock] = field(default_factory=list)
    end_ns: int = 0
    allocator: CachingAllocator | None = None
    flush_times_ns: list[int] = field(default_factory=list)
    memory_samples: list[tuple[int, int, int]] = field(default_factory=list)  # (t, allocated, reserved)
    # a framework's CPU run: bytes of fresh host pages its allocations wrote, by phase
    # (the minor page faults a real run counts, times the page size)
    fresh_page_bytes: dict[str, int] = field(default_factory=dict)
    # of the large blocks' fresh pages, those the guest had reported to its hypervisor
    # (sim.returned_pages), by phase
    reported_page_bytes: dict[str, int] = field(default_factory=dict)
    # host time the ranks' full garbage collections added to this rank's host ops (host_gc):
    # its own passes (per-rank mode), or the expected passes of every rank (symmetric)
    gc_pause_ns: int = 0
    new_segment_bytes: int = 0  # segments the measured step cudaMalloc'd

    def clear(self) -> None:
        """Forget the warm-up: the measured step starts now."""
        self.gc_pause_ns = 0
        self.fresh_page_bytes.clear()
        self.reported_page_bytes.clear()
        self.records.clear()
        self.host_blocks.clear()
        self.flush_times_ns.clear()
        self.memory_samples.clear()

    def shift(self, t0: int) -> None:
        """Times relative to ``t0`` (the measured step's start)."""
        for r in self.records:
            r.issue_ns -= t0
            r.start_ns -= t0
            r.end_ns -= t0
            r.ready_ns -= t0
        for hb in self.host_blocks:
            hb.start_ns -= t0
            hb.end_ns -= t0
        self.flush_times_ns = [t - t0 for t in self.flush_times_ns]
        self.memory_samples = [(t - t0, a, b) for t, a, b in self.memory_samples]
        self.start_ns -= t0


@dataclass
class SimResult:
    mode: str
    ranks: dict[int, RankResult]
    step_time_ns: int
    oom: str | None = None
    seed: int = 0
    jitter: float = 0.0
    host_jitter: float = 0.0  # the relative sd of host ops' times the run drew or priced
    host_gc: HostGc | None = None  # the ranks' full garbage collections it drew or priced
    cpu_sharing: str = ""  # with more ranks than cores: how the simulated scheduler shared them
    rank_noise: tuple[float, int] = (0.0, 0)  # (sd, correlation ns) of the ranks' speed drift
    rank_noise_slow: tuple[float, int] = (0.0, 0)  # its slower second component, where measured
    rank_stalls: tuple[float, float] = (0.0, 0.0)  # the ranks' stalls: (a second of work, loss)
    step_samples_ns: tuple[int, ...] = ()  # with rank noise: every seeded step's time (median chosen)
    # with rank noise: every seeded step's ops on every rank as (rank, op id, phase, start,
    # end) ns, a collective starting where the rank reached it (its wait for peers
    # included), so a phase's or an op's time can be the median over the samples as the
    # step's is (``sample_spans``; ``report.compare``)
    step_samples_spans: tuple[tuple[tuple[int, int, str, int, int], ...], ...] = ()
    warmup_steps: int = 0  # the steps simulated before the measured one
    # whether the measured step added no segment to the caching allocator (None: the
    # warm-up was fixed and not checked, or the step did not run)
    allocator_settled: bool | None = None


def sample_spans(result: "SimResult") -> tuple[tuple[int, int, str, int, int], ...]:
    """``result``'s ops on every rank as (rank, op id, phase, start, end) ns, as
    ``api.result_trace`` records them."""
    return tuple((rank, int(r.op.id), r.op.phase.value, r.start_ns - r.wait_peers_ns, r.end_ns)
                 for rank in sorted(result.ranks) for r in result.ranks[rank].records)


def stall_kind(op: O.Op) -> str:
    """What a host or stream waiting on ``op`` waits on, as a stall cause."""
    if isinstance(op, O.Collective):
        return {O.CollectiveKind.ALL_GATHER: "all_gather", O.CollectiveKind.REDUCE_SCATTER: "reduce_scatter"}.get(
            op.kind, "other_comm")
    if isinstance(op, O.Copy):
        return "copy"
    return "sync"
