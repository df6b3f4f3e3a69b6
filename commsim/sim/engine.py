"""The SimPy discrete-event engine: hosts, streams, collectives, links, allocators.

Per simulated rank:

* a **host** process issues the program in order: host work takes its duration,
  host syncs block until their ops / stream / device are done, allocs and frees go
  to the rank's caching allocator (a miss that needs a cache flush first waits for
  the whole device, then pays cudaFree / cudaMalloc), and device ops are queued on
  their stream (the host blocks while a stream already holds ``launch_queue_depth``
  pending ops, like CUDA's bounded launch queue);
* one process per **stream** runs its ops in issue order once their deps are done;
  compute and copies take the cost model's time (compute slowed while a collective
  runs on the same device, and jittered per rank by a seeded RNG);
* a **collective** starts when every simulated member of its group has reached it
  (matching by group and sequence number), then takes its latency plus a fluid
  transfer whose bytes are spread over the links it uses; concurrent transfers share
  each link's bandwidth equally.

When a measured CPU profile puts more ranks on a node than it has cores, the node's
**CPU scheduler** is simulated too (per-rank mode): every rank's host thread (kernels,
host work, allocations) and every collective's backend thread run on the node's cores
in time slices, round robin, as the OS time-slices them; a thread that blocks gives its
core up, one that wakes is served before one whose slice ran out. Costs measured with
all ranks busy at once are scaled back to one core's worth (cores / ranks).

Symmetric mode simulates rank 0 alone: its collectives start as soon as it reaches
them, as if every identical rank arrived at the same moment. Per-rank mode simulates
every rank (jitter, stragglers, one rank's allocator flush delaying the others, and
each rank's speed drifting on its own where a profile measured that: ``simulate``
then reports the median of several seeded steps).
Time is integer nanoseconds.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field, replace
from math import ceil, exp, sqrt

import simpy

from commsim.hardware.costs import CostModel, Link
from commsim.ir import ops as O
from commsim.ir.schedule import Schedule
from commsim.sim.allocator import Block, CachingAllocator, OutOfMemory

HOST = "host"


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
    # and correlation time, independent per rank. None: the cost model's measured
    # values (``commsim calibrate`` on CPU backends), else none.
    rank_noise_sd: float | None = None
    rank_noise_corr_ns: int | None = None
    launch_queue_depth: int = 1024  # CUDA's pending-launch queue holds about 1024 kernels
    alloc_hit_ns: int = 1_000  # caching-allocator hit: about 1 us of host time (allocator.md)
    keep_trace: bool = True
    # Steps simulated before the measured one, so the caching allocator starts the
    # measured step warm, as in steady-state training.
    warmup_steps: int = 1


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


@dataclass
class SimResult:
    mode: str
    ranks: dict[int, RankResult]
    step_time_ns: int
    oom: str | None = None
    seed: int = 0
    jitter: float = 0.0
    cpu_sharing: str = ""  # with more ranks than cores: how the simulated scheduler shared them
    rank_noise: tuple[float, int] = (0.0, 0)  # (sd, correlation ns) of the ranks' speed drift
    step_samples_ns: tuple[int, ...] = ()  # with rank noise: every seeded step's time (median chosen)


class _Rendezvous:
    __slots__ = ("expected", "arrived", "event", "done")

    def __init__(self, env: simpy.Environment, expected: int):
        self.expected = expected
        self.arrived = 0
        self.event = env.event()  # succeeds with the start time once all have arrived
        self.done: simpy.Event | None = None


class _Transfer:
    __slots__ = ("demands", "remaining", "rate", "event")

    def __init__(self, demands, event):
        self.demands = demands
        self.remaining = 1.0
        self.rate = 0.0
        self.event = event


class FluidNetwork:
    """Links with bandwidth shared equally between the transfers crossing them."""

    def __init__(self, env: simpy.Environment, capacity):
        self.env = env
        self.capacity = capacity
        self.active: list[_Transfer] = []
        self.users: dict[Link, int] = {}
        self.last = 0
        self.generation = 0

    def start(self, demands: tuple[tuple[Link, float], ...]) -> simpy.Event:
        ev = self.env.event()
        demands = tuple((l, b) for l, b in demands if b > 0)
        if not demands:
            ev.succeed()
            return ev
        self._advance()
        t = _Transfer(demands, ev)
        self.active.append(t)
        for l, _ in demands:
            self.users[l] = self.users.get(l, 0) + 1
        self._reschedule()
        return ev

    def refresh(self) -> None:
        """Capacities changed: settle progress so far, then re-plan the rates."""
        if self.active:
            self._advance()
            self._reschedule()

    def _advance(self) -> None:
        dt = self.env.now - self.last
        if dt:
            for t in self.active:
                t.remaining -= t.rate * dt
        self.last = self.env.now

    def _reschedule(self) -> None:
        self.generation += 1
        if not self.active:
            return
        soonest = None
        for t in self.active:
            # progress per ns: the tightest link's share of bandwidth over its bytes
            t.rate = min(self.capacity(l) / self.users[l] / b for l, b in t.demands) / 1e9
            eta = t.remaining / t.rate
            soonest = eta if soonest is None or eta < soonest else soonest
        gen = self.generation
        wake = self.env.timeout(max(0, ceil(soonest - 1e-6)))
        wake.callbacks.append(lambda _ev, gen=gen: self._wake(gen))

    def _wake(self, gen: int) -> None:
        if gen != self.generation:
            return
        self._advance()
        done = [t for t in self.active if t.remaining <= 1e-9 * max(1.0, t.rate)]
        if not done:  # rounding: finish the closest one
            done = [min(self.active, key=lambda t: t.remaining)]
        for t in done:
            self.active.remove(t)
            for l, _ in t.demands:
                self.users[l] -= 1
            t.event.succeed()
        self._reschedule()


class CpuThread:
    """A thread the CPU scheduler runs: holds a core across consecutive work until it
    blocks or its time slice runs out while another thread waits."""

    __slots__ = ("req", "used_ns", "preempted")

    def __init__(self) -> None:
        self.req = None
        self.used_ns = 0
        self.preempted = False


class CpuScheduler:
    """One node's cores, time-sliced between runnable threads (round robin)."""

    def __init__(self, env: simpy.Environment, cores: int, slice_ns: int):
        assert cores >= 1 and slice_ns > 0
        self.env = env
        self.cores = simpy.PriorityResource(env, capacity=cores)
        self.slice_ns = slice_ns

    def run(self, th: CpuThread, work_ns: int):
        """Give ``th`` ``work_ns`` of one core's time; returns when it has had it."""
        env = self.env
        while work_ns > 0:
            if th.req is None:
                # woken threads first; a thread whose slice ran out queues behind them
                th.req = self.cores.request(priority=1 if th.preempted else 0)
                th.used_ns = 0
                yield th.req
            chunk = min(work_ns, self.slice_ns - th.used_ns)
            yield env.timeout(chunk)
            work_ns -= chunk
            th.used_ns += chunk
            if th.used_ns >= self.slice_ns:
                if self.cores.queue:
                    self.release(th)
                    th.preempted = True
                else:
                    th.used_ns = 0  # nobody waits: a fresh slice on the same core

    def release(self, th: CpuThread) -> None:
        """``th`` blocks (or ends): its core goes to the next runnable thread."""
        if th.req is not None:
            self.cores.release(th.req)
            th.req = None
        th.preempted = False


