"""Exact event logs of the engine on tiny hand-written schedules."""

from dataclasses import replace

import pytest

from commsim.hardware.platform import CPU, GPU, CpuCores, MemoryModel, RankDrift, RankStalls, platform_of_backend
from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from commsim.sim.engine import HOST, SETTLE_MAX_STEPS, SimConfig, Simulator
from tests.sim.fixed_costs import FixedCosts

C, AG = "compute", "allgather"


def comp(i, flops, stream=C, deps=(), label=None, buffers=()):
    return O.Compute(O.OpId(i), stream, label or f"c{i}", O.ComputeKind.GEMM, flops, 0, 0, deps=deps,
                     buffers=buffers)


def coll(i, size, group, stream=AG, deps=(), label=None):
    return O.Collective(O.OpId(i), stream, label or f"ag{i}", O.CollectiveKind.ALL_GATHER, size, O.DType.UINT8,
                        group, deps=deps)


def run(schedule, mode="per-rank", costs=None, **cfg):
    cfg.setdefault("jitter", 0.0)
    cfg.setdefault("warmup_steps", 0)
    return Simulator(schedule, costs or FixedCosts(), SimConfig(mode=mode, **cfg)).run()


def events(result, host=False):
    out = []
    for rank, rr in result.ranks.items():
        for r in rr.records:
            if r.stream == HOST and not host:
                continue
            out.append((r.start_ns, r.end_ns, rank, r.stream, r.op.label))
    return sorted(out)


def test_stream_serialisation_and_cross_stream_wait():
    prog = Program((), (comp(1, 10), comp(2, 20), comp(3, 5, stream="side", deps=(O.OpId(1),)),
                        comp(4, 7, stream="side")))
    res = run(Schedule.uniform(1, prog))
    assert events(res) == [
        (0, 10, 0, C, "c1"),
        (10, 15, 0, "side", "c3"),  # waits for c1 on the other stream
        (10, 30, 0, C, "c2"),
        (15, 22, 0, "side", "c4"),  # FIFO after c3
    ]
    assert res.step_time_ns == 30


def test_collective_waits_for_its_slowest_member():
    late = Program((), (comp(1, 100), coll(2, 50, (0, 1), stream=C)))
    early = Program((), (coll(2, 50, (0, 1), stream=C),))
    res = run(Schedule.from_rank_programs([early, late]))
    assert events(res) == [(0, 100, 1, C, "c1"), (100, 150, 0, C, "ag2"), (100, 150, 1, C, "ag2")]
    rec0 = [r for r in res.ranks[0].records if r.op.label == "ag2"][0]
    assert rec0.wait_peers_ns == 100


def test_two_transfers_share_a_link():
    prog = Program((), (coll(1, 100, (0,), stream="a"), coll(2, 100, (0,), stream="b")))
    assert events(run(Schedule.uniform(1, prog))) == [(0, 200, 0, "a", "ag1"), (0, 200, 0, "b", "ag2")]
    # the second one alone on the link after the first finishes early
    prog = Program((), (coll(1, 50, (0,), stream="a"), coll(2, 100, (0,), stream="b")))
    # both at half rate until 100 (50 bytes each); then ag2 alone: 50 more bytes in 50 ns
    assert events(run(Schedule.uniform(1, prog))) == [(0, 100, 0, "a", "ag1"), (0, 150, 0, "b", "ag2")]


def test_host_back_pressure_from_the_launch_queue():
    prog = Program((), (comp(1, 100), comp(2, 10), comp(3, 10),
                        O.HostWork(O.OpId(4), "after", O.HostKind.PYTHON, 5)))
    res = run(Schedule.uniform(1, prog), launch_queue_depth=1)
    host = [(r.start_ns, r.end_ns, r.op.label) for r in res.ranks[0].records if r.stream == HOST]
    # c1 runs at once, c2 waits in the queue; c3 finds it full until c1 ends at 100.
    assert host == [(100, 105, "after")]
    assert [(hb.start_ns, hb.end_ns, hb.reason) for hb in res.ranks[0].host_blocks] == [(0, 100, "launch_queue")]


