"""Metrics of one simulated (or measured) step: throughput, overlap, stalls, memory, cost.

Throughput follows Megatron-LM (Narayanan et al. 2021): model flops per micro-batch =
72 B s L h^2 (1 + s/(6h) + V/(12 L h)); hardware flops with full activation
recomputation = 96 B s L h^2 (1 + s/(6h) + V/(16 L h)). The formula assumes a GPT/BERT
block (MLP of 4h, full multi-head attention); other models (SwiGLU, grouped-query
attention) use the sum of their real per-op flops instead.

The stall breakdown explains every nanosecond the compute stream is not running a
compute kernel, by what it was waiting for: the all-gather or reduce-scatter it
depended on, other collectives, a slower rank (time a collective waited for its last
member), the host not issuing fast enough, the caching allocator (a cache flush, or a
new segment), or other device work.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

from commsim.ir import ops as O
from commsim.models.spec import ModelDescription
from commsim.sim.records import HOST, HostBlock, OpRecord, SimResult
from commsim.util.intervals import length, uncovered

COMPUTE_STREAM = "compute"
STALL_CAUSES = ("all_gather", "reduce_scatter", "other_comm", "straggler", "host", "allocator_flush",
                "allocator", "other")
_HOST_REASON = {
    "all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "other_comm": "other_comm",
    "allocator_flush": "allocator_flush", "allocator": "allocator", "copy": "other", "sync": "host",
    "device_sync": "host", "launch_queue": "host", "collective_call": "host",
}


@dataclass(frozen=True, slots=True)
class StepInfo:
    """What one step does, for throughput and cost (per GPU unless named otherwise)."""

    world_size: int
    nodes: int
    tokens_per_gpu: int  # micro-batch x sequence x accumulation steps
    model_flops_per_gpu: float
    hardware_flops_per_gpu: float
    price_usd_per_node_hour: float = 0.0
    flops_source: str = "megatron"  # "megatron" or "ops"


def megatron_applies(md: ModelDescription) -> bool:
    a = md.arch
    return a is not None and a.ffn == 4 * a.hidden and not any(
        m.path.endswith(("k_proj", "v_proj")) for m in md.modules)


def step_info(md: ModelDescription, world_size: int, nodes: int, grad_accum: int, checkpointing: bool,
              price_usd_per_node_hour: float = 0.0) -> StepInfo:
    B, s = md.micro_batch, md.seq_len
    if megatron_applies(md):
        a = md.arch
        assert a is not None
        L, h, V = a.layers, a.hidden, a.vocab
        model = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
        hw = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)) if checkpointing else model
        source = "megatron"
    else:
        model = float(md.forward_flops() + md.backward_flops())
        hw = model + (md.recompute_flops() if checkpointing else 0)
        source = "ops"
    return StepInfo(world_size, nodes, B * s * grad_accum, model * grad_accum, hw * grad_accum,
                    price_usd_per_node_hour, source)


# ---------------------------------------------------------------- intervals


# ---------------------------------------------------------------- stalls


def _kind(op: O.Op) -> str:
    if isinstance(op, O.Collective):
        return {O.CollectiveKind.ALL_GATHER: "all_gather",
                O.CollectiveKind.REDUCE_SCATTER: "reduce_scatter"}.get(op.kind, "other_comm")
    return "other"


class _Blocks:
    """Host blocks sorted by start, with what a window needs to find its own in log time
    (a step has thousands of windows and blocks: scanning all blocks per window was
    quadratic)."""

    def __init__(self, host_blocks: list[HostBlock]):
        self.blocks = sorted(host_blocks, key=lambda h: h.start_ns)
        self.starts = [hb.start_ns for hb in self.blocks]
        # running maximum of the ends: every block before the first index whose running
        # maximum passes a ends at or before a, overlapping blocks or not
        self.max_ends = list(itertools.accumulate((hb.end_ns for hb in self.blocks), max))

    def within(self, a: int, b: int) -> list[HostBlock]:
        """The blocks that may overlap [a, b], in start order (a superset: callers clip)."""
        return self.blocks[bisect.bisect_right(self.max_ends, a):bisect.bisect_left(self.starts, b)]


def _host_window(blocks: _Blocks, a: int, b: int, out: list[tuple[int, int, str]]) -> None:
    """[a, b] as intervals: the host's blocked reasons where it was blocked, 'host' elsewhere."""
    cur = a
    for hb in blocks.within(a, b):
        lo, hi = max(a, hb.start_ns), min(b, hb.end_ns)
        if hi <= lo:
            continue
        if lo > cur:
            out.append((cur, lo, "host"))
        out.append((lo, hi, _HOST_REASON.get(hb.reason, "host")))
        cur = max(cur, hi)
    if b > cur:
        out.append((cur, b, "host"))


