"""The real executor on gloo with 2 and 4 local ranks."""

import multiprocessing
import time

import pytest

from commsim.api import Scenario, build_schedule
from commsim.ir import ops as O
from commsim.ir.serialize import save_schedule, schedule_hash
from runtime.launch import ExecConfig, ExecutionFailed, launch_local


def _schedule(tmp_path, gpus, stage, **kw):
    sched = build_schedule(Scenario(model="tiny", nodes=1, gpus_per_node=gpus, stage=stage, micro_batch=2, seq=16,
                                    **kw))[0]
    path = tmp_path / f"s{gpus}_{stage}.json"
    save_schedule(sched, path)
    return sched, path


def _check_order(sched, trace, steps):
    by = {(r.rank, r.step, r.op_id): r for r in trace.records}
    for rank in range(sched.world_size):
        prog = sched.program_of(rank)
        for step in range(steps):
            last_end: dict[str, int] = {}
            for op in prog.step:
                rec = by.get((rank, step, int(op.id)))
                if isinstance(op, O.Free):
                    continue  # frees are host bookkeeping, not timed
                assert rec is not None, f"rank {rank} step {step}: op {op.id} never ran"
                assert rec.end_ns >= rec.start_ns
                if O.is_device_op(op):
                    for d in op.deps:
                        assert rec.start_ns >= by[(rank, step, int(d))].end_ns, f"op {op.id} started before dep {d}"
                    assert rec.start_ns >= last_end.get(op.stream, 0), f"stream {op.stream} ran op {op.id} early"
                    last_end[op.stream] = rec.end_ns


@pytest.mark.parametrize("gpus, stage", [(2, 3), (4, 3), (4, 2)])
def test_every_op_runs_in_a_valid_order_and_data_is_right(tmp_path, gpus, stage):
    sched, path = _schedule(tmp_path, gpus, stage)
    out = tmp_path / "m.json"
    trace = launch_local(ExecConfig(str(path), str(out), steps=2, warmup=1, check_data=True, timeout_s=30), gpus)
    assert trace.meta.source.value == "measured" and trace.meta.schedule_hash == schedule_hash(sched)
    assert len(trace.meta.get("step_times_ns")) == 2
    _check_order(sched, trace, 2)
    # On one clock, no member completes an all-gather, reduce-scatter or all-reduce
    # before every member has called it (each needs every member's data).
    starts = trace.meta.get("step_start_monotonic_ns")
    assert sorted(starts) == [str(r) for r in range(gpus)] and all(len(v) == 2 for v in starts.values())
    members: dict = {}
    for r in trace.on_one_clock().records:
        if r.kind in ("all_gather", "reduce_scatter", "all_reduce"):
            members.setdefault((r.step, r.op_id), []).append(r)
    assert members and all(min(r.end_ns for r in rs) >= max(r.start_ns for r in rs) for rs in members.values())


def test_a_dead_rank_ends_the_run_naming_rank_and_op(tmp_path):
    sched, path = _schedule(tmp_path, 2, 3)
    victim = [op for op in sched.program_of(1).step if isinstance(op, O.Collective)][5]
    t = time.monotonic()
    with pytest.raises(ExecutionFailed) as err:
        launch_local(ExecConfig(str(path), str(tmp_path / "m.json"), steps=1, warmup=0, timeout_s=10,
                                fail_rank=1, fail_op=int(victim.id)), 2)
    assert time.monotonic() - t < 60
    msg = str(err.value)
    assert f"rank 1 died (exit code 17) while issuing op {victim.id}" in msg and victim.label in msg
    assert not multiprocessing.active_children()
    assert not (tmp_path / "m.json").exists()