def test_host_sync_blocks_until_its_op_is_done():
    prog = Program((), (coll(1, 40, (0,)), O.HostSync(O.OpId(2), "wait ag", O.SyncScope.OPS, deps=(O.OpId(1),)),
                        comp(3, 10)))
    res = run(Schedule.uniform(1, prog))
    assert events(res) == [(0, 40, 0, AG, "ag1"), (40, 50, 0, C, "c3")]
    assert [(hb.start_ns, hb.end_ns, hb.reason) for hb in res.ranks[0].host_blocks] == [(0, 40, "all_gather")]


def test_allocator_flush_on_one_rank_stalls_the_collective_on_the_other():
    MiB = 1 << 20
    flushing = Program((), (
        O.Alloc(O.OpId(1), C, "x", "x", 30 * MiB),  # one 30 MiB segment of the 40 MiB device
        O.Free(O.OpId(2), C, "x", "x"),
        O.Alloc(O.OpId(3), "other", "y", "y", 30 * MiB),  # other stream: needs a flush
        coll(4, 1000, (0, 1), stream=C, label="ar"),
        O.Free(O.OpId(5), "other", "y", "y"),
    ))
    calm = Program((), (coll(4, 1000, (0, 1), stream=C, label="ar"),))
    res = run(Schedule.from_rank_programs([flushing, calm]), costs=FixedCosts(hbm_bytes=40 * MiB))
    # rank 0: cudaMalloc x (1000 ns, an empty device), then the flush: cudaFree of x's
    # segment (500) and cudaMalloc of y's (1000) -> issues the collective at 2500.
    assert events(res) == [(2500, 3500, 0, C, "ar"), (2500, 3500, 1, C, "ar")]
    assert res.ranks[0].allocator.stats.num_alloc_retries == 1
    assert [(hb.start_ns, hb.end_ns, hb.reason) for hb in res.ranks[0].host_blocks] == [
        (0, 1000, "allocator"), (1000, 2500, "allocator_flush")]
    assert res.ranks[1].records[0].wait_peers_ns == 2500


def _two_streams_flushing(stream_y):
    MiB = 1 << 20
    return Program((), (
        O.Alloc(O.OpId(1), C, "x", "x", 30 * MiB),  # one 30 MiB segment of the 40 MiB device
        O.Free(O.OpId(2), C, "x", "x"),
        O.Alloc(O.OpId(3), stream_y, "y", "y", 30 * MiB),  # another stream: a flush, every step
        coll(4, 1000, (0, 1), stream=C, label="ar"),
        O.Free(O.OpId(5), stream_y, "y", "y"),
    ))


def test_warm_up_until_the_allocator_settles():
    costs = FixedCosts(hbm_bytes=40 << 20)
    # one stream: the first warm-up step leaves a segment the next step reuses
    one = Schedule.uniform(2, _two_streams_flushing(C))
    res = run(one, mode="symmetric", costs=costs, warmup_steps=None)
    assert (res.warmup_steps, res.allocator_settled) == (1, True)
    fixed = run(one, mode="symmetric", costs=costs, warmup_steps=1)
    assert events(res) == events(fixed) == [(2000, 3000, 0, C, "ar")]  # two 1 us allocator hits first
    assert fixed.allocator_settled is True  # a fixed warm-up checks its step too
    # two streams on a device that holds one segment: every step flushes twice, so the
    # pool never settles and the warm-up stops at SETTLE_MAX_STEPS
    two = Schedule.uniform(2, _two_streams_flushing("other"))
    for mode in ("symmetric", "per-rank"):
        res = run(two, mode=mode, costs=costs, warmup_steps=None)
        assert (res.warmup_steps, res.allocator_settled) == (SETTLE_MAX_STEPS, False), mode
        assert [r.allocator.stats.num_alloc_retries for r in res.ranks.values()] == [2] * len(res.ranks)
    # ranks with programs of their own warm up one step each (they must run as many),
    # and the measured step says it had not settled
    calm = Program((), (coll(4, 1000, (0, 1), stream=C, label="ar"),))
    res = run(Schedule.from_rank_programs([_two_streams_flushing("other"), calm]), costs=costs, warmup_steps=None)
    assert (res.warmup_steps, res.allocator_settled) == (1, False)
    assert [(r.op.label, r.wait_peers_ns) for r in res.ranks[1].records] == [("ar", 3000)]


