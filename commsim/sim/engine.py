"""The SimPy discrete-event engine: ranks, collectives on shared links, the step.

``Simulator`` simulates one steady-state training step of a schedule on a cost model:

* one rank process per simulated rank, of the kind its platform says: ``GpuRank``
  (kernels queued on streams) or ``CpuRank`` (kernels on the host thread, collectives
  in program order); see ``rank`` for what they share;
* a **collective** starts when every simulated member of its group has reached it
  (matching by group and sequence number), then takes its latency plus a fluid
  transfer whose bytes are spread over the links it uses (``network``); concurrent
  transfers share each link's bandwidth equally;
* on a CPU platform whose nodes hold more ranks than cores (per-rank mode), the node's
  **CPU scheduler** (``cpu_scheduler``): every rank's host thread and every
  collective's backend threads run on the node's cores in time slices; costs measured
  with all ranks busy at once are scaled back to one core's worth (cores / ranks).

Symmetric mode simulates rank 0 alone: its collectives start as soon as it reaches
them, as if every identical rank arrived at the same moment. Per-rank mode simulates
every rank (jitter, stragglers, one rank's allocator flush delaying the others, and
each rank's speed drifting on its own where the platform measured that: ``simulate``
then reports the median of several seeded steps). Time is integer nanoseconds.
"""

from __future__ import annotations

from dataclasses import replace

import simpy

from commsim.hardware.costs import CostModel
from commsim.hardware.links import Link, LinkKind
from commsim.hardware.platform import NO_STALLS
from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from commsim.ir.schedule import Schedule
from commsim.sim.allocator import OutOfMemory
from commsim.sim.cpu_rank import CpuRank, followed_by_compute
from commsim.sim.cpu_scheduler import CpuScheduler
from commsim.sim.gpu_rank import GpuRank
from commsim.sim.host_heap import HostHeap, rehearsed_heap
from commsim.sim.network import FluidNetwork
from commsim.sim.rank import RankSim
from commsim.sim.records import HOST, HostBlock, OpRecord, RankResult, SimConfig, SimResult, sample_spans, stall_kind
from commsim.sim.warmup import SETTLE_MAX_STEPS, plan_warmup

__all__ = ["HOST", "SETTLE_MAX_STEPS", "HostBlock", "OpRecord", "RankResult", "SimConfig", "SimResult", "Simulator",
           "simulate", "rank_noise", "NOISE_SAMPLES"]


class _Rendezvous:
    __slots__ = ("expected", "arrived", "event", "done", "sms", "hbm_rate", "rank")

    def __init__(self, env: simpy.Environment, expected: int):
        self.expected = expected
        self.arrived = 0
        self.event = env.event()  # succeeds with the start time once all have arrived
        self.done: simpy.Event | None = None
        self.sms = 0  # what it holds of each member GPU while it runs (its plan)
        self.hbm_rate = 0.0
        self.rank = -1  # the last member to arrive (its program says what follows)