def test_a_taken_rendezvous_port_is_tried_again_on_another(tmp_path, monkeypatch):
    """The port found free is taken before rank 0's store binds it (another process got
    it in between): the run starts again on a new port instead of failing."""
    import socket

    import runtime.launch as L

    sched, path = _schedule(tmp_path, 2, 2)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    real, given = L._free_port, []
    monkeypatch.setattr(L, "_free_port", lambda: given.append(taken if not given else real()) or given[-1])
    try:
        trace = launch_local(ExecConfig(str(path), str(tmp_path / "m.json"), steps=1, warmup=0, timeout_s=30), 2)
    finally:
        holder.close()
    assert len(given) == 2 and given[0] == taken and given[1] != taken
    assert trace.meta.schedule_hash == schedule_hash(sched)
    # only a clash is retried, and only so often
    calls = []

    def clash(port):
        calls.append(port)
        raise ExecutionFailed(f"s.json: rank 0: DistNetworkError: ... port: {port} ... EADDRINUSE; stopped all ranks")

    with pytest.raises(ExecutionFailed, match="EADDRINUSE"):
        L._on_a_free_port(clash)
    assert len(calls) == L.PORT_ATTEMPTS
    calls.clear()

    def other(port):
        calls.append(port)
        raise ExecutionFailed("s.json: rank 1 died (exit code 17) while issuing op 5; stopped all ranks")

    with pytest.raises(ExecutionFailed, match="exit code 17"):
        L._on_a_free_port(other)
    assert len(calls) == 1


def test_memory_bound_kernels_walk_a_ring_larger_than_the_cache():
    """Each memory-bound kernel moves its bytes at the next page-aligned place of a ring
    of at least twice the last-level cache, so its data comes from memory as a step's
    tensors do, and calibrate times the same kernels the same way."""
    import torch

    from runtime.kernels import MIN_RING_BYTES, Kernels, last_level_cache_bytes

    k = Kernels(torch.device("cpu"), torch.float32)
    llc = last_level_cache_bytes(torch.device("cpu"))
    assert k.ring_bytes == max(MIN_RING_BYTES, 2 * llc)
    op = O.Compute(O.OpId(1), "c", "e", O.ComputeKind.ELEMENTWISE, 0, 3000, 3000)  # 6000 bytes: 2 pages
    starts = []
    for _ in range(3):
        starts.append(k.offset)
        k.run(op)
    assert starts == [0, 8192, 16384] and k.scratch.numel() == k.ring_bytes
    k.offset = k.ring_bytes - 4096  # the next one does not fit: back to the start
    k.run(op)
    assert k.offset == 8192
    big = O.Compute(O.OpId(2), "c", "e", O.ComputeKind.ELEMENTWISE, 0, k.ring_bytes, k.ring_bytes)
    k.run(big)  # larger than the ring: the scratch grows to hold it
    assert k.scratch.numel() == 2 * k.ring_bytes and k.offset == 2 * k.ring_bytes


def test_calibrate_gemms_read_operands_that_left_the_cache():
    """With cold_gemms each call of a shape takes the next operand set of rings larger
    than the ring bytes (twice the last-level cache): consecutive sets never share a
    byte, the sets cover the ring before one comes back, and the matmul writes the next
    place of the output ring. Without it the shape's one cached set serves every call."""
    import torch

    from runtime.kernels import ColdOperands, Kernels

    cold = ColdOperands(torch.device("cpu"), torch.float32, 1 << 20)  # a 1 MiB "cache ring"
    key = (2, 32, 16, 8)  # batch, m, k, n: a 1024 + 256 element input set, 512 outputs
    seen = []
    for _ in range(260):
        a, b, c = cold.next(key)
        assert (a.shape, b.shape, c.shape) == ((2, 32, 16), (2, 16, 8), (2, 32, 8))
        seen.append((a.storage_offset(), b.storage_offset(), c.storage_offset()))
    sets = len(cold.sets[key])
    assert sets == (1 << 18) // 512 == 512  # the output ring holds the most sets
    assert seen[:3] == [(0, 1024, 0), (1280, 2304, 512), (2560, 3584, 1024)]
    assert len(set(seen)) == 260  # no set comes back within the output ring's 512
    in_ranges = [(x, y + 256) for x, y, _ in seen[:204]]  # within one walk of the input ring
    assert all(hi <= lo2 for (_, hi), (lo2, _) in zip(in_ranges, in_ranges[1:]))
    assert cold.inputs.numel() * 4 == 1 << 20 and cold.outputs.numel() * 4 == 1 << 20
    big = (1, 512, 512, 512)  # 2 MiB of inputs: the rings grow to hold one set
    a, b, c = cold.next(big)
    assert cold.inputs.numel() == 2 * 512 * 512 and len(cold.sets) == 1  # the old views went with the rings
    op = O.Compute(O.OpId(1), "c", "g", O.ComputeKind.GEMM, 2 * 32 * 8 * 16 * 2, 0, 0, O.GemmShape(32, 8, 16, 2))
    k = Kernels(torch.device("cpu"), torch.float32, cold_gemms=True)
    k.run(op)
    k.run(op)
    assert k.operands == {} and k.cold is not None and k.cold.turn[(2, 32, 16, 8)] == 2
    a, b, c = k.cold.sets[(2, 32, 16, 8)][1]
    assert torch.allclose(c, torch.bmm(a, b))
    hot = Kernels(torch.device("cpu"), torch.float32)
    hot.run(op)
    assert hot.cold is None and list(hot.operands) == [(2, 32, 16, 8)]