def test_record_stream_defers_reuse_until_the_other_stream_is_done():
    size = int(19.5 * (1 << 20))  # fills a 20 MiB segment (the rest is too small to split)

    def prog(use_stream):
        return Program((), (
            O.Alloc(O.OpId(1), AG, "w", "w", size),
            comp(2, 100, stream=use_stream, buffers=("w",)),
            O.Free(O.OpId(3), AG, "w", "w"),  # the host frees at once; the kernel still runs
            O.Alloc(O.OpId(4), AG, "v", "v", size),
            O.Free(O.OpId(5), AG, "v", "v"),
        ))

    # used on the compute stream: w's block waits for that stream, v needs a new segment
    assert run(Schedule.uniform(1, prog(C))).ranks[0].allocator.stats.num_device_alloc == 2
    # used only on its own stream: stream order makes immediate reuse safe
    assert run(Schedule.uniform(1, prog(AG))).ranks[0].allocator.stats.num_device_alloc == 1


def test_symmetric_mode_simulates_one_rank():
    prog = Program((), (comp(1, 10), coll(2, 50, (0, 1, 2, 3), stream=C)))
    res = run(Schedule.uniform(4, prog), mode="auto")
    assert res.mode == "symmetric" and list(res.ranks) == [0]
    assert events(res) == [(0, 10, 0, C, "c1"), (10, 60, 0, C, "ag2")]


def test_cpu_semantics_kernels_run_on_the_host():
    # A CPU profile: kernels execute on the host thread when it reaches them (after their
    # deps and their stream's previous op); collectives still run in the background.
    costs = FixedCosts()
    costs.platform = CPU
    prog = Program((), (comp(1, 10), coll(2, 50, (0,)), comp(3, 5), comp(4, 20, deps=(O.OpId(2),)),
                        O.HostWork(O.OpId(5), "after", O.HostKind.PYTHON, 3)))
    res = run(Schedule.uniform(1, prog), costs=costs)
    assert events(res, host=True) == [
        (0, 10, 0, C, "c1"),
        (10, 15, 0, C, "c3"),  # the host runs c3 while the all-gather is in flight
        (10, 60, 0, AG, "ag2"),
        (60, 80, 0, C, "c4"),  # the host waited for ag2, then ran c4
        (80, 83, 0, HOST, "after"),
    ]
    assert [(hb.start_ns, hb.end_ns, hb.reason) for hb in res.ranks[0].host_blocks] == [(15, 60, "all_gather")]


def test_cpu_collective_latency_is_slowed_while_the_rank_works():
    """A CPU profile measured how much longer a collective's fixed latency takes while the
    node's ranks run kernels or copies (the backend's thread waits for a busy core)."""
    costs = FixedCosts(latency_ns=100)
    costs.platform = CPU
    costs.comm_latency_slowdown_during_compute = 3.0
    # ag1 starts while c2 runs: 3 x 100 ns latency + 50 bytes; ag3 starts (behind ag1)
    # after c2 ended and the host is waiting: 100 + 50
    prog = Program((), (coll(1, 50, (0,)), comp(2, 200), coll(3, 50, (0,))))
    assert events(run(Schedule.uniform(1, prog), costs=costs)) == [
        (0, 200, 0, C, "c2"), (0, 350, 0, AG, "ag1"), (350, 500, 0, AG, "ag3")]
    # a copy on the host thread counts as work too
    cp = O.Copy(O.OpId(2), C, "cp2", O.CopyDirection.D2D, 200)
    prog = Program((), (coll(1, 50, (0,)), cp))
    assert events(run(Schedule.uniform(1, prog), costs=costs)) == [(0, 200, 0, C, "cp2"), (0, 350, 0, AG, "ag1")]
    costs.comm_latency_slowdown_during_compute = 1.0
    assert events(run(Schedule.uniform(1, prog), costs=costs)) == [(0, 150, 0, AG, "ag1"), (0, 200, 0, C, "cp2")]