def stall_intervals(records: list[OpRecord], host_blocks: list[HostBlock], step_ns: int) -> list[tuple[int, int, str]]:
    """When the compute stream did not compute, and why: (start, end, cause) in time
    order, covering the step minus the compute stream's busy time."""
    out: list[tuple[int, int, str]] = []
    by_id = {r.op.id: r for r in records}
    comp = sorted((r for r in records if r.stream == COMPUTE_STREAM), key=lambda r: r.start_ns)
    blocks = _Blocks(host_blocks)
    cursor = 0
    for r in comp:
        gap = r.start_ns - cursor
        if gap > 0:
            peers = min(gap, r.wait_peers_ns)
            window_end = r.start_ns - peers
            # Before the op was issued, the host is to blame (or what blocked it);
            # after, the dependency that finished last.
            host_end = min(window_end, max(cursor, r.issue_ns))
            if host_end > cursor:
                _host_window(blocks, cursor, host_end, out)
            if window_end > host_end:
                dep = by_id.get(r.last_dep) if r.last_dep is not None else None
                if dep is not None:
                    dpeers = min(window_end - host_end, dep.wait_peers_ns)
                    out.append((host_end, window_end - dpeers, _kind(dep.op)))
                    if dpeers:
                        out.append((window_end - dpeers, window_end, "straggler"))
                else:
                    out.append((host_end, window_end, "other"))
            if peers:
                out.append((window_end, r.start_ns, "straggler"))
        if not isinstance(r.op, O.Compute) and r.end_ns > r.start_ns:
            # a collective or copy on the compute stream: it is what the stream waits on
            out.append((max(r.start_ns, cursor), max(r.end_ns, cursor), _kind(r.op)))
        cursor = max(cursor, r.end_ns)
    if step_ns > cursor:
        _host_window(blocks, cursor, step_ns, out)
    return [iv for iv in out if iv[1] > iv[0]]


def stall_breakdown(records: list[OpRecord], host_blocks: list[HostBlock], step_ns: int) -> dict[str, int]:
    """Idle time of the compute stream by cause; sums to step time minus compute busy time."""
    out = {c: 0 for c in STALL_CAUSES}
    for a, b, cause in stall_intervals(records, host_blocks, step_ns):
        out[cause] += b - a
    return out


# ---------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Metrics:
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    compute_busy_frac: float
    comm_time_s: float
    exposed_comm_s: float
    overlap_frac: float
    stalls_s: dict[str, float]
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    alloc_retries: int
    alloc_flushes: int
    cost_usd_per_step: float
    cost_usd_per_million_tokens: float
    mode: str
    seed: int
    jitter: float
    oom: str | None
    flops_source: str
    # ranks' speed drift (sd, correlation s) and, with it, every seeded step's time
    # (the step reported is their median)
    rank_noise: tuple[float, float] = (0.0, 0.0)
    rank_noise_slow: tuple[float, float] = (0.0, 0.0)  # its slow component (sd, correlation s)
    # ranks' stalls (per second of work, stall time per unit of work); (0, 0): none
    rank_stalls: tuple[float, float] = (0.0, 0.0)
    step_time_samples_s: tuple[float, ...] = ()
    host_jitter: float = 0.0  # relative sd of each host op's time (0: hosts run like clockwork)
    # each rank's full collections: (period steps, pause s, "aligned" | "independent")
    host_gc: tuple[float, float, str] | None = None
    # host time those collections added on the reported rank: every rank's passes as the
    # job pays them (symmetric), or the rank's own (per-rank)
    host_gc_pause_s: float = 0.0
    warmup_steps: int = 0  # steps simulated before the measured one
    # the measured step added no segment to the caching allocator (None: not known)
    allocator_settled: bool | None = None
    new_segment_bytes: int = 0  # what its segments added (the rank that added most)

    def to_json(self) -> dict:
        """The fields, with a figure that does not exist (NaN: no tokens, no step) as null,
        so that the output is strict JSON."""
        def clean(v):
            return None if isinstance(v, float) and not math.isfinite(v) else v
        return {k: clean(getattr(self, k)) for k in self.__dataclass_fields__}