class _RankSim:
    """One simulated rank: its host process, stream processes and allocator."""

    def __init__(self, sim: "Simulator", rank: int):
        self.sim = sim
        self.env = sim.env
        self.rank = rank
        self.program = sim.schedule.program_of(rank)
        self.result = RankResult(rank)
        self.alloc = CachingAllocator(sim.cost.hbm_bytes)
        self.result.allocator = self.alloc
        self.done: dict[O.OpId, simpy.Event] = {}
        self.queues: dict[str, deque] = {}
        self.wakeups: dict[str, simpy.Event | None] = {}
        self.space: dict[str, simpy.Event | None] = {}
        self.last_issued: dict[str, simpy.Event] = {}
        self._last_id: dict[str, O.OpId] = {}
        self.blocks: dict[str, Block] = {}
        self.block_stream: dict[str, str] = {}
        self.buffer_streams: dict[str, set[str]] = {}
        self.active_comm = 0
        self.coll_seq: dict[tuple[int, ...], int] = {}
        # CPU backends: collectives reach the backend in the order the host issued them
        # (a ticket each); the stream holding the next ticket may start its collective
        self.tickets_given = 0
        self.tickets_served = 0
        self.ticket_waiters: dict[int, simpy.Event] = {}
        self.record_of: dict[O.OpId, OpRecord] = {}
        self.rng = random.Random(sim.config.seed * 1_000_003 + rank)
        self.node = sim.cost.node_of(rank)
        self.jitter = sim.jitter
        self.noise_sd, self.noise_corr_ns = sim.rank_noise
        self.noise_x = self.rng.gauss(0.0, self.noise_sd) if self.noise_sd else 0.0
        self.noise_t = 0
        self.finished_issuing = False
        self.stream_comm = sim.stream_comm(self.program)
        self.cpu = sim.cpus.get(self.node)  # None: host and kernels need no scheduling
        self.thread = CpuThread()

    # ------------------------------------------------------------ setup
    def run_setup(self) -> None:
        for op in self.program.setup:
            res = self.alloc.malloc(op.size_bytes, op.stream)
            if res is None:
                res = self.alloc.malloc_after_flush(op.size_bytes, op.stream)
            self.blocks[op.buffer] = res.block
            self.block_stream[op.buffer] = op.stream
            self.buffer_streams[op.buffer] = set()

    # ------------------------------------------------------------ host
    def adopt_memory(self, warm: "_RankSim") -> None:
        """Start from another rank's allocator state (a warm-up already simulated)."""
        import copy

        alloc, blocks, block_stream = copy.deepcopy((warm.alloc, warm.blocks, warm.block_stream))
        self.alloc, self.blocks, self.block_stream = alloc, blocks, block_stream
        self.result.allocator = alloc
        self.buffer_streams = {b: set() for b in blocks}

    def host(self, warmup_steps: int):
        env = self.env
        for step in range(warmup_steps + 1):
            measured = step == warmup_steps
            if measured:
                # Step boundary: everything of the previous step has finished.
                pending = [e for e in self.last_issued.values() if not e.processed]
                if pending:
                    yield from self._block(pending)
                self.result.start_ns = env.now
                self.result.records.clear()
                self.result.host_blocks.clear()
                self.result.flush_times_ns.clear()
                self.result.memory_samples.clear()
                self.alloc.stats.peak_allocated_bytes = self.alloc.stats.allocated_bytes
                self.alloc.stats.peak_reserved_bytes = self.alloc.stats.reserved_bytes
                self.alloc.stats.num_alloc_retries = 0
            yield from self._issue_step()
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
        depth = self.sim.config.launch_queue_depth
        # Host work only advances the host's own clock; the simulation waits for it once,
        # before the next op that interacts with the device or the allocator.
        host_t = env.now
        issue_ns = self.sim.cost.issue_ns
        for op in self.program.step:
            if issue_ns and isinstance(op, O.DEVICE_OP_TYPES):
                host_t += issue_ns  # the host's own cost of handing the op to its stream
            if isinstance(op, O.HostWork):
                if self.cpu is not None:  # the host thread needs a core for it
                    yield from self._spend(host_t - env.now)
                    t0 = env.now
                    yield from self._spend(op.duration_ns)
                    if rec:
                        self.result.records.append(OpRecord(self.rank, HOST, op, t0, t0, env.now))
                    host_t = env.now
                    continue
                if rec:
                    self.result.records.append(OpRecord(self.rank, HOST, op, host_t, host_t, host_t + op.duration_ns))
                host_t += op.duration_ns
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
                    self.result.host_blocks.append(HostBlock(t0, env.now, self._sync_reason(op, evs)))
                if rec:
                    self.result.records.append(OpRecord(self.rank, HOST, op, t0, t0, env.now))
            elif isinstance(op, O.Alloc):
                yield from self._malloc(op)
                if rec:
                    self.result.records.append(OpRecord(self.rank, HOST, op, t0, t0, env.now))
            elif isinstance(op, O.Free):
                self._free(op)
            elif self.sim.cost.synchronous_compute and not isinstance(op, O.Collective):
                yield from self._run_on_host(op)
            else:
                stream = op.stream
                q = self.queues.get(stream)
                if q is None:
                    self._start_stream(stream)
                    q = self.queues[stream]
                while len(q) >= depth:
                    ev = env.event()
                    self.space[stream] = ev
                    yield ev
                if env.now > t0:
                    self.result.host_blocks.append(HostBlock(t0, env.now, "launch_queue"))
                done = env.event()
                self.done[op.id] = done
                self.last_issued[stream] = done
                self._last_id[stream] = op.id
                for b in op.buffers:
                    bs = self.buffer_streams.get(b)
                    if bs is not None:
                        bs.add(stream)
                ticket = None
                if isinstance(op, O.Collective) and self.sim.cost.synchronous_compute:
                    ticket = self.tickets_given
                    self.tickets_given += 1
                q.append((op, env.now, ticket))
                w = self.wakeups.get(stream)
                if w is not None:
                    self.wakeups[stream] = None
                    w.succeed()
            host_t = env.now
        if host_t > env.now:
            yield from self._spend(host_t - env.now)

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
        if self.cpu is not None:
            self.cpu.release(self.thread)
        yield simpy.AllOf(self.env, pending)

    def _host_waits(self, deps: tuple[O.OpId, ...]):
        env = self.env
        evs = [self.done[d] for d in deps]
        pending = [e for e in evs if not e.processed]
        if pending:
            t0 = env.now
            yield from self._block(pending)
            if env.now > t0:
                self.result.host_blocks.append(HostBlock(t0, env.now, self._sync_reason(None, evs)))

    def _kernel(self, op: O.Op):
        """Run a compute or copy op now: its cost, slowed while this device communicates
        (and links slowed while it computes), jittered per rank."""
        env, cost = self.env, self.sim.cost
        if isinstance(op, O.Compute):
            dur = cost.compute_ns(op)
            if self.active_comm and self.cpu is None:  # on a scheduled CPU, cores are shared instead
                dur = int(dur * cost.comm_slowdown)
            if self.jitter:
                dur = max(1, int(dur * max(0.5, self.rng.gauss(1.0, self.jitter))))
            dur = self._speed(dur)
            if self.cpu is not None:
                yield from self._on_core(dur)
                return
            self.sim.compute_started(self.node)
            yield env.timeout(dur)
            self.sim.compute_ended(self.node)
        elif cost.synchronous_compute and self.cpu is None:
            # a CPU copy is the rank's thread at work too: the backend's thread competes with it
            self.sim.compute_started(self.node)
            yield env.timeout(self._speed(cost.copy_ns(op)))
            self.sim.compute_ended(self.node)
        else:
            yield from self._on_core(self._speed(cost.copy_ns(op)))

    def _speed(self, dur: int) -> int:
        """A duration scaled by the rank's speed now: the OU process advanced from its
        last sample, exp(x - sd^2/2) so that its mean factor is 1."""
        if not self.noise_sd:
            return dur
        dt = self.env.now - self.noise_t
        self.noise_t = self.env.now
        if dt:
            rho = exp(-dt / self.noise_corr_ns)
            self.noise_x = self.noise_x * rho + self.noise_sd * sqrt(1.0 - rho * rho) * self.rng.gauss(0.0, 1.0)
        return max(1, int(dur * exp(self.noise_x - self.noise_sd ** 2 / 2)))

    def _on_core(self, measured_ns: int):
        """Host-thread work of a measured cost: on a scheduled CPU, one core's worth of it
        run by the scheduler (costs were measured with every rank busy); else its time."""
        if self.cpu is None:
            yield self.env.timeout(measured_ns)
        else:
            yield from self.cpu.run(self.thread, self.sim.core_work_ns(measured_ns))

    def _run_on_host(self, op: O.Op):
        """A CPU device: the kernel runs on the host thread once its inputs are ready."""
        env = self.env
        issued = env.now
        prev = self.last_issued.get(op.stream)  # stream order: after the stream's previous op
        yield from self._host_waits(op.deps + ((self._last_id[op.stream],) if prev is not None else ()))
        start = env.now
        yield from self._kernel(op)
        done = env.event()
        self.done[op.id] = done
        self.last_issued[op.stream] = done
        self._last_id[op.stream] = op.id
        for b in op.buffers:
            bs = self.buffer_streams.get(b)
            if bs is not None:
                bs.add(op.stream)
        r = OpRecord(self.rank, op.stream, op, issued, start, env.now, 0, None, start)
        self.record_of[op.id] = r
        if self.sim.config.keep_trace:
            self.result.records.append(r)
        done.succeed(op.id)

    def _sync_events(self, op: O.HostSync) -> list[simpy.Event]:
        if op.scope is O.SyncScope.OPS:
            return [self.done[d] for d in op.deps]
        if op.scope is O.SyncScope.STREAM:
            e = self.last_issued.get(op.stream)
            return [e] if e is not None else []
        return list(self.last_issued.values())

    def _sync_reason(self, op: O.HostSync | None, evs: list[simpy.Event]) -> str:
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
        return _stall_kind(last.op)

    def _malloc(self, op: O.Alloc):
        env, cost = self.env, self.sim.cost
        res = self.alloc.malloc(op.size_bytes, op.stream)
        t0 = env.now
        if res is None:
            # Flush: synchronise every stream, free all entirely free segments, retry.
            self.result.flush_times_ns.append(t0)
            pending = [e for e in self.last_issued.values() if not e.processed]
            if pending:
                yield from self._block(pending)  # deferred frees return as their events fire
            try:
                res = self.alloc.malloc_after_flush(op.size_bytes, op.stream)
            except OutOfMemory as e:
                self.sim.oom = f"rank {self.rank}: {e} at `{op.label}` ({op.buffer})"
                self.sim.stop.succeed() if not self.sim.stop.triggered else None
                yield env.event()  # never resumes
                return
            delay = sum(cost.free_base_ns + int(cost.free_ns_per_byte * s) for s in res.freed_segment_bytes)
            delay += cost.malloc_base_ns + int(cost.malloc_ns_per_byte * res.new_segment_bytes)
            yield env.timeout(delay)
            self.result.host_blocks.append(HostBlock(t0, env.now, "allocator_flush"))
        elif res.new_segment_bytes and cost.caching_allocator:
            # cudaMalloc synchronises the device (allocator.md), then maps the segment.
            pending = [e for e in self.last_issued.values() if not e.processed]
            if pending and cost.malloc_syncs_device:
                yield simpy.AllOf(env, pending)
            yield env.timeout(cost.malloc_base_ns + int(cost.malloc_ns_per_byte * res.new_segment_bytes))
            self.result.host_blocks.append(HostBlock(t0, env.now, "allocator"))
        elif not cost.caching_allocator:
            # host malloc, every time (the block bookkeeping still gives peaks): priced by
            # size where the profile measured it (heap reuse vs fresh mmapped pages)
            yield from self._on_core(cost.host_malloc_ns(op.size_bytes, op.touch_bytes))
        else:
            yield env.timeout(self.sim.config.alloc_hit_ns)
        self.blocks[op.buffer] = res.block
        self.block_stream[op.buffer] = op.stream
        self.buffer_streams[op.buffer] = set()
        st = self.alloc.stats
        self.result.memory_samples.append((env.now, st.allocated_bytes, st.reserved_bytes))

    def _free(self, op: O.Free) -> None:
        block = self.blocks.pop(op.buffer)
        home = self.block_stream.pop(op.buffer)
        # record_stream: the block returns once every other stream that used it has
        # passed this point (an event recorded on each at free time).
        evs = [self.last_issued[s] for s in self.buffer_streams.pop(op.buffer, ()) if s != home
               and s in self.last_issued and not self.last_issued[s].processed]
        if evs:
            left = [len(evs)]

            def one_done(_ev: simpy.Event, block: Block = block, left: list[int] = left) -> None:
                left[0] -= 1
                if left[0] == 0:
                    self.alloc.free(block)

            for e in evs:
                e.callbacks.append(one_done)
        else:
            self.alloc.free(block)
        st = self.alloc.stats
        self.result.memory_samples.append((self.env.now, st.allocated_bytes, st.reserved_bytes))

    # ------------------------------------------------------------ streams
    def _start_stream(self, stream: str) -> None:
        self.queues[stream] = deque()
        self.wakeups[stream] = None
        self.space[stream] = None
        self.env.process(self.stream_proc(stream))

    def stream_proc(self, stream: str):
        env, q = self.env, self.queues[stream]
        rec = self.sim.config.keep_trace
        while True:
            if not q:
                if self.finished_issuing:
                    return
                ev = env.event()
                self.wakeups[stream] = ev
                yield ev
                continue
            op, issued, ticket = q.popleft()
            sp = self.space.get(stream)
            if sp is not None:
                self.space[stream] = None
                sp.succeed()
            last_dep = None
            for d in op.deps:
                e = self.done[d]
                if not e.processed:
                    yield e
                    last_dep = d
            ready = env.now
            wait_peers = 0
            if isinstance(op, O.Collective):
                if ticket is not None:
                    yield from self._await_ticket(ticket)
                start, wait_peers = yield from self._collective(op)
            else:
                start = env.now
                yield from self._kernel(op)
            r = OpRecord(self.rank, stream, op, issued, start, env.now, wait_peers, last_dep, ready)
            self.record_of[op.id] = r
            if rec:
                self.result.records.append(r)
            self.done[op.id].succeed(op.id)

    def _await_ticket(self, ticket: int):
        """On a CPU backend a collective goes to the backend only after every collective
        the host issued before it (on any stream) went: gloo matches a group's
        collectives by the order of their calls, so the executor hands them over in
        program order (and a framework's single Python thread calls them so), and a
        collective whose inputs are ready waits while an earlier one waits for its own."""
        if self.tickets_served != ticket:
            ev = self.ticket_waiters[ticket] = self.env.event()
            yield ev
        assert self.tickets_served == ticket
        self.tickets_served += 1
        nxt = self.ticket_waiters.pop(self.tickets_served, None)
        if nxt is not None:
            nxt.succeed()

    def _collective(self, op: O.Collective):
        env, sim = self.env, self.sim
        seq = self.coll_seq.get(op.group, 0)
        self.coll_seq[op.group] = seq + 1
        key = (op.group, seq)
        rv = sim.rendezvous.get(key)
        if rv is None:
            rv = sim.rendezvous[key] = _Rendezvous(env, sim.expected_members(op.group))
        arrived = env.now
        rv.arrived += 1
        if rv.arrived == rv.expected:
            del sim.rendezvous[key]
            env.process(sim.run_collective(op, rv))
        yield rv.event
        start = rv.event.value
        self.active_comm += 1
        yield rv.done
        self.active_comm -= 1
        return start, start - arrived