def test_cpu_collectives_reach_the_backend_in_issue_order():
    """gloo matches collectives by call order, so a CPU rank hands them to the backend in
    the order the host issued them: rs3, ready at once on its own stream, waits until ag2
    (queued behind ag1) has gone. A GPU's streams start it at once."""
    costs = FixedCosts(latency_ns=100)
    rs = O.Collective(O.OpId(3), "reduce", "rs3", O.CollectiveKind.REDUCE_SCATTER, 2, O.DType.UINT8, (0,),
                      reduce_op=O.ReduceOp.SUM)
    prog = Program((), (coll(1, 100, (0,)), coll(2, 10, (0,)), rs))
    costs.platform = CPU
    # ag2 and rs3 then share the link: 12 bytes at 1 B/ns after their 100 ns latency
    assert events(run(Schedule.uniform(1, prog), costs=costs)) == [
        (0, 200, 0, AG, "ag1"), (200, 304, 0, "reduce", "rs3"), (200, 312, 0, AG, "ag2")]
    costs.platform = GPU
    assert events(run(Schedule.uniform(1, prog), costs=costs)) == [
        (0, 104, 0, "reduce", "rs3"), (0, 202, 0, AG, "ag1"), (202, 312, 0, AG, "ag2")]


class _Plans(FixedCosts):
    """FixedCosts whose collectives hold the calling thread for ``call_ns`` and stall
    ``stall_ns`` when compute follows them."""

    call_ns = 0
    stall_ns = 0

    def collective(self, op):
        return replace(super().collective(op), call_ns=self.call_ns, stall_ns=self.stall_ns)


def test_a_cpu_collective_call_holds_the_host_thread():
    """gloo's reduce-scatter works on the caller's thread for part of its time: the host
    pays that before its next op, or not at all when it was waiting anyway; a GPU's call
    only enqueues."""
    costs = _Plans()
    costs.platform, costs.call_ns = CPU, 30
    prog = Program((), (coll(1, 100, (0,)), comp(2, 10), comp(3, 10)))
    res = run(Schedule.uniform(1, prog), costs=costs)
    # ag1 is called at 0 and runs 100 ns; the host reaches c2 at once (the debt is paid
    # before the host's *next* op), then pays 30 ns before c3
    assert events(res) == [(0, 10, 0, C, "c2"), (0, 100, 0, AG, "ag1"), (40, 50, 0, C, "c3")]
    assert [(hb.start_ns, hb.end_ns, hb.reason) for hb in res.ranks[0].host_blocks] == [(10, 40, "collective_call")]
    # the host waits for ag1 right away: the call ran during the wait, nothing more to pay
    wait = O.HostSync(O.OpId(2), "wait", O.SyncScope.OPS, deps=(O.OpId(1),))
    res = run(Schedule.uniform(1, Program((), (coll(1, 100, (0,)), wait, comp(3, 10)))), costs=costs)
    assert events(res) == [(0, 100, 0, AG, "ag1"), (100, 110, 0, C, "c3")]
    costs.platform = GPU
    res = run(Schedule.uniform(1, prog), costs=costs)
    assert events(res) == [(0, 10, 0, C, "c2"), (0, 100, 0, AG, "ag1"), (10, 20, 0, C, "c3")]


def test_a_cpu_collective_followed_by_compute_takes_its_stall():
    """A gloo collective after which its rank computes waits, on average, its measured
    stall on top; one followed by another collective does not (calibrate's back-to-back
    table prices it), nor does any collective on a GPU."""
    costs = _Plans()
    costs.platform, costs.stall_ns = CPU, 40
    wait = O.HostSync(O.OpId(3), "wait", O.SyncScope.OPS, deps=(O.OpId(2),))
    prog = Program((), (coll(1, 100, (0,)), coll(2, 100, (0,)), wait, comp(4, 10)))
    # ag1 is followed by ag2 (back to back, 100 ns); ag2 by the host's wait, then c4: +40
    assert events(run(Schedule.uniform(1, prog), costs=costs)) == [
        (0, 100, 0, AG, "ag1"), (100, 240, 0, AG, "ag2"), (240, 250, 0, C, "c4")]
    costs.platform = GPU
    assert events(run(Schedule.uniform(1, prog), costs=costs)) == [
        (0, 100, 0, AG, "ag1"), (100, 200, 0, AG, "ag2"), (200, 210, 0, C, "c4")]