def compute_metrics(result: SimResult, info: StepInfo, rank: int | None = None) -> Metrics:
    """Metrics of a simulated step; busy / overlap / stalls from ``rank`` (default: the
    rank that finished last, i.e. the one that set the step time)."""
    if rank is None:
        rank = max(result.ranks, key=lambda r: (result.ranks[r].end_ns, -r))
    rr = result.ranks[rank]
    step_ns = result.step_time_ns
    step_s = step_ns / 1e9 if step_ns else float("nan")
    records = [r for r in rr.records if r.stream != HOST]
    comp = [(r.start_ns, r.end_ns) for r in records if r.stream == COMPUTE_STREAM and isinstance(r.op, O.Compute)]
    comm = [(r.start_ns, r.end_ns) for r in records if isinstance(r.op, O.Collective)]
    busy = length(comp)
    comm_ns = length(comm)
    exposed = uncovered(comm, comp)
    stalls = stall_breakdown(records, rr.host_blocks, step_ns)
    allocs = [r.allocator for r in result.ranks.values() if r.allocator is not None]
    tokens_per_step = info.tokens_per_gpu * info.world_size
    cost_step = info.nodes * info.price_usd_per_node_hour * step_s / 3600 if step_ns else float("nan")
    return Metrics(
        step_time_s=step_s,
        tokens_per_s=tokens_per_step / step_s if step_ns else 0.0,
        model_tflops_per_gpu=info.model_flops_per_gpu / step_s / 1e12 if step_ns else 0.0,
        hardware_tflops_per_gpu=info.hardware_flops_per_gpu / step_s / 1e12 if step_ns else 0.0,
        compute_busy_frac=busy / step_ns if step_ns else 0.0,
        comm_time_s=comm_ns / 1e9,
        exposed_comm_s=exposed / 1e9,
        overlap_frac=1 - exposed / comm_ns if comm_ns else 1.0,
        stalls_s={k: v / 1e9 for k, v in stalls.items()},
        peak_allocated_bytes=max((a.stats.peak_allocated_bytes for a in allocs), default=0),
        peak_reserved_bytes=max((a.stats.peak_reserved_bytes for a in allocs), default=0),
        alloc_retries=max((a.stats.num_alloc_retries for a in allocs), default=0),
        alloc_flushes=sum(len(r.flush_times_ns) for r in result.ranks.values()),
        cost_usd_per_step=cost_step,
        # a hand-made schedule may name no model: no tokens, so no cost per token
        cost_usd_per_million_tokens=cost_step / tokens_per_step * 1e6 if step_ns and tokens_per_step else float("nan"),
        mode=result.mode,
        seed=result.seed,
        jitter=result.jitter,
        oom=result.oom,
        flops_source=info.flops_source,
        rank_noise=(result.rank_noise[0], result.rank_noise[1] / 1e9),
        rank_noise_slow=(result.rank_noise_slow[0], result.rank_noise_slow[1] / 1e9),
        rank_stalls=result.rank_stalls,
        step_time_samples_s=tuple(t / 1e9 for t in result.step_samples_ns),
        host_jitter=result.host_jitter,
        host_gc=(result.host_gc.period_steps, result.host_gc.pause_ns / 1e9, result.host_gc.alignment)
        if result.host_gc else None,
        host_gc_pause_s=rr.gc_pause_ns / 1e9,
        warmup_steps=result.warmup_steps,
        allocator_settled=result.allocator_settled,
        new_segment_bytes=max((r.new_segment_bytes for r in result.ranks.values()), default=0),
    )