def test_an_op_stating_reuse_runs_on_the_bytes_just_touched():
    """The bytes a compute op reuses move on the ring's most recently touched bytes (in
    the cache, as in the program it stands for), the rest on the next fresh region."""
    import torch

    from runtime.kernels import Kernels, ring_step

    def written(ring, offset, end, nbytes, reuse):
        ring.copy_(torch.arange(ring.numel()) % 251)
        before = ring.clone()
        out = ring_step(ring, offset, end, nbytes, reuse)
        changed = (ring != before).nonzero().flatten().tolist()
        runs, start = [], None  # the written byte ranges
        for i, x in enumerate(changed):
            if start is None:
                start = x
            if i + 1 == len(changed) or changed[i + 1] != x + 1:
                runs.append((start, x + 1))
                start = None
        return out, runs

    ring = torch.zeros(1 << 16, dtype=torch.uint8)
    assert written(ring, 0, 0, 6000, 0) == ((8192, 6000), [(3000, 6000)])  # fresh: read 0..3000, write 3000..6000
    # 4000 of 6000 bytes reused: 2000..4000 read, 4000..6000 written; 2000 fresh at 8192
    assert written(ring, 8192, 6000, 6000, 4000) == ((12288, 10192), [(4000, 6000), (9192, 10192)])
    assert written(ring, 8192, 6000, 6000, 6000) == ((8192, 6000), [(3000, 6000)])  # all reused: nothing fresh
    assert written(ring, 8192, 9000, 4000, 4000) == ((8192, 9000), [(7000, 9000)])
    assert written(ring, 8192, 1000, 6000, 6000) == ((8192, 1000), [(3000, 6000)])  # just wrapped: from the start
    k = Kernels(torch.device("cpu"), torch.float32)
    k.run(O.Compute(O.OpId(1), "c", "e", O.ComputeKind.OPTIMIZER, 0, 3000, 3000))
    k.run(O.Compute(O.OpId(2), "c", "e", O.ComputeKind.OPTIMIZER, 0, 3000, 3000, reuse_bytes=6000,
                    working_set_bytes=6000))
    assert (k.offset, k.end) == (8192, 6000)


_STEP_GARBAGE = r"""
import gc
import torch.distributed as dist
from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from runtime.executor import RankExecutor, RankOptions
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
ops, i = [], 1
for k in range(20):  # a collective the host issues, one that must wait for a kernel, a sync
    c = O.Compute(O.OpId(i), "compute", f"c{k}", O.ComputeKind.ELEMENTWISE, 0, 4096, 4096)
    a = O.Collective(O.OpId(i + 1), "comm", f"ag{k}", O.CollectiveKind.ALL_GATHER, 64, O.DType.FP32, (0,))
    b = O.Collective(O.OpId(i + 2), "comm", f"rs{k}", O.CollectiveKind.REDUCE_SCATTER, 64, O.DType.FP32, (0,),
                     deps=(c.id,))
    ops += [c, a, b, O.HostSync(O.OpId(i + 3), f"s{k}", O.SyncScope.OPS, deps=(a.id, b.id))]
    i += 4
ex = RankExecutor(Schedule.uniform(1, Program((), tuple(ops))), 0, "gloo", RankOptions(steps=2, warmup=0))
gc.collect()
gc.set_debug(gc.DEBUG_SAVEALL)
run = ex.run()
gc.collect()
names = sorted({type(o).__name__ for o in gc.garbage})
print(len(run.records), sum(type(o).__name__ in ("_CpuStep", "_Done", "Event", "Thread") for o in gc.garbage), names)
gc.set_debug(0)
dist.destroy_process_group()  # as the launcher's worker does (see _ISSUE_FAILS)
"""