class Simulator:
    def __init__(self, schedule: Schedule, cost: CostModel, config: SimConfig = SimConfig()):
        self.schedule = schedule
        self.cost = cost
        self.config = config
        mode = config.mode
        # Rank-symmetric: all ranks run one program, or (hierarchical partitioning) the
        # same program over their own groups, as the generator declares.
        symmetric_ok = len(schedule.programs) == 1 or schedule.meta.rank_symmetric
        oversubscribed = _oversubscribed(cost)
        noise_sd, noise_corr_ns = rank_noise(cost, config)
        if mode == "auto":
            # more ranks than cores: their time slices matter, so every rank is simulated;
            # so do ranks whose speed drifts apart (measured): each sync waits for the slower
            mode = "symmetric" if symmetric_ok and not oversubscribed and not noise_sd else "per-rank"
        if mode == "symmetric" and not symmetric_ok:
            raise ValueError("symmetric mode needs every rank to run the same program (up to its groups)")
        if mode not in ("symmetric", "per-rank"):
            raise ValueError(f"mode {mode!r}: allowed: symmetric, per-rank, auto")
        self.mode = mode
        self.jitter = config.jitter if config.jitter is not None else (0.01 if mode == "per-rank" else 0.0)
        self.rank_noise = (noise_sd, noise_corr_ns) if mode == "per-rank" and noise_sd else (0.0, 0)
        self.env = simpy.Environment()
        self.ranks = {0} if mode == "symmetric" else set(range(schedule.world_size))
        self.nodes = {cost.node_of(r) for r in self.ranks}
        self.rendezvous: dict[tuple, _Rendezvous] = {}
        self.compute_active: dict[int, int] = {}
        self.network = FluidNetwork(self.env, self._capacity)
        self.oom: str | None = None
        self.stop = self.env.event()
        self._plans: dict[tuple, tuple[int, tuple]] = {}
        self._members: dict[tuple[int, ...], int] = {}
        self._stream_comm: dict[int, dict[str, str]] = {}
        self.cpus: dict[int, CpuScheduler] = {}
        self.cpu_sharing = ""
        self.warm: _RankSim | None = None  # set by run(): the warmed-up rank every rank started from
        if oversubscribed and mode == "per-rank":
            slice_ns = int(getattr(cost, "time_slice_ns", 0) or DEFAULT_TIME_SLICE_NS)
            self.cpus = {n: CpuScheduler(self.env, cost.cpu_cores, slice_ns) for n in self.nodes}
            self._core_share = cost.cpu_cores / cost.ranks_per_node
            self.cpu_sharing = (f"{cost.ranks_per_node} ranks per node time-sliced on {cost.cpu_cores} cores "
                                f"({slice_ns / 1e6:.2f} ms slices)")

    def core_work_ns(self, measured_ns: int) -> int:
        """A cost measured with every rank of the node busy at once, as one core's work:
        the ranks shared the cores then (cores / ranks each); the scheduler shares them now."""
        return max(1, int(measured_ns * self._core_share))

    def stream_comm(self, program) -> dict[str, str]:
        """Communication streams of a program and the stall kind of their collectives: a
        host waiting on such a stream's copies or kernels (unflatten, interleave,
        partition) waits on that communication. A stream that runs model kernels (GEMMs,
        attention) is a compute stream. Computed once per program, shared by its ranks."""
        found = self._stream_comm.get(id(program))
        if found is None:
            found, model_streams = {}, set()
            for op in program.step:
                if isinstance(op, O.Collective):
                    found.setdefault(op.stream, _stall_kind(op))
                elif isinstance(op, O.Compute) and op.kind in (O.ComputeKind.GEMM, O.ComputeKind.ATTENTION):
                    model_streams.add(op.stream)
            for stream in model_streams:
                found.pop(stream, None)
            self._stream_comm[id(program)] = found
        return found

    def _capacity(self, link) -> float:
        cap = self.cost.link_capacity(link)
        if self.compute_active.get(link[1]):
            cap /= self.cost.comm_slowdown_during_compute
        return cap

    def compute_started(self, node: int) -> None:
        n = self.compute_active.get(node, 0)
        self.compute_active[node] = n + 1
        if n == 0 and self.cost.comm_slowdown_during_compute != 1.0:
            self.network.refresh()

    def compute_ended(self, node: int) -> None:
        n = self.compute_active[node] - 1
        self.compute_active[node] = n
        if n == 0 and self.cost.comm_slowdown_during_compute != 1.0:
            self.network.refresh()

    def expected_members(self, group: tuple[int, ...]) -> int:
        n = self._members.get(group)
        if n is None:
            n = self._members[group] = sum(1 for r in group if r in self.ranks)
        return n

    def run_collective(self, op: O.Collective, rv: _Rendezvous):
        env = self.env
        key = (op.kind, op.size_bytes, op.group)
        cached = self._plans.get(key)
        if cached is None:
            # Identical collectives recur every layer: plan once. Only links of nodes
            # that are simulated carry load that other simulated transfers can feel.
            plan = self.cost.collective(op)
            demands = tuple((l, b) for l, b in plan.demands if l[1] in self.nodes)
            if self.mode == "symmetric":
                # By symmetry, every rank of the node runs the same collective over its
                # own group at the same time: a group with fewer members on a node than
                # it has GPUs (MiCS replicas, one rank per node) shares the node's NICs
                # with its sibling groups. (NVLink demands are per GPU port.)
                gpn = getattr(self.cost, "gpus_per_node", None) or getattr(self.cost, "ranks_per_node", 1)
                on = {nd: sum(1 for r in op.group if self.cost.node_of(r) == nd) for nd in self.nodes}
                demands = tuple((l, b * gpn / on[l[1]] if l[0] == "nic" and on.get(l[1]) else b) for l, b in demands)
            cached = self._plans[key] = (plan.latency_ns, demands)
        latency, demands = cached
        rv.done = env.event()
        rv.event.succeed(env.now)
        if self.cpus:
            # CPU backend on shared cores: the transfer is every member's backend thread
            # copying and reducing; it ends once each has had its share of a core.
            dur = latency + max((b / self.cost.link_capacity(l) * 1e9 for l, b in demands), default=0)
            work = self.core_work_ns(int(dur))
            yield simpy.AllOf(env, [env.process(self._member_thread(self.cpus[self.cost.node_of(r)], work))
                                    for r in op.group if r in self.ranks])
            rv.done.succeed()
            return
        slow = self.cost.comm_latency_slowdown_during_compute
        if slow != 1.0 and any(self.compute_active.get(self.cost.node_of(r)) for r in op.group if r in self.ranks):
            latency = int(latency * slow)  # the backend's thread waits for a busy core
        yield env.timeout(latency)
        yield self.network.start(demands)
        rv.done.succeed()

    def _member_thread(self, cpu: CpuScheduler, work_ns: int):
        th = CpuThread()
        yield from cpu.run(th, work_ns)
        cpu.release(th)

    def run(self, warm_from: "_RankSim | None" = None) -> SimResult:
        """Simulate the step. ``warm_from``: a warmed-up rank of an earlier run of the same
        schedule and costs (``self.warm``), so that seeded repeats skip the warm-up."""
        sims = {r: _RankSim(self, r) for r in sorted(self.ranks)}
        warmup = self.config.warmup_steps
        warm = None
        if self.mode == "per-rank" and warmup and len(self.schedule.programs) == 1 and warm_from is not None:
            warm, warmup = warm_from, 0
        elif self.mode == "per-rank" and warmup and len(self.schedule.programs) == 1:
            # Identical programs reach the same allocator state: simulate the warm-up
            # once (symmetric, no jitter) and start every rank from a copy of it.
            pre = Simulator(self.schedule, self.cost, replace(self.config, mode="symmetric", jitter=0.0,
                                                              warmup_steps=warmup - 1, keep_trace=False))
            pre_result = pre.run()
            if pre_result.oom is not None:
                return SimResult(self.mode, pre_result.ranks, 0, oom=pre_result.oom, seed=self.config.seed,
                                 jitter=self.jitter)
            warm = pre.sims[0]
            warmup = 0
        self.warm = warm  # the rank every rank started from (None: each warmed up itself)
        self.sims = sims
        try:
            for s in sims.values():
                if warm is not None:
                    s.adopt_memory(warm)
                else:
                    s.run_setup()
        except OutOfMemory as e:
            return SimResult(self.mode, {r: s.result for r, s in sims.items()}, 0,
                             oom=f"persistent state does not fit: {e}", seed=self.config.seed, jitter=self.jitter)
        procs = [self.env.process(s.host(warmup)) for s in sims.values()]
        all_done = simpy.AllOf(self.env, procs)
        self.env.run(until=simpy.AnyOf(self.env, [all_done, self.stop]))
        if self.oom is None:
            self.env.run()  # drain the streams
        t0 = min((s.result.start_ns for s in sims.values()), default=0)
        for s in sims.values():
            _shift(s.result, t0)
            ends = [r.end_ns for r in s.result.records]
            s.result.end_ns = max(ends) if ends else 0
        step = max((s.result.end_ns for s in sims.values()), default=0)
        return SimResult(self.mode, {r: s.result for r, s in sims.items()}, step, oom=self.oom,
                         seed=self.config.seed, jitter=self.jitter, cpu_sharing=self.cpu_sharing,
                         rank_noise=self.rank_noise)


