"""One simulated rank: what a GPU rank and a CPU rank share.

A rank has a **host** process that issues its program in order and one process per
**stream** that runs the ops queued on it in issue order once their deps are done:

* host work advances the host's own clock (the simulation waits for it once, before
  the next op that touches the device or the allocator);
* a host sync blocks until its ops / stream / every stream are done;
* allocations go to the rank's allocator model (``allocator.CachingAllocator``): on a
  caching-allocator platform a miss maps a segment (cudaMalloc synchronises the
  device first) and a miss with no room flushes the cache, waiting for the whole
  device; on a malloc platform every allocation pays the measured price by size, and
  the block bookkeeping still gives the peaks;
* a free returns the block once every other stream that used it has passed the free
  (``record_stream``);
* a collective starts when every simulated member of its group has reached it.

How device ops are issued and kernels are run is the platform's: ``GpuRank`` queues
them on streams (``gpu_rank``), ``CpuRank`` runs kernels on the host thread and hands
collectives to the backend in program order (``cpu_rank``). The streams' queues and
processes are ``rank_streams``'s, each op's time on the rank (jitter, drift, stalls)
``rank_speed``'s, the allocator's calls ``rank_memory``'s. Times are integer ns.
"""

from __future__ import annotations

import random
from collections import deque
from typing import TYPE_CHECKING

import simpy

from commsim.hardware.sharing import IDLE
from commsim.sim.host_gc import ExpectedStops, GcClock
from commsim.sim.lateness import HostLateness
from commsim.ir import ops as O
from commsim.sim.allocator import Block
from commsim.sim.cpu_scheduler import CpuScheduler, CpuThread
from commsim.sim.drift import OuDrift
from commsim.sim.rank_memory import RankMemory
from commsim.sim.rank_speed import RankSpeed
from commsim.sim.rank_streams import RankStreams
from commsim.sim.records import HOST, HostBlock, OpRecord, RankResult, stall_kind

if TYPE_CHECKING:
    from commsim.sim.engine import Simulator