class Simulator:
    def __init__(self, schedule: Schedule, cost: CostModel, config: SimConfig = SimConfig()):
        self.schedule = schedule
        self.cost = cost
        self.config = config
        platform = cost.platform
        mode = config.mode
        # Rank-symmetric: all ranks run one program, or (hierarchical partitioning) the
        # same program over their own groups, as the generator declares.
        symmetric_ok = self.symmetric_ok = len(schedule.programs) == 1 or schedule.meta.rank_symmetric
        noise_sd, noise_corr_ns = rank_noise(cost, config)
        # a config's rank noise replaces the profile's drift whole, its slow component too
        overridden = config.rank_noise_sd is not None
        slow = (0.0, 0) if overridden else (platform.drift.slow_sd, platform.drift.slow_corr_ns)
        stalls = platform.stalls if config.rank_stalls else NO_STALLS
        if mode == "auto":
            # more ranks than cores: their time slices matter, so every rank is simulated;
            # so do ranks whose speed drifts apart or who stall on their own (measured):
            # each sync waits for the slower
            mode = ("symmetric" if symmetric_ok and not platform.time_sliced and not noise_sd and not slow[0]
                    and not stalls else "per-rank")
        if mode == "symmetric" and not symmetric_ok:
            raise ValueError("symmetric mode needs every rank to run the same program (up to its groups)")
        if mode not in ("symmetric", "per-rank"):
            raise ValueError(f"mode {mode!r}: allowed: symmetric, per-rank, auto")
        self.mode = mode
        self.jitter = config.jitter if config.jitter is not None else (0.01 if mode == "per-rank" else 0.0)
        self.rank_noise = (noise_sd, noise_corr_ns) if mode == "per-rank" and noise_sd else (0.0, 0)
        self.rank_noise_slow = slow if mode == "per-rank" and slow[0] else (0.0, 0)
        self.rank_stalls = stalls if mode == "per-rank" else NO_STALLS
        self.host_jitter = config.host_jitter if config.host_jitter is not None else platform.host_jitter
        if self.host_jitter < 0:
            raise ValueError(f"host jitter {self.host_jitter}: must be >= 0")
        self.env = simpy.Environment()
        self.ranks = {0} if mode == "symmetric" else set(range(schedule.world_size))
        self.nodes = {cost.node_of(r) for r in self.ranks}
        self.rendezvous: dict[tuple, _Rendezvous] = {}
        self.compute_active: dict[int, int] = {}
        self.kernel_hbm: dict[int, float] = {}  # rank -> HBM bytes/s its running kernels move
        self.network = FluidNetwork(self.env, self._capacity)
        self.oom: str | None = None
        self.stop = self.env.event()
        self._plans: dict[tuple, tuple[int, tuple]] = {}
        self._members: dict[tuple[int, ...], int] = {}
        self._on_node: dict[int, int] = {}
        self._stream_comm: dict[int, dict[str, str]] = {}
        self._followed: dict[int, frozenset[O.OpId]] = {}  # program -> collectives followed by compute
        self._heaps: dict[int, HostHeap] = {}  # program -> its glibc heap after the warm-up steps
        self.cpus: dict[int, CpuScheduler] = {}
        self.cpu_sharing = ""
        self.rank_kind: type[RankSim] = CpuRank if platform.inline_kernels else GpuRank
        self.warm: RankSim | None = None  # set by run(): the warmed-up rank every rank started from
        self.sims: dict[int, RankSim] = {}
        if platform.time_sliced and mode == "per-rank":
            cores = platform.cpu
            assert cores is not None
            self.cpus = {n: CpuScheduler(self.env, cores.cores, cores.time_slice_ns) for n in self.nodes}
            self._core_share = cores.core_share
            self.cpu_sharing = (f"{cores.ranks_per_node} ranks per node time-sliced on {cores.cores} cores "
                                f"({cores.time_slice_ns / 1e6:.2f} ms slices)")

    def core_work_ns(self, measured_ns: int) -> int:
        """A cost measured with every rank of the node busy at once, as one core's work:
        the ranks shared the cores then (cores / ranks each); the scheduler shares them now."""
        return max(1, int(measured_ns * self._core_share))

    def rehearsed_heap(self, rank: int) -> HostHeap:
        """``rank``'s program's heap after the steps a measured run warmed up with (one
        per program: the ranks of one program reach the same state)."""
        index = self.schedule.rank_program[rank]
        if index not in self._heaps:
            self._heaps[index] = rehearsed_heap(self.schedule.programs[index])
        return self._heaps[index]

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
                    found.setdefault(op.stream, stall_kind(op))
                elif isinstance(op, O.Compute) and op.kind in (O.ComputeKind.GEMM, O.ComputeKind.ATTENTION):
                    model_streams.add(op.stream)
            for stream in model_streams:
                found.pop(stream, None)
            self._stream_comm[id(program)] = found
        return found

    # ------------------------------------------------------------ links
    def _capacity(self, link: Link) -> float:
        cap = self.cost.link_capacity(link)
        if link.kind is LinkKind.HBM:
            # a GPU's HBM beside its running kernels: what they leave, or the collectives'
            # proportional share of it (sharing.fair_share)
            mine = self.kernel_hbm.get(link.node, 0.0)
            if mine > 0:
                theirs = self.sims[link.node].taken.hbm_bytes_per_s
                cap = max(cap - mine, cap * theirs / (theirs + mine))
            return cap
        if self.compute_active.get(link.node):
            cap /= self.cost.comm_slowdown_during_compute
        return cap

    def kernel_hbm_changed(self, rank: int, delta: float) -> None:
        """A kernel of ``rank`` started or ended, moving ``delta`` bytes/s of HBM more: the
        HBM its collectives get changes. Re-plan the rates only if that limit binds (or
        bound) a transfer, as re-planning every transfer at every kernel would be slow."""
        if not self.sims[rank].taken.collectives or not self.network.active:
            self.kernel_hbm[rank] = self.kernel_hbm.get(rank, 0.0) + delta  # nothing to re-plan
            return
        link = Link(LinkKind.HBM, rank)
        before = self._capacity(link)
        self.kernel_hbm[rank] = self.kernel_hbm.get(rank, 0.0) + delta
        used = self.network.throughput(link)
        if used and min(before, self._capacity(link)) <= used * (1 + 1e-9):
            self.network.refresh()

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

    # ------------------------------------------------------------ collectives
    def expected_members(self, group: tuple[int, ...]) -> int:
        n = self._members.get(group)
        if n is None:
            n = self._members[group] = sum(1 for r in group if r in self.ranks)
        return n

    def arrive(self, op: O.Collective, seq: int, rank: int) -> _Rendezvous:
        """``rank`` reached the ``seq``-th collective of ``op.group``: the last simulated
        member to arrive starts it."""
        key = (op.group, seq)
        rv = self.rendezvous.get(key)
        if rv is None:
            rv = self.rendezvous[key] = _Rendezvous(self.env, self.expected_members(op.group))
        rv.arrived += 1
        rv.rank = rank
        if rv.arrived == rv.expected:
            del self.rendezvous[key]
            self.env.process(self.run_collective(op, rv))
        return rv

    def _plan(self, op: O.Collective) -> tuple[int, tuple[tuple[Link, float], ...], int, float, int]:
        """(latency, link demands, SMs and HBM bytes/s it takes of each member GPU, its
        stall when its rank computes next)."""
        key = (op.kind, op.size_bytes, op.group)
        cached = self._plans.get(key)
        if cached is None:
            # Identical collectives recur every layer: plan once. Only links of nodes
            # that are simulated carry load that other simulated transfers can feel.
            plan = self.cost.collective(op)
            demands = tuple((l, b) for l, b in plan.demands if l.node in self.nodes and l.kind is not LinkKind.HBM)
            if self.mode == "symmetric":
                # By symmetry, every rank of the node runs the same collective over its
                # own group at the same time: a group with fewer members on a node than
                # it has ranks (MiCS replicas, one rank per node) shares the node's NICs
                # with its sibling groups. (NVLink demands are per GPU port.)
                on = {nd: sum(1 for r in op.group if self.cost.node_of(r) == nd) for nd in self.nodes}
                demands = tuple((l, b * self._world_on_node(l.node) / on[l.node]
                                 if l.kind is LinkKind.NIC and on.get(l.node) else b) for l, b in demands)
            sms, hbm_rate = 0, 0.0
            if self.cost.gpu_resources is not None and plan.hbm_bytes and demands:
                # its traffic through each simulated member's HBM, shared with that GPU's
                # kernels; the rate it moves at when nothing else slows it
                alone_s = max(b / self.cost.link_capacity(l) for l, b in demands)
                hbm_rate = plan.hbm_bytes / alone_s if alone_s > 0 else 0.0
                demands += tuple((Link(LinkKind.HBM, r), plan.hbm_bytes) for r in op.group if r in self.ranks)
                sms = plan.sms
            cached = self._plans[key] = (plan.latency_ns, demands, sms, hbm_rate, plan.stall_ns)
        return cached

    def _world_on_node(self, node: int) -> int:
        """Ranks of the schedule's world on ``node`` (a node may be partly filled)."""
        n = self._on_node.get(node)
        if n is None:
            n = self._on_node[node] = sum(1 for r in range(self.schedule.world_size) if self.cost.node_of(r) == node)
        return n

    def _stall_ns(self, op: O.Collective, rank: int, stall_ns: int) -> int:
        """The collective's measured stall where its rank computes next (CPU backends:
        ``cpu_rank.followed_by_compute``), else 0. Only where kernels run on the host
        thread: a GPU's collectives complete on the device, whatever the host does next."""
        if not stall_ns or not self.cost.platform.inline_kernels:
            return 0
        program = self.schedule.program_of(rank)
        after = self._followed.get(id(program))
        if after is None:
            after = self._followed[id(program)] = followed_by_compute(program)
        return stall_ns if op.id in after else 0

    def run_collective(self, op: O.Collective, rv: _Rendezvous):
        env = self.env
        latency, demands, rv.sms, rv.hbm_rate, stall = self._plan(op)
        stall = self._stall_ns(op, rv.rank, stall)
        rv.done = env.event()
        rv.event.succeed(env.now)
        if self.cpus:
            # CPU backend on shared cores: the transfer is every member's backend thread
            # copying and reducing; it ends once each has had its share of a core.
            dur = latency + max((b / self.cost.link_capacity(l) * 1e9 for l, b in demands), default=0)
            work = self.core_work_ns(int(dur))
            yield simpy.AllOf(env, [env.process(self.cpus[self.cost.node_of(r)].run_thread(work))
                                    for r in op.group if r in self.ranks])
            if stall:  # a wait for the completion, not work: no core is held
                yield env.timeout(stall)
            rv.done.succeed()
            return
        slow = self.cost.comm_latency_slowdown_during_compute
        if slow != 1.0 and any(self.compute_active.get(self.cost.node_of(r)) for r in op.group if r in self.ranks):
            latency = int(latency * slow)  # the backend's thread waits for a busy core
        yield env.timeout(latency + stall)
        yield self.network.start(demands)
        rv.done.succeed()

    def out_of_memory(self, message: str) -> None:
        """A rank cannot allocate even after a flush: stop the simulation."""
        self.oom = message
        if not self.stop.triggered:
            self.stop.succeed()

    # ------------------------------------------------------------ the step
    def run(self, warm_from: RankSim | None = None) -> SimResult:
        """Simulate the step. ``warm_from``: a warmed-up rank of an earlier run of the same
        schedule and costs (``self.warm``), so that seeded repeats skip the warm-up."""
        sims = {r: self.rank_kind(self, r) for r in sorted(self.ranks)}
        plan = plan_warmup(self, warm_from)
        if isinstance(plan, SimResult):
            return plan
        warm, warmup, settle_max, warmed = plan.warm, plan.warmup, plan.settle_max, plan.warmed
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
        procs = [self.env.process(s.host(warmup, settle_max)) for s in sims.values()]
        all_done = simpy.AllOf(self.env, procs)
        self.env.run(until=simpy.AnyOf(self.env, [all_done, self.stop]))
        if self.oom is None:
            self.env.run()  # drain the streams
            self._check_finished(sims)
        t0 = min((s.result.start_ns for s in sims.values()), default=0)
        for s in sims.values():
            s.result.shift(t0)
            ends = [r.end_ns for r in s.result.records]
            s.result.end_ns = max(ends) if ends else 0
        step = max((s.result.end_ns for s in sims.values()), default=0)
        first = sims[min(sims)]
        settled = first.settled if self.oom is None else None
        return SimResult(self.mode, {r: s.result for r, s in sims.items()}, step, oom=self.oom,
                         warmup_steps=warmed + first.warmup_run, allocator_settled=settled,
                         seed=self.config.seed, jitter=self.jitter, host_jitter=self.host_jitter,
                         host_gc=self.config.host_gc,
                         cpu_sharing=self.cpu_sharing,
                         rank_noise=self.rank_noise, rank_noise_slow=self.rank_noise_slow,
                         rank_stalls=(self.rank_stalls.rate_per_s, self.rank_stalls.loss))


    def symmetric_run(self, warmup_steps: int | None) -> tuple["Simulator", SimResult]:
        """A symmetric, noise-free run of this schedule with ``warmup_steps`` warm-up
        steps (None: until the allocator settles), and its result (an out-of-memory one
        in this simulator's mode)."""
        sim = Simulator(self.schedule, self.cost, replace(self.config, mode="symmetric", jitter=0.0,
                                                          warmup_steps=warmup_steps, keep_trace=False))
        res = sim.run()
        if res.oom is not None:
            res = SimResult(self.mode, res.ranks, 0, oom=res.oom, seed=self.config.seed, jitter=self.jitter)
        return sim, res

    def _check_finished(self, sims: dict[int, RankSim]) -> None:
        """Every op issued ran: else the schedule deadlocks (a collective some member never
        reaches, or ops waiting on one), and a partial step would be a wrong answer."""
        stuck = []
        for r, s in sims.items():
            waiting = sorted(i for i, e in s.done.items() if not e.processed)
            if waiting:
                op = s.program.by_id()[waiting[0]]
                stuck.append(f"rank {r} at op {op.id} `{op.label}` ({len(waiting)} op(s) unfinished)")
        if stuck:
            groups = sorted({f"{len(k[0])}-rank group {k[0][0]}-{k[0][-1]} call {k[1]} "
                             f"({rv.arrived} of {rv.expected} arrived)" for k, rv in self.rendezvous.items()})
            raise ScheduleDeadlock("the schedule deadlocks: " + "; ".join(stuck[:4])
                                   + (f"; collectives waiting for members: {', '.join(groups[:4])}" if groups else ""))