def test_host_malloc_costs_every_allocation():
    costs = FixedCosts()
    costs.platform = replace(GPU, memory=MemoryModel.MALLOC)
    costs.malloc_ns_per_byte = 0.001
    prog = Program((), (O.Alloc(O.OpId(1), C, "a", "a", 1 << 20), O.Free(O.OpId(2), C, "a", "a"),
                        O.Alloc(O.OpId(3), C, "b", "b", 1 << 20), O.Free(O.OpId(4), C, "b", "b")))
    res = run(Schedule.uniform(1, prog), costs=costs)
    per = 1000 + int(0.001 * (1 << 20))  # no cache: both pay base + per-byte cost
    assert [(r.start_ns, r.end_ns) for r in res.ranks[0].records] == [(0, per), (per, 2 * per)]


def test_a_frameworks_tensors_pay_only_the_fresh_pages_glibcs_heap_hands_out():
    """A framework's CPU run (a first-touch price), with the heap model: an allocation
    costs the fresh pages the rank's glibc heap gives it, the heap warmed up by the
    step's own allocations. One 16 MiB tensor a step reuses the heap's pages; two freed
    together leave a top glibc trims, so every step faults them again. Warm-up steps
    change nothing. Without the heap model, glibc's fixed ceiling alone: nothing under
    32 MiB faults, a 40 MiB block's written part does every step."""
    costs = FixedCosts()
    costs.platform = CPU
    costs.fresh_page_ns_per_byte = lambda: 0.001
    MiB = 1 << 20

    def allocs(res):
        return [(r.op.label, r.end_ns - r.start_ns) for r in res.ranks[0].records if isinstance(r.op, O.Alloc)]

    one = Program((), (O.Alloc(O.OpId(1), C, "a", "a", 16 * MiB), O.Free(O.OpId(2), C, "free a", "a")))
    res = run(Schedule.uniform(1, one), costs=costs, host_heap=True)
    assert allocs(res) == [("a", 0)] and res.ranks[0].fresh_page_bytes == {"other": 0}
    two = Program((), (O.Alloc(O.OpId(1), C, "x", "x", 16 * MiB), O.Alloc(O.OpId(2), C, "y", "y", 16 * MiB),
                       O.Free(O.OpId(3), C, "free x", "x"), O.Free(O.OpId(4), C, "free y", "y")))
    for warmup in (0, 2):
        res = run(Schedule.uniform(1, two), costs=costs, warmup_steps=warmup, host_heap=True)
        fresh = res.ranks[0].fresh_page_bytes["other"]
        assert 32 * MiB - 256 * 1024 < fresh <= 32 * MiB + 4096  # all but the pad the trim kept
        assert sum(ns for _, ns in allocs(res)) == pytest.approx(fresh * 0.001, abs=2)
    assert run(Schedule.uniform(1, two), costs=costs).ranks[0].fresh_page_bytes == {"other": 0}
    big = Program((), (O.Alloc(O.OpId(1), C, "b", "b", 40 * MiB, touch_bytes=MiB), O.Free(O.OpId(2), C, "free b", "b")))
    for heap in (False, True):  # mapped, the written MiB faults every step
        res = run(Schedule.uniform(1, big), costs=costs, warmup_steps=2, host_heap=heap)
        assert res.ranks[0].fresh_page_bytes == {"other": MiB} and allocs(res) == [("b", int(MiB * 0.001))]
    # without a first-touch price the allocation table prices them (the executor's runs)
    costs.fresh_page_ns_per_byte = lambda: None
    assert run(Schedule.uniform(1, one), costs=costs).ranks[0].fresh_page_bytes == {}


def test_cpu_scheduler_round_robin_in_time_slices():
    """Threads share one core in 4 ns slices; a thread that wakes is served before those
    whose slice ran out (they queue behind it), and a lone thread keeps its core."""
    import simpy

    from commsim.sim.cpu_scheduler import CpuScheduler, CpuThread

    env = simpy.Environment()
    cpu = CpuScheduler(env, cores=1, slice_ns=4)
    done = {}

    def thread(name, start, work):
        yield env.timeout(start)
        th = CpuThread()
        yield from cpu.run(th, work)
        cpu.release(th)
        done[name] = env.now

    for name, start, work in (("a", 0, 10), ("b", 0, 10), ("c", 0, 10), ("d", 5, 1), ("e", 40, 9)):
        env.process(thread(name, start, work))
    env.run()
    # a 0-4, b 4-8, c 8-12 (queued since 0), d 12-13 (woke at 5, ahead of a and b, whose
    # slices ran out), a 13-17, b 17-21, c 21-25, a 25-27, b 27-29, c 29-31; e runs alone
    assert done == {"d": 13, "a": 27, "b": 29, "c": 31, "e": 49}