def test_a_step_leaves_no_events_for_the_garbage_collector():
    """A CPU step's state (its events, issuer threads and queues) is freed by reference
    counting when the step ends, not left in a reference cycle to the garbage collector,
    whose passes (which run inside whatever op allocates next) would grow with the
    schedule: none of it is left as garbage."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _STEP_GARBAGE], capture_output=True, text=True, cwd=root,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    records, held, names = out.stdout.strip().splitlines()[-1].split(" ", 2)
    assert int(records) == 2 * 20 * 4  # every op of both steps recorded (the collectives by their completion)
    assert int(held) == 0, names


_ISSUE_FAILS = r"""
import torch.distributed as dist
from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from runtime.executor import ExecutionError, RankExecutor, RankOptions
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
# op 2 is on a stream of its own with nothing to wait for: the host thread issues it
ops = (O.Collective(O.OpId(1), "comm", "fine", O.CollectiveKind.ALL_GATHER, 64, O.DType.FP32, (0,)),
       O.Collective(O.OpId(2), "other", "breaks", O.CollectiveKind.ALL_GATHER, 64, O.DType.FP32, (0,)),
       O.HostSync(O.OpId(3), "s", O.SyncScope.OPS, deps=(O.OpId(2),)))
ex = RankExecutor(Schedule.uniform(1, Program((), ops)), 0, "gloo", RankOptions(steps=1, warmup=0))
real = ex.collective
def collective(op):
    if op.id == 2:
        raise RuntimeError("backend refused")
    return real(op)
ex.collective = collective
try:
    ex.run()
except ExecutionError as e:
    print(e)
# as the launcher's worker does: a process group left to interpreter exit aborts it
# now and then ("terminate called without an active exception", from c10d's threads)
dist.destroy_process_group()
"""


def test_a_collective_that_cannot_be_issued_ends_the_step_with_its_name():
    """A collective the host thread fails to issue is named in the error, and the step
    does not wait for it to complete (it never will)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _ISSUE_FAILS], capture_output=True, text=True, cwd=root,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("rank 0: step 0: op 2 `") and '"breaks"' in last
    assert last.endswith("RuntimeError: backend refused")


def test_an_issuer_lets_go_of_a_waited_collective_before_its_next_one():
    """gloo's reduce-scatter has no future: a stream's issuer thread waits for its work,
    which keeps the collective's tensors (its input, gloo's clone of it). Once waited,
    nothing of the work may stay on the thread while it waits for the stream's next
    collective, or a buffer the schedule frees keeps its memory until then."""
    import weakref

    from runtime.cpu_rank import _CpuStep, _Done

    class Work:  # a finished work, as gloo's holding its tensors
        def wait(self) -> bool:
            return True

    step = _CpuStep(None, {}, set())
    op = O.Collective(O.OpId(1), "reduce", "rs", O.CollectiveKind.REDUCE_SCATTER, 64, O.DType.FP32, (0, 1),
                      reduce_op=O.ReduceOp.SUM)
    work, ev = Work(), _Done()
    ref = weakref.ref(work)
    step.enqueue("reduce", ("wait", op, ev, (0, None, work.wait)))
    del work
    ev.event.wait(10)
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    alive = ref() is not None
    step.enqueue("reduce", None)  # ends the issuer
    for th in step.threads:
        th.join(10)
    assert [(e, s, o.id) for e, s, o, _ in step.finished] == [(ev, "reduce", O.OpId(1))]
    assert not alive, "the issuer kept the waited work (and its tensors) until its next item"