class ScheduleDeadlock(CommsimInputError):
    """The simulated step cannot finish: some op waits for something that never comes."""


def rank_noise(cost: CostModel, config: SimConfig) -> tuple[float, int]:
    """(sd, correlation ns) of the ranks' speed drift: the config's, else the platform's
    (measured by calibrate on CPU backends; spec presets have none)."""
    drift = cost.platform.drift
    sd = config.rank_noise_sd if config.rank_noise_sd is not None else drift.sd
    corr = config.rank_noise_corr_ns if config.rank_noise_corr_ns is not None else drift.corr_ns
    if sd < 0 or (sd and corr <= 0):
        raise ValueError(f"rank noise sd {sd}, correlation {corr} ns: the sd must be >= 0 and, "
                         "when it is not 0, the correlation time > 0")
    return (float(sd), int(corr)) if sd else (0.0, 0)


# Step times of a noisy prediction: the median of this many seeded steps (seeds seed,
# seed+1, ...), as a measurement reports the median of its steps. The median of 9 varies
# between seeds about a third as much as one simulated step does.
NOISE_SAMPLES = 9


def simulate(sim: Simulator) -> SimResult:
    """Run a simulator's step. When ranks' speeds drift (rank noise) or they stall (rank
    stalls), one step is one draw of a random process: NOISE_SAMPLES seeded steps are
    simulated (seeds seed, seed+1, ..., all starting from the first one's warm-up, which
    has neither) and the median one is returned, with every step time in
    ``step_samples_ns`` and every step's ops on every rank in ``step_samples_spans`` (a
    phase's or an op's time is one draw in one step too: ``report.compare``'s
    ``sampled_phase_times`` and ``compare``)."""
    first = sim.run()
    if not (sim.rank_noise[0] or sim.rank_noise_slow[0] or sim.rank_stalls) or first.oom:
        return first
    results = [first] + [Simulator(sim.schedule, sim.cost, replace(sim.config, seed=sim.config.seed + i))
                         .run(warm_from=sim.warm) for i in range(1, NOISE_SAMPLES)]
    oom = next((r for r in results if r.oom), None)
    if oom is not None:
        return oom
    median = sorted(results, key=lambda r: r.step_time_ns)[len(results) // 2]
    median.step_samples_ns = tuple(r.step_time_ns for r in results)
    median.step_samples_spans = tuple(sample_spans(r) for r in results)
    return median