def test_more_ranks_than_cores_are_time_sliced():
    """A CPU profile with 4 ranks on a 2-core node: every cost was measured with all 4
    ranks busy (half a core each), so each rank's kernel is half its measured time of one
    core's work; two ranks run while two wait, and the step takes the measured time."""
    costs = FixedCosts(gpus_per_node=4)
    costs.platform = platform_of_backend("gloo", CpuCores(cores=2, ranks_per_node=4, time_slice_ns=4))
    prog = Program((), (comp(1, 8),))
    res = run(Schedule.uniform(4, prog), mode="auto", costs=costs)
    assert res.mode == "per-rank" and res.step_time_ns == 8
    assert res.cpu_sharing == "4 ranks per node time-sliced on 2 cores (0.00 ms slices)"
    assert events(res) == [(0, 4, 0, C, "c1"), (0, 4, 1, C, "c1"), (0, 8, 2, C, "c1"), (0, 8, 3, C, "c1")]
    # A collective is its members' backend threads, each needing its share of a core.
    # Here it runs alongside the kernels: 4 x 20 ns (the 40 ns all-gather) + 4 x 4 ns of
    # one core's work keep both cores busy for 48 ns; without the cores being shared the
    # kernels would hide under the all-gather (40 ns).
    prog = Program((), (coll(1, 40, (0, 1, 2, 3)), comp(2, 8)))
    res = run(Schedule.uniform(4, prog), mode="auto", costs=costs)
    assert res.step_time_ns == 48
    assert run(Schedule.uniform(4, prog), mode="symmetric", costs=costs).step_time_ns == 40
    # a core per rank: no scheduling, one rank simulated
    costs.platform = platform_of_backend("gloo", CpuCores(cores=4, ranks_per_node=4, time_slice_ns=4))
    res = run(Schedule.uniform(4, Program((), (comp(1, 8),))), mode="auto", costs=costs)
    assert res.mode == "symmetric" and res.step_time_ns == 8 and res.cpu_sharing == ""


def test_rank_drift_keeps_the_mean_speed_and_makes_synchronisations_wait():
    """Each rank's kernels are scaled by its own OU speed drift: over a long chain the
    mean factor is 1 (exp(x - sd^2/2)), but a collective after every few kernels waits
    for whichever rank is behind, so a synchronising program gets slower."""
    noisy = dict(rank_noise_sd=0.1, rank_noise_corr_ns=20_000_000)
    chain = Program((), tuple(comp(i, 1_000_000) for i in range(1, 1001)))
    quiet = run(Schedule.uniform(1, chain)).step_time_ns
    assert quiet == 1_000_000_000
    drifted = run(Schedule.uniform(1, chain), **noisy).step_time_ns
    assert drifted != quiet and abs(drifted / quiet - 1) < 0.02
    ops, i = [], 1
    for _ in range(100):
        ops += [comp(i + k, 1_000_000) for k in range(10)]
        ops.append(coll(i + 10, 1, (0, 1), stream=C))
        i += 11
    synced = Schedule.uniform(2, Program((), tuple(ops)))
    assert run(synced).step_time_ns == 1_000_000_000 + 100 * 1
    # every 10 ms the ranks meet and the one ahead waits: about 4% over seeds 0-3 (3.0-5.1%)
    assert run(synced, **noisy).step_time_ns > 1.02 * 1_000_000_000