def rank_noise(cost: CostModel, config: SimConfig) -> tuple[float, int]:
    """(sd, correlation ns) of the ranks' speed drift: the config's, else the cost
    model's (measured by calibrate on CPU backends; spec models have none)."""
    sd = config.rank_noise_sd if config.rank_noise_sd is not None else cost.rank_noise_sd
    corr = config.rank_noise_corr_ns if config.rank_noise_corr_ns is not None else cost.rank_noise_corr_ns
    if sd < 0 or (sd and corr <= 0):
        raise ValueError(f"rank noise sd {sd}, correlation {corr} ns: the sd must be >= 0 and, "
                         "when it is not 0, the correlation time > 0")
    return (float(sd), int(corr)) if sd else (0.0, 0)


# Step times of a noisy prediction: the median of this many seeded steps (seeds
# seed, seed+1, ...), as a measurement reports the median of its steps. With a drift
# like the development machine's (sd 0.1, 200 ms), one simulated step of the 2-rank
# ZeRO-3 small-buckets row varied by 3.5% (sd) between seeds, the median of 9 by 1.3%.
NOISE_SAMPLES = 9


def simulate(sim: Simulator) -> SimResult:
    """Run a simulator's step. When ranks' speeds drift (rank noise), one step is one
    draw of a random process: NOISE_SAMPLES seeded steps are simulated (seeds seed,
    seed+1, ..., all starting from the first one's warm-up, which has no noise) and the
    median one is returned, with every step time in ``step_samples_ns``."""
    first = sim.run()
    if not sim.rank_noise[0] or first.oom:
        return first
    results = [first] + [Simulator(sim.schedule, sim.cost, replace(sim.config, seed=sim.config.seed + i))
                         .run(warm_from=sim.warm) for i in range(1, NOISE_SAMPLES)]
    oom = next((r for r in results if r.oom), None)
    if oom is not None:
        return oom
    median = sorted(results, key=lambda r: r.step_time_ns)[len(results) // 2]
    median.step_samples_ns = tuple(r.step_time_ns for r in results)
    return median


# Linux's time slice between runnable threads, for profiles that did not measure it:
# EEVDF's base slice (0.75 ms x (1 + log2 cores), kernel/sched/fair.c) is enforced at
# the scheduler tick, 4 ms at CONFIG_HZ=250; measured on the development machine: 3.95 ms
# median runs of 4 spinning processes on 2 cores. `commsim calibrate` measures it.
DEFAULT_TIME_SLICE_NS = 4_000_000


def _oversubscribed(cost: CostModel) -> bool:
    """A CPU backend with more ranks on a node than the node has cores."""
    cores = getattr(cost, "cpu_cores", None)
    per_node = getattr(cost, "ranks_per_node", None)
    return bool(cost.synchronous_compute and cores and per_node and per_node > cores)


def _shift(res: RankResult, t0: int) -> None:
    """Measured-step times relative to its start."""
    for r in res.records:
        r.issue_ns -= t0
        r.start_ns -= t0
        r.end_ns -= t0
        r.ready_ns -= t0
    for hb in res.host_blocks:
        hb.start_ns -= t0
        hb.end_ns -= t0
    res.flush_times_ns = [t - t0 for t in res.flush_times_ns]
    res.memory_samples = [(t - t0, a, b) for t, a, b in res.memory_samples]
    res.start_ns -= t0


def _stall_kind(op: O.Op) -> str:
    if isinstance(op, O.Collective):
        return {O.CollectiveKind.ALL_GATHER: "all_gather", O.CollectiveKind.REDUCE_SCATTER: "reduce_scatter"}.get(
            op.kind, "other_comm")
    if isinstance(op, O.Copy):
        return "copy"
    return "sync"