class RankSim(RankMemory, RankSpeed, RankStreams):
    """One simulated rank: its host process, stream processes and allocator."""

    def __init__(self, sim: "Simulator", rank: int):
        self.sim = sim
        self.env = sim.env
        self.cost = sim.cost
        self.platform = sim.cost.platform
        self.rank = rank
        self.program = sim.schedule.program_of(rank)
        self.result = RankResult(rank)
        self._init_memory()
        self.comm_since_python, self.comm_running = False, 0  # collectives around its Python (RankSpeed)
        self.done: dict[O.OpId, simpy.Event] = {}
        self.queues: dict[str, deque] = {}
        self.wakeups: dict[str, simpy.Event | None] = {}
        self.space: dict[str, simpy.Event | None] = {}
        self.last_issued: dict[str, simpy.Event] = {}
        self._last_id: dict[str, O.OpId] = {}
        self.blocks: dict[str, Block] = {}
        self.block_stream: dict[str, str] = {}
        self.buffer_streams: dict[str, set[str]] = {}
        self.taken = IDLE  # what this rank's in-flight collectives hold of its device
        self.coll_seq: dict[tuple[int, ...], int] = {}
        self.record_of: dict[O.OpId, OpRecord] = {}
        self.rng = random.Random(sim.config.seed * 1_000_003 + rank)
        self.node = sim.cost.node_of(rank)
        self.jitter = sim.jitter
        # the drift's components; the slow one draws from its own stream, so that adding
        # it leaves the fast one's draws as they were
        fast, slow = sim.rank_noise, sim.rank_noise_slow
        self.drift = tuple(
            ([OuDrift(fast[0], fast[1], self.rng)] if fast[0] else [])
            + ([OuDrift(slow[0], slow[1], random.Random(sim.config.seed * 7_919 + rank + 3))] if slow[0] else []))
        # the stalls' arrival rate and each op's undisturbed share, once (None: no stalls)
        st = sim.rank_stalls
        self.stalls = (st.rate_per_s / 1e9, 1.0 / (1.0 + st.loss), st.lengths_ns) if st else None
        # its own stream of draws, so a profile without stalls simulates as before
        self.stall_rng = random.Random(sim.config.seed * 104_729 + rank + 2)
        self.finished_issuing = False
        self.warmup_run = 0  # warm-up steps before the measured one (host())
        self.settled: bool | None = None  # the measured step added no allocator segment
        # host time owed to collective calls that hold the calling thread (CPU backends):
        # paid before the host's next op, or absorbed by a wait it was blocked in anyway
        self.host_debt_ns = 0
        self.python_after_ns = 0  # CPUs: the host's next Python after a kernel, cold (cpu_rank)
        self.stream_comm = sim.stream_comm(self.program)
        # host-time jitter: drawn per op in per-rank mode; in symmetric mode the expected
        # lateness of a collective's slowest member (lateness.py)
        self.host_sd = sim.host_jitter
        self.host_rng = random.Random(sim.config.seed * 7_919 + rank + 1)
        self.lateness = HostLateness(sim.host_jitter) if sim.host_jitter and sim.mode == "symmetric" else None
        # full garbage collections (host_gc), a period in steps of this rank's host work:
        # per-rank mode draws the phase (one for every rank when their passes are
        # aligned) and pauses; symmetric mode pays the job's expected stops (a pass on
        # any rank, or on one when aligned) as whole pauses where they accrue
        gc = sim.config.host_gc
        self.gc_clock: GcClock | ExpectedStops | None = None
        if gc:
            works = [op.duration_ns for op in self.program.step if isinstance(op, O.HostWork)]
            phase_seed = sim.config.seed * 15_485_863 + (0 if gc.aligned else rank) + 3
            self.gc_clock = ExpectedStops(gc, sum(works), gc.passing_ranks(sim.schedule.world_size), works) \
                if sim.mode == "symmetric" else GcClock(gc, sum(works), random.Random(phase_seed))
        # the node's time-sliced cores, when the simulator runs the OS scheduler (CPU
        # platforms with more ranks than cores); None: the host thread needs no core
        self.cpu: CpuScheduler | None = sim.cpus.get(self.node)
        self.thread = CpuThread()

    # ------------------------------------------------------------ setup
    def run_setup(self) -> None:
        if self.fresh_ns_per_byte is not None and self.sim.config.host_heap:  # after the run's warm-up steps
            self.heap = self.sim.rehearsed_heap(self.rank).clone()
            self.heap_keys = {b: b for b in self.heap.used}
        for op in self.program.setup:
            res = self.alloc.malloc(op.size_bytes, op.stream)
            if res is None:
                res = self.alloc.malloc_after_flush(op.size_bytes, op.stream)
            self.blocks[op.buffer] = res.block
            self.block_stream[op.buffer] = op.stream
            self.buffer_streams[op.buffer] = set()

    # ------------------------------------------------------------ host
    def host(self, warmup_steps: int, settle_max: int = 0):
        """Issue ``warmup_steps`` unmeasured steps, then the measured one. ``settle_max``
        > 0: a measured step that added a segment to the caching allocator (a cudaMalloc,
        or a flush) was not steady state: it becomes a warm-up step and the next one is
        measured, up to step ``settle_max`` (``warmup_run`` / ``settled`` say how it went)."""
        env = self.env
        stats = self.alloc.stats
        step = 0
        while True:
            if step:
                # Step boundary: everything of the previous step has finished (its ops'
                # completion events are keyed by op id, which the next step reuses).
                pending = [e for e in self.last_issued.values() if not e.processed]
                if pending:
                    yield from self._block(pending)
            if isinstance(self.gc_clock, ExpectedStops):
                self.gc_clock.start_step()
            measured = step >= warmup_steps
            if measured:
                self.result.start_ns = env.now
                self.result.clear()
                stats.peak_allocated_bytes = stats.allocated_bytes
                stats.peak_reserved_bytes = stats.reserved_bytes
                stats.num_alloc_retries = 0
                segments, segment_bytes = stats.num_device_alloc, stats.device_alloc_bytes
            yield from self._issue_step()
            if measured:
                # the step's cudaMallocs and flushes all happen as the host issues it
                self.settled = stats.num_device_alloc == segments
                self.result.new_segment_bytes = stats.device_alloc_bytes - segment_bytes
                if not settle_max or self.settled or step >= settle_max:
                    self.warmup_run = step
                    break
            step += 1
        if self.cpu is not None:
            self.cpu.release(self.thread)
        self.finished_issuing = True
        for stream, w in list(self.wakeups.items()):
            if w is not None:
                self.wakeups[stream] = None
                w.succeed()

    def _issue_step(self):
        env = self.env
        rec = self.sim.config.keep_trace
        # Host work only advances the host's own clock; the simulation waits for it once,
        # before the next op that interacts with the device or the allocator.
        host_t = env.now
        issue_ns = self.cost.issue_ns
        loop = self.cost.host_op_ns()
        # the executor's loop per host op, where it measured one (runtime.executor_loop)
        loop_ns = {O.HostWork: loop.get("work", 0), O.HostSync: loop.get("sync", 0),
                   O.Alloc: loop.get("alloc", 0), O.Free: loop.get("free", 0)} if loop else {}
        # and inside a host work's or a sync's record (its own calls around the op)
        work_rec, sync_rec = loop.get("work_record", 0), loop.get("sync_record", 0)
        for op in self.program.step:
            if self.host_debt_ns:
                t = max(host_t, env.now)
                self.result.host_blocks.append(HostBlock(t, t + self.host_debt_ns, "collective_call"))
                host_t = t + self.host_debt_ns
                self.host_debt_ns = 0
            if self.python_after_ns:  # the kernel before took the interpreter's caches
                host_t = max(host_t, env.now) + self.python_after_ns
                self.python_after_ns = 0
            if issue_ns and isinstance(op, O.DEVICE_OP_TYPES):
                host_t += issue_ns  # the host's own cost of handing the op to its stream
            elif loop_ns:
                host_t += loop_ns.get(type(op), 0)  # the executor's bookkeeping around a host op
            if isinstance(op, O.HostWork):
                dur = self._host_ns(self._warmth_ns(op)) + work_rec
                if self.cpu is not None:  # the host thread needs a core for it
                    yield from self._spend(host_t - env.now)
                    t0 = env.now
                    yield from self._spend(dur)
                    if rec:
                        self.result.records.append(OpRecord(self.rank, HOST, op, t0, t0, env.now))
                    host_t = env.now
                    continue
                if rec:
                    self.result.records.append(OpRecord(self.rank, HOST, op, host_t, host_t, host_t + dur))
                host_t += dur
                continue
            if host_t > env.now:
                yield from self._spend(host_t - env.now)
            t0 = env.now
            if isinstance(op, O.HostSync):
                evs = self._sync_events(op)
                pending = [e for e in evs if not e.processed]
                if pending:
                    yield from self._block(pending)
                if env.now > t0:
                    self.result.host_blocks.append(HostBlock(t0, env.now, self._sync_reason(evs)))
                    # calls made while the host waited ran in the wait
                    self.host_debt_ns = max(0, self.host_debt_ns - (env.now - t0))
                if rec:
                    self.result.records.append(OpRecord(self.rank, HOST, op, t0, t0, env.now + sync_rec))
                host_t = env.now + sync_rec
                continue
            elif isinstance(op, O.Alloc):
                yield from self._malloc(op)
                if rec:
                    self.result.records.append(OpRecord(self.rank, HOST, op, t0, t0, env.now))
            elif isinstance(op, O.Free):
                unmap_ns = self._free(op)
                if unmap_ns:
                    yield from self._on_core(self._stalled(unmap_ns))
            else:
                yield from self.issue_device(op)
            host_t = env.now
        if host_t > env.now:
            yield from self._spend(host_t - env.now)

    def issue_device(self, op: O.DeviceOp):
        """Hand a device op to the platform: queue it (GPU) or run it (CPU). A generator."""
        raise NotImplementedError

    def kernel(self, op: O.Compute | O.Copy):
        """Run a compute or copy op now, for its platform's time. A generator."""
        raise NotImplementedError

    def _spend(self, ns: int):
        """The host thread's own time: on a scheduled CPU it needs a core for it."""
        if ns <= 0:
            return
        if self.cpu is None:
            yield self.env.timeout(ns)
        else:
            yield from self.cpu.run(self.thread, ns)

    def _block(self, pending: list[simpy.Event]):
        """The host thread waits for events: on a scheduled CPU it gives its core up."""
        if self.lateness is not None:
            self.lateness.waited()
        if self.cpu is not None:
            self.cpu.release(self.thread)
        yield simpy.AllOf(self.env, pending)

    def _on_core(self, measured_ns: int):
        """Host-thread work of a measured cost: on a scheduled CPU, one core's worth of it
        run by the scheduler (costs were measured with every rank busy); else its time."""
        if self.cpu is None:
            yield self.env.timeout(measured_ns)
        else:
            yield from self.cpu.run(self.thread, self.sim.core_work_ns(measured_ns))

    def _compute_ns(self, op: O.Compute, comm_slowed: bool) -> int:
        """A kernel's time: its cost beside this rank's in-flight collectives (when the
        platform shares the device that way), jittered, scaled by the rank's speed."""
        return self._jittered(self.cost.compute_ns(op, self.taken if comm_slowed else IDLE))

    def _timed_on_node(self, dur: int):
        """``dur`` of work that slows the node's links while it runs."""
        self.sim.compute_started(self.node)
        yield self.env.timeout(dur)
        self.sim.compute_ended(self.node)

    # ------------------------------------------------------------ syncs
    def _sync_events(self, op: O.HostSync) -> list[simpy.Event]:
        if op.scope is O.SyncScope.OPS:
            return [self.done[d] for d in op.deps]
        if op.scope is O.SyncScope.STREAM:
            e = self.last_issued.get(op.stream)
            return [e] if e is not None else []
        return list(self.last_issued.values())

    def _host_waits(self, deps: tuple[O.OpId, ...]):
        env = self.env
        evs = [self.done[d] for d in deps]
        pending = [e for e in evs if not e.processed]
        if pending:
            t0 = env.now
            yield from self._block(pending)
            if env.now > t0:
                self.result.host_blocks.append(HostBlock(t0, env.now, self._sync_reason(evs)))

    def _sync_reason(self, evs: list[simpy.Event]) -> str:
        """The kind of the awaited op that finished last: what the host really waited on."""
        last = None
        for e in evs:
            r = self.record_of.get(e.value) if e.ok else None
            if r is not None and (last is None or r.end_ns > last.end_ns):
                last = r
        if last is None:
            return "sync"
        if not isinstance(last.op, O.Collective) and last.stream in self.stream_comm:
            return self.stream_comm[last.stream]
        return stall_kind(last.op)