def test_measured_drift_simulates_every_rank_and_reports_the_median_of_seeded_steps():
    from commsim.sim.engine import NOISE_SAMPLES, simulate

    prog = Program((), (replace(comp(1, 10_000_000), phase=O.Phase.FORWARD), coll(2, 1, (0, 1), stream=C),
                        replace(comp(3, 10_000_000), phase=O.Phase.BACKWARD)))
    costs = FixedCosts()
    assert Simulator(Schedule.uniform(2, prog), costs).mode == "symmetric"
    assert simulate(Simulator(Schedule.uniform(2, prog), costs)).step_samples_ns == ()
    assert simulate(Simulator(Schedule.uniform(2, prog), costs)).step_samples_spans == ()
    costs.platform = replace(GPU, drift=RankDrift(0.1, 5_000_000))
    assert Simulator(Schedule.uniform(2, prog), costs).mode == "per-rank"
    res = simulate(Simulator(Schedule.uniform(2, prog), costs, SimConfig(seed=4)))
    assert len(res.step_samples_ns) == NOISE_SAMPLES and len(set(res.step_samples_ns)) == NOISE_SAMPLES
    assert res.step_time_ns == sorted(res.step_samples_ns)[NOISE_SAMPLES // 2]
    assert res.rank_noise == (0.1, 5_000_000)
    # the repeats start from the first one's warm-up: the same steps as warming up each
    runs = [Simulator(Schedule.uniform(2, prog), costs, SimConfig(seed=4 + i)).run() for i in range(NOISE_SAMPLES)]
    assert res.step_samples_ns == tuple(r.step_time_ns for r in runs)
    # every seeded step's ops on every rank (rank, op id, phase, start less its wait for
    # peers, end), so a phase's or an op's time can be the median over the steps, as the
    # step's is
    assert res.step_samples_spans == tuple(
        tuple((rank, int(rec.op.id), rec.op.phase.value, rec.start_ns - rec.wait_peers_ns, rec.end_ns)
              for rank in (0, 1) for rec in r.ranks[rank].records)
        for r in runs)
    from commsim.report.compare import sampled_phase_times, span_phase_times
    per = [span_phase_times([(ph, a, b) for rank, _, ph, a, b in sp if rank == 0]) for sp in res.step_samples_spans]
    med = sampled_phase_times(res.step_samples_spans)
    assert sampled_phase_times(res.step_samples_spans, 0) == med != sampled_phase_times(res.step_samples_spans, 1)
    assert set(med) == set(per[0])
    for ph, ns in med.items():
        assert ns == sorted(t[ph] for t in per)[NOISE_SAMPLES // 2]
    # the two computes are distinct draws: the phases' medians are not the median step's
    assert len({t["forward"] for t in per}) > 1
    with pytest.raises(ValueError, match="when it is not 0, the correlation time > 0"):
        RankDrift(0.1, 0)
    with pytest.raises(ValueError, match="when it is not 0, the correlation time > 0"):
        RankDrift(0.1, 1, 0.1, 0)
    with pytest.raises(ValueError, match="when it is not 0, the correlation time > 0"):
        Simulator(Schedule.uniform(2, prog), FixedCosts(), SimConfig(rank_noise_sd=0.1, rank_noise_corr_ns=0))


def test_rank_stalls_keep_the_mean_and_every_synchronisation_pays_for_the_rank_that_stalled():
    """Each kernel is its undisturbed work (mean / (1 + loss)) plus the stalls that
    arrive during it: alone, a long chain keeps its mean; ranks that meet after every
    kernel wait for whichever stalled, so the same stalls cost a synchronising step more."""
    costs = FixedCosts()
    # 50 stalls a second of work, 1 or 3 ms each: 10% of the time
    costs.platform = replace(CPU, stalls=RankStalls(50.0, (1_000_000, 3_000_000)))
    assert costs.platform.stalls.loss == pytest.approx(0.1)
    chain = Program((), tuple(comp(i, 1_000_000) for i in range(1, 2001)))
    alone = Simulator(Schedule.uniform(1, chain), costs, SimConfig(jitter=0.0)).run()
    assert alone.mode == "per-rank" and alone.step_time_ns != 2_000_000_000
    assert abs(alone.step_time_ns / 2_000_000_000 - 1) < 0.03
    # every kernel's time is its work (1 ms / 1.1) plus whole stalls of the two lengths
    work = int(1_000_000 / 1.1)
    assert {(e - s - work) % 1_000_000 for s, e in
            ((r.start_ns, r.end_ns) for r in alone.ranks[0].records if r.stream == C)} == {0}
    ops, i = [], 1
    for _ in range(500):
        ops += [comp(i, 1_000_000), coll(i + 1, 1, (0, 1), stream=C)]
        i += 2
    synced = Schedule.uniform(2, Program((), tuple(ops)))
    met = Simulator(synced, costs, SimConfig(jitter=0.0)).run().step_time_ns
    # each meeting waits out either rank's stalls: a kernel carries a stall about twice
    # as often as on one rank, so the step pays the loss again over its mean, about 9%
    # (seeds 0-5: 3.5-11.1%); without meetings the two ranks' stalls would overlap
    assert met > 1.03 * (500 * 1_000_000 + 500)
    costs.platform = CPU  # no stalls measured: one rank simulated, as before
    assert Simulator(synced, costs).mode == "symmetric"
    costs.platform = replace(CPU, stalls=RankStalls(50.0, (1_000_000, 3_000_000)))
    assert Simulator(synced, costs, SimConfig(rank_stalls=False)).mode == "symmetric"
    with pytest.raises(ValueError, match="when it is not 0, the lengths non-empty"):
        RankStalls(10.0, ())


def test_which_collectives_compute_follows():
    """The first device op after a collective in program order decides; host work,
    allocations and synchronisations in between do not; the step's last collective is
    followed by the next step's first device op (the step repeats)."""
    from commsim.sim.cpu_rank import followed_by_compute

    hook = O.HostWork(O.OpId(3), "hook", O.HostKind.PYTHON, 5)
    wait = O.HostSync(O.OpId(4), "wait", O.SyncScope.OPS, deps=(O.OpId(2),))
    cp = O.Copy(O.OpId(7), C, "cp7", O.CopyDirection.D2D, 8)
    prog = Program((), (coll(1, 8, (0,)), coll(2, 8, (0,)), hook, wait, comp(5, 10), coll(6, 8, (0,)), cp,
                        coll(8, 8, (0,))))
    assert followed_by_compute(prog) == {O.OpId(2), O.OpId(6)}  # the next step starts with ag1
    # a step that starts with a kernel: its last collective is followed by it
    wraps = Program((), (hook, comp(5, 10), coll(6, 8, (0,)), cp, coll(8, 8, (0,)), wait))
    assert followed_by_compute(wraps) == {O.OpId(6), O.OpId(8)}


def test_a_slow_drift_component_simulates_every_rank_and_adds_its_own_draws():
    """The drift's slow component (a core slower for seconds) alone puts the simulator
    in per-rank mode; it draws from its own stream, so adding it leaves the fast
    component's draws as they were, and with the two ranks synchronising once after
    20 ms of work each, the step is the slower rank's: longer on average than without
    it (each rank's factor keeps a mean of 1, the maximum of two does not)."""
    from commsim.sim.engine import simulate

    prog = Program((), (comp(1, 10_000_000), comp(2, 10_000_000), coll(3, 1, (0, 1), stream=C)))
    costs = FixedCosts()
    costs.platform = replace(GPU, drift=RankDrift(0.0, 0, 0.2, 2_000_000_000))
    sim = Simulator(Schedule.uniform(2, prog), costs, SimConfig(seed=1, jitter=0.0, rank_stalls=False))
    assert sim.mode == "per-rank" and sim.rank_noise == (0.0, 0) and sim.rank_noise_slow == (0.2, 2_000_000_000)
    res = simulate(sim)
    assert res.rank_noise_slow == (0.2, 2_000_000_000)
    # a config's rank noise replaces the profile's drift whole: sd 0 turns both off
    assert Simulator(Schedule.uniform(2, prog), costs, SimConfig(rank_noise_sd=0.0, rank_stalls=False)).mode == \
        "symmetric"
    steps = [Simulator(Schedule.uniform(2, prog), costs, SimConfig(seed=s, jitter=0.0, rank_stalls=False)).run()
             .step_time_ns for s in range(200)]
    # E max of two normals of sd 0.2: 0.2 / sqrt(pi), +11%
    assert 1.05 * 20_000_000 < sum(steps) / len(steps) < 1.2 * 20_000_000
    # the fast component's draws are the same with or without the slow one
    fast = replace(GPU, drift=RankDrift(0.1, 5_000_000))
    both = replace(GPU, drift=RankDrift(0.1, 5_000_000, 1e-9, 1_000_000_000))
    runs = []
    for platform in (fast, both):
        costs.platform = platform
        runs.append(Simulator(Schedule.uniform(2, prog), costs, SimConfig(seed=3, jitter=0.0, rank_stalls=False))
                    .run().step_time_ns)
    assert runs[0] == pytest.approx(runs[1], rel=1e-6)
