"""The real executor: one rank of a commsim schedule through torch.distributed.

Every op of the rank's program runs for real:

* buffers are real tensors of their stated size, allocated and freed in program order
  (on GPU through PyTorch's caching allocator, with ``record_stream`` for buffers used
  on other streams, so its behaviour is measured; ``torch.cuda.memory_stats`` is kept);
* compute ops are real kernels: a GEMM of the op's shape (batched matmul), a
  memory-bound copy moving the op's bytes otherwise;
* collectives are real ``torch.distributed`` collectives of the op's kind, size, dtype
  and process group, issued asynchronously;
* host work spins the host for its duration; host syncs wait for their ops / streams.

Streams: on GPU (NCCL) each schedule stream is a CUDA stream, dependencies are CUDA
events, and op times come from CUDA events. On CPU (gloo) kernels run on the host
thread in stream order, a collective is issued by the host thread when its inputs are
ready and else by an issuer thread of its stream, dependencies are thread events, and
times come from the monotonic clock; collectives are issued to the backend in program
order (a ticket), so every rank issues them in the same order whatever thread runs
them, as NCCL's host-side ordering guarantees on GPU.

With ``check_data`` the collectives carry known values and every result is checked:
an all-gather must hold the concatenation of every rank's shard, a reduce-scatter or
all-reduce the sum.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from commsim.ir import ops as O
from commsim.ir.schedule import Schedule
from commsim.ir.text import op_to_text
from commsim.ir.trace import HOST_STREAM, TraceRecord

_TORCH_DTYPE = {
    O.DType.FP32: torch.float32, O.DType.FP16: torch.float16, O.DType.BF16: torch.bfloat16,
    O.DType.FP64: torch.float64, O.DType.INT64: torch.int64, O.DType.INT32: torch.int32, O.DType.UINT8: torch.uint8,
}
_REDUCE = {O.ReduceOp.SUM: dist.ReduceOp.SUM, O.ReduceOp.MAX: dist.ReduceOp.MAX, O.ReduceOp.AVG: dist.ReduceOp.SUM}


# torch 2.13 renamed the flat collectives; older releases only have the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ExecutionError(RuntimeError):
    """A rank could not run an op: names the rank, the step and the op."""


class DataMismatch(ExecutionError):
    pass


@dataclass
class RankOptions:
    steps: int = 3
    warmup: int = 1
    check_data: bool = False
    compute_dtype: torch.dtype | None = None  # default: bf16 on GPU, fp32 on CPU
    progress: Any = None  # a shared array: progress[rank] = id of the op being issued


@dataclass
class RankRun:
    records: list[TraceRecord] = field(default_factory=list)
    step_times_ns: list[int] = field(default_factory=list)
    memory_stats: dict[str, int] = field(default_factory=dict)


def spin_ns(duration_ns: int) -> None:
    """Host work of ``duration_ns``: a busy loop, as the Python it stands for keeps a core
    busy and holds the GIL. The interpreter hands the GIL to this rank's stream threads at
    its switch interval (the launcher sets 0.2 ms), as it would to a framework's threads.
    (Sleeping or ``time.sleep(0)`` is no substitute: each such call costs the kernel's
    50 us timer slack, which made a 6 us host op last 60 us on the development machine.)"""
    end = time.perf_counter_ns() + duration_ns
    while time.perf_counter_ns() < end:
        pass


class _Groups:
    """torch.distributed process groups for the schedule's rank tuples (created in the
    same order on every rank, as new_group requires)."""

    def __init__(self, schedule: Schedule, world: int):
        groups = sorted({op.group for p in schedule.programs for op in p.step if isinstance(op, O.Collective)})
        self.pg: dict[tuple[int, ...], Any] = {}
        for g in groups:
            self.pg[g] = None if len(g) == world else dist.new_group(list(g))

    def __getitem__(self, g: tuple[int, ...]) -> Any:
        return self.pg[g]


def last_level_cache_bytes(device: torch.device) -> int:
    """The last-level cache a memory-bound kernel's data can stay in: the GPU's L2, or
    the CPU's largest cache level (Linux sysfs); 0 where neither is known."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        digits = size[:-1] if size[-1:] in "KMG" else size
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best


# Memory-bound kernels walk a ring of this many bytes at least (twice the last-level
# cache where known), so each one's data has left the cache since it was last touched,
# as a training step's tensors have: a step's copies and element-wise kernels read
# gradients, buckets and optimizer state last touched a layer or more earlier. With one
# reused region, a 1-8 MiB copy ran from cache at 22 GB/s on the development machine
# (32 MiB L3) and at 4-6.5 GB/s with the cache evicted first; the executor's own
# kernels, with GEMMs in between, ran at neither, by how much the GEMMs had evicted.
MIN_RING_BYTES = 64 << 20


class _Kernels:
    """Real kernels standing in for compute ops, with operands cached per shape."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.operands: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.ring_bytes = max(MIN_RING_BYTES, 2 * last_level_cache_bytes(device))
        self.scratch = torch.empty(0, dtype=torch.uint8, device=device)
        self.offset = 0

    def _mem(self, nbytes: int) -> None:
        """Read ``nbytes / 2`` and write as many, at the next place in the ring."""
        half = max(1, nbytes // 2)
        if self.scratch.numel() < max(2 * half, self.ring_bytes):
            self.scratch = torch.zeros(max(2 * half, self.ring_bytes), dtype=torch.uint8, device=self.device)
        if self.offset + 2 * half > self.scratch.numel():
            self.offset = 0
        at = self.offset
        self.offset = at + ((2 * half + 4095) & ~4095)  # page-aligned regions
        self.scratch[at + half:at + 2 * half].copy_(self.scratch[at:at + half])

    def run(self, op: O.Compute) -> None:
        g = op.gemm
        if g is not None and op.kind in (O.ComputeKind.GEMM, O.ComputeKind.ATTENTION):
            key = (g.batch, g.m, g.k, g.n)
            if key not in self.operands:
                a = torch.randn(g.batch, g.m, g.k, dtype=self.dtype, device=self.device)
                b = torch.randn(g.batch, g.k, g.n, dtype=self.dtype, device=self.device)
                c = torch.zeros(g.batch, g.m, g.n, dtype=self.dtype, device=self.device)
                self.operands[key] = (a, b, c)
            a, b, c = self.operands[key]
            reps = max(1, round(op.flops / g.flops)) if g.flops else 1  # attention: both matmuls
            # Into a kept output: the schedule's allocs and frees stand for the memory of
            # activations and gradients, so a fresh output per kernel would allocate twice
            # (on CPUs, its page faults took 2% of the machine in a 4-rank run).
            for _ in range(min(reps, 4)):
                torch.bmm(a, b, out=c)
        else:
            self._mem(op.bytes_read + op.bytes_written)

    def copy(self, op: O.Copy) -> None:
        if op.direction is O.CopyDirection.D2D or self.device.type == "cpu":
            self._mem(2 * op.size_bytes)
        else:
            host = torch.empty(op.size_bytes, dtype=torch.uint8, pin_memory=False)
            host.copy_(self.scratch[:op.size_bytes] if self.scratch.numel() >= op.size_bytes
                       else torch.zeros(op.size_bytes, dtype=torch.uint8, device=self.device))


class RankExecutor:
    def __init__(self, schedule: Schedule, rank: int, backend: str, options: RankOptions):
        self.schedule = schedule
        self.rank = rank
        self.world = schedule.world_size
        self.program = schedule.program_of(rank)
        self.opts = options
        self.gpu = backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.gpu else torch.device("cpu")
        # kernels in the schedule's precision (what the real model would run in)
        precision = schedule.meta.precision or ("bf16" if self.gpu else "fp32")
        dtype = options.compute_dtype or {"fp32": torch.float32, "fp16": torch.float16}.get(precision, torch.bfloat16)
        self.kernels = _Kernels(self.device, dtype)
        self.groups = _Groups(schedule, self.world)
        self.buffers: dict[str, torch.Tensor] = {}
        self.partitions: dict[tuple, torch.Tensor] = {}  # persistent own-side tensors of collectives
        self.buffer_streams: dict[str, set[str]] = {}
        self.text = {op.id: op_to_text(op) for op in self.program.all_ops()}
        self.current: O.Op | None = None
        self.step = 0

    # ------------------------------------------------------------ helpers
    def fail(self, op: O.Op, err: BaseException) -> ExecutionError:
        return ExecutionError(f"rank {self.rank}: step {self.step}: op {op.id} `{self.text.get(op.id, op)}`: "
                              f"{type(err).__name__}: {err}")

    def _alloc(self, op: O.Alloc) -> None:
        if self.gpu:
            self.buffers[op.buffer] = torch.empty(op.size_bytes, dtype=torch.uint8, device=self.device)
        elif op.touch_bytes is None:
            # Host memory comes fresh from the OS for large blocks (no caching allocator in
            # front of malloc): touch it now, so its page faults are paid by the allocation
            # rather than by whichever kernel or collective writes it first.
            self.buffers[op.buffer] = torch.zeros(op.size_bytes, dtype=torch.uint8)
        else:  # only part of it is ever written: touch that part, as the model prices it
            buf = torch.empty(op.size_bytes, dtype=torch.uint8)
            buf[:op.touch_bytes].zero_()
            self.buffers[op.buffer] = buf
        self.buffer_streams[op.buffer] = set()

    def _tensor(self, names: tuple[str, ...], nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A typed view of the first listed buffer large enough, else a scratch tensor."""
        item = torch.empty(0, dtype=dtype).element_size()
        if self.opts.check_data:
            names = ()  # concurrent collectives may target one buffer: keep checked data apart
        for n in names:
            t = self.buffers.get(n)
            if t is not None and t.numel() >= nbytes:
                return t[:nbytes].view(dtype)
        return torch.empty(nbytes // item, dtype=dtype, device=self.device)

    def _partition(self, op: O.Collective, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's own side of a gather or reduce-scatter: in a framework, the rank's
        persistent parameter or gradient partition, whose pages were touched long ago.
        One per gathered / reduced buffer set (a parameter's forward and backward gathers
        share it), kept across steps: a fresh untouched tensor per call would add page
        faults to the collective that no framework pays."""
        if self.opts.check_data:
            return torch.empty(numel, dtype=dtype, device=self.device)
        key = (op.kind, op.buffers or (op.id,), numel, dtype)
        t = self.partitions.get(key)
        if t is None:
            t = self.partitions[key] = torch.zeros(numel, dtype=dtype, device=self.device)
        return t

    # ------------------------------------------------------------ collectives
    def _fill(self, t: torch.Tensor, value: float) -> None:
        t.fill_(value)

    def collective(self, op: O.Collective) -> tuple[Any, Any]:
        """Issue one collective asynchronously; returns (work, check) where check()
        verifies the data once the work is done."""
        dtype = _TORCH_DTYPE[op.dtype]
        group = self.groups[op.group]
        p = len(op.group)
        me = op.group.index(self.rank)
        check: Any = None
        tag = float(op.id % 7)
        if op.kind is O.CollectiveKind.ALL_GATHER:
            out = self._tensor(op.buffers, op.size_bytes, dtype)
            shard = self._partition(op, out.numel() // p, dtype)
            if self.opts.check_data:
                self._fill(shard, me + 1 + tag)

                def _check() -> None:
                    for r in range(p):
                        chunk = out[r * shard.numel():(r + 1) * shard.numel()]
                        if not bool((chunk == r + 1 + tag).all()):
                            raise DataMismatch(f"all-gather chunk {r} does not hold rank {op.group[r]}'s shard")
                check = _check
            work = _all_gather(out, shard, group=group, async_op=True)
        elif op.kind is O.CollectiveKind.REDUCE_SCATTER:
            inp = self._tensor(op.buffers, op.size_bytes, dtype)
            out = self._partition(op, inp.numel() // p, dtype)
            if self.opts.check_data:
                self._fill(inp, me + 1)

                def _check() -> None:
                    if not bool((out == p * (p + 1) / 2).all()):
                        raise DataMismatch(f"reduce-scatter result is not the sum over {p} ranks")
                check = _check
            work = _reduce_scatter(out, inp, op=_REDUCE[op.reduce_op or O.ReduceOp.SUM], group=group, async_op=True)
        elif op.kind is O.CollectiveKind.ALL_REDUCE:
            buf = self._tensor(op.buffers, op.size_bytes, dtype)
            rop = op.reduce_op or O.ReduceOp.SUM
            if self.opts.check_data:
                self._fill(buf, me + 1)
                expect = p * (p + 1) / 2 if rop is not O.ReduceOp.MAX else p

                def _check() -> None:
                    if not bool((buf == expect).all()):
                        raise DataMismatch(f"all-reduce result is not the {rop.value} over {p} ranks")
                check = _check
            work = dist.all_reduce(buf, op=_REDUCE[rop], group=group, async_op=True)
        else:
            buf = self._tensor(op.buffers, op.size_bytes, dtype)
            root = op.root if op.root is not None else op.group[0]
            if self.opts.check_data:
                self._fill(buf, 42.0 if self.rank == root else 0.0)

                def _check() -> None:
                    if not bool((buf == 42.0).all()):
                        raise DataMismatch(f"broadcast did not deliver rank {root}'s buffer")
                check = _check
            work = dist.broadcast(buf, src=root, group=group, async_op=True)
        return work, check

    # ------------------------------------------------------------ run
    def setup(self) -> None:
        for op in self.program.setup:
            self._alloc(op)

    def run(self) -> RankRun:
        self.setup()
        impl = _GpuRank(self) if self.gpu else _CpuRank(self)
        out = RankRun()
        for step in range(self.opts.warmup + self.opts.steps):
            self.step = step
            measured = step >= self.opts.warmup
            dist.barrier()
            t0, recs = impl.run_step()
            if measured:
                s = step - self.opts.warmup
                out.records.extend(replace(r, start_ns=r.start_ns - t0, end_ns=r.end_ns - t0, step=s) for r in recs)
                out.step_times_ns.append(max((r.end_ns for r in recs), default=t0) - t0)
        if self.gpu:
            out.memory_stats = {k: int(v) for k, v in torch.cuda.memory_stats(self.device).items()
                                if isinstance(v, (int, float))}
        return out


class _Done:
    """An op's completion on a CPU rank. A thread that waits for a collective waits on
    the backend's work itself where it has one, so it wakes when the backend completes
    the work, not after the done-callback's own wake-up (on the development machine,
    4 ranks on 2 cores, that hand-off cost 0.3-0.5 ms). The op's end is the first moment
    any thread saw it complete, so that nothing that waited for it starts before it ends."""

    __slots__ = ("event", "work", "end_ns")
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.event = threading.Event()  # set once the op is done and checked
        self.work: Any = None
        self.end_ns: int | None = None

    def set(self) -> None:
        self.event.set()

    def seen(self) -> None:
        """A thread saw the op complete, now."""
        t = time.perf_counter_ns()
        with self._lock:
            if self.end_ns is None or t < self.end_ns:
                self.end_ns = t

    def is_set(self) -> bool:
        work = self.work
        if self.event.is_set():
            return True
        if work is not None and work.is_completed():
            self.seen()
            return True
        return False

    def wait(self) -> None:
        work = self.work
        if work is not None and not self.event.is_set():
            try:
                work.wait()
            except BaseException:  # noqa: BLE001 - the done-callback records the error
                self.event.wait()
                return
            self.seen()
            return
        self.event.wait()


def _record(ex: RankExecutor, stream: str, op: O.Op, start: int, end: int) -> TraceRecord:
    return TraceRecord(ex.rank, stream, int(op.id), O.op_kind_name(op), op.label, start, end, O.op_size_bytes(op),
                       O.op_flops(op), 0, op.phase.value)


class _CpuRank:
    """CPU semantics, as frameworks run on CPUs: a kernel executes on the host thread when
    the host reaches it, once its dependencies and the previous op of its stream are done
    (a CPU has no device queue). A collective whose inputs are ready when the host reaches
    it is issued by the host thread itself, as a framework's Python issues it; one that
    must wait goes to an issuer thread per stream (keeping stream order without blocking
    the host). Either way collectives reach the backend in program order (a ticket), so
    every rank issues them in the same order. A collective ends when the first thread sees
    it complete: its done-callback on the backend's thread, or a thread waiting on it
    (see _Done); one whose work has no future is watched by its stream's issuer thread."""

    def __init__(self, ex: RankExecutor):
        self.ex = ex
        colls = [op for op in ex.program.step if isinstance(op, O.Collective)]
        self.coll_index = {op.id: i for i, op in enumerate(colls)}
        self.no_future: set[O.CollectiveKind] = set()  # the backend's works of these kinds have none

    def run_step(self) -> tuple[int, list[TraceRecord]]:
        ex = self.ex
        done: dict[O.OpId, _Done] = {}
        last_on: dict[str, _Done] = {}
        records: list[TraceRecord] = []
        lock = threading.Lock()
        issued = [0]
        issue_cv = threading.Condition()
        errors: list[BaseException] = []
        issuers: dict[str, list] = {}  # stream -> [its queue, condition]
        threads: list[threading.Thread] = []
        no_future = self.no_future
        finished: list[tuple] = []  # collectives done: (completion, stream, op, issue time)

        def finish(op: O.Collective, stream: str, start: int, ev: _Done, check: Any,
                   wait: Any) -> None:
            """Record a collective once ``wait()`` (which raises the backend's error: a
            timeout, a dead peer) has returned, and wake whoever waits for it."""
            try:
                wait()
                ev.seen()
                ev.work = None  # the work holds its tensors: let a freed buffer's memory go
                if check is not None:
                    check()
                with lock:
                    finished.append((ev, stream, op, start))
            except BaseException as e:  # noqa: BLE001 - re-raised on the host with the op named
                errors.append(e if isinstance(e, ExecutionError) else ex.fail(op, e))
                with issue_cv:
                    issue_cv.notify_all()
            finally:
                ev.set()

        def issue(op: O.Collective, stream: str, ev: _Done, on_issuer: bool) -> None:
            """Hand the collective to the backend once every earlier one has been (its
            ticket), then watch for its completion: a done-callback on the backend's
            thread where the work has a future (it wakes the waiter directly), else a
            wait on the stream's issuer thread (gloo's reduce-scatter has no future)."""
            with issue_cv:
                while issued[0] != self.coll_index[op.id] and not errors:
                    issue_cv.wait(0.05)
                if errors:
                    ev.set()
                    return
                start = time.perf_counter_ns()
                try:
                    work, check = ex.collective(op)
                    ev.work = work
                except BaseException:
                    ev.set()  # never issued: nobody may wait for it (the step's end waits for all)
                    raise
                finally:
                    issued[0] += 1
                    issue_cv.notify_all()
            fut = None
            if op.kind not in no_future:
                try:
                    fut = work.get_future()
                except RuntimeError:  # "Work::getFuture not implemented"
                    no_future.add(op.kind)
            if fut is None:
                if on_issuer:
                    finish(op, stream, start, ev, check, work.wait)
                else:
                    enqueue(stream, ("wait", op, ev, (start, check, work.wait)))
                return
            fut.add_done_callback(lambda f: finish(op, stream, start, ev, check, f.value))

        def issuer(stream: str, items: list, cv: threading.Condition) -> None:
            while True:
                with cv:
                    while not items:
                        cv.wait()
                    item = items.pop(0)
                if item is None:
                    return
                what, op, ev, arg = item
                if what == "wait":
                    start, check, wait = arg
                    finish(op, stream, start, ev, check, wait)
                    continue
                try:
                    if arg is not None:  # the stream's previous collective
                        arg.wait()
                    for d in op.deps:
                        done[d].wait()
                    if errors:
                        ev.set()
                        continue
                    issue(op, stream, ev, True)
                except BaseException as e:  # noqa: BLE001 - re-raised on the host with the op named
                    errors.append(e if isinstance(e, ExecutionError) else ex.fail(op, e))
                    ev.set()
                    with issue_cv:
                        issue_cv.notify_all()

        def enqueue(stream: str, item: tuple | None) -> None:
            if stream not in issuers:
                queue: list = []
                cv = threading.Condition()
                th = threading.Thread(target=issuer, args=(stream, queue, cv), daemon=True)
                issuers[stream] = [queue, cv]
                threads.append(th)
                th.start()
            items, cv = issuers[stream]
            with cv:
                items.append(item)
                cv.notify()

        t0 = time.perf_counter_ns()
        try:
            for op in ex.program.step:
                if errors:
                    break
                ex.current = op
                if ex.opts.progress is not None:
                    ex.opts.progress[ex.rank] = int(op.id)
                start = time.perf_counter_ns()
                if isinstance(op, O.HostWork):
                    spin_ns(op.duration_ns)
                elif isinstance(op, O.HostSync):
                    if op.scope is O.SyncScope.OPS:
                        evs = [done[d] for d in op.deps]
                    elif op.scope is O.SyncScope.STREAM:
                        evs = [last_on[op.stream]] if op.stream in last_on else []
                    else:
                        evs = list(last_on.values())
                    for e in evs:
                        e.wait()
                elif isinstance(op, O.Alloc):
                    ex._alloc(op)
                elif isinstance(op, O.Free):
                    ex.buffers.pop(op.buffer, None)
                    continue
                elif isinstance(op, O.Collective):
                    ev = _Done()
                    prev = last_on.get(op.stream)
                    done[op.id] = ev
                    last_on[op.stream] = ev
                    if ((prev is None or prev.is_set()) and all(done[d].is_set() for d in op.deps)
                            and issued[0] == self.coll_index[op.id]):
                        # nothing to wait for: issue it from the host thread, as a
                        # framework's Python does (a hand-off to a thread costs wake-ups)
                        try:
                            issue(op, op.stream, ev, False)
                        except ExecutionError:
                            raise
                        except BaseException as e:  # noqa: BLE001
                            raise ex.fail(op, e) from e
                        continue
                    enqueue(op.stream, ("issue", op, ev, prev))
                    continue
                else:  # compute or copy: on the host thread, in stream order
                    prev = last_on.get(op.stream)
                    if prev is not None:
                        prev.wait()
                    for d in op.deps:
                        done[d].wait()
                    if errors:
                        break
                    start = time.perf_counter_ns()
                    try:
                        if isinstance(op, O.Compute):
                            ex.kernels.run(op)
                        else:
                            ex.kernels.copy(op)
                    except BaseException as e:  # noqa: BLE001
                        raise ex.fail(op, e) from e
                    end = time.perf_counter_ns()
                    ev = _Done()
                    ev.set()
                    done[op.id] = ev
                    last_on[op.stream] = ev
                    with lock:
                        records.append(_record(ex, op.stream, op, start, end))
                    continue
                with lock:
                    records.append(_record(ex, HOST_STREAM, op, start, time.perf_counter_ns()))
        finally:
            for stream in list(issuers):
                enqueue(stream, None)
            for th in threads:
                th.join()
            for ev in done.values():  # every collective done (its watcher has run)
                ev.event.wait()
        for ev, stream, op, start in finished:
            assert ev.end_ns is not None
            records.append(_record(ex, stream, op, start, ev.end_ns))
        # The helpers above refer to one another (issuer, issue, enqueue): a reference
        # cycle that keeps their scope alive until the garbage collector finds it. Let go
        # of the step's events and threads now: left to the collector, they made its passes
        # longer and more frequent, and a pass runs inside whichever op allocates next
        # (measured: the 4-rank ZeRO-3 baseline's large allocations took 2.3x as long).
        for held in (done, last_on, issuers, threads, finished):
            held.clear()
        if errors:
            raise errors[0]
        return t0, records


class _GpuRank:
    """CUDA streams and events; NCCL collectives issued by the host in program order."""

    def __init__(self, ex: RankExecutor):
        self.ex = ex
        self.streams: dict[str, torch.cuda.Stream] = {}

    def _stream(self, name: str) -> torch.cuda.Stream:
        if name not in self.streams:
            self.streams[name] = torch.cuda.Stream(device=self.ex.device)
        return self.streams[name]

    def run_step(self) -> tuple[int, list[TraceRecord]]:
        ex = self.ex
        torch.cuda.synchronize(ex.device)
        ref = torch.cuda.Event(enable_timing=True)
        ref.record()
        t0_host = time.perf_counter_ns()
        events: dict[O.OpId, tuple[str, O.Op, Any, Any]] = {}
        last_on: dict[str, Any] = {}
        host_recs: list[tuple[O.Op, int, int]] = []
        checks = []
        for op in ex.program.step:
            ex.current = op
            start = time.perf_counter_ns()
            if isinstance(op, O.HostWork):
                spin_ns(op.duration_ns)
            elif isinstance(op, O.HostSync):
                if op.scope is O.SyncScope.OPS:
                    for d in op.deps:
                        events[d][3].synchronize()
                elif op.scope is O.SyncScope.STREAM:
                    if op.stream in self.streams:
                        self.streams[op.stream].synchronize()
                else:
                    torch.cuda.synchronize(ex.device)
            elif isinstance(op, O.Alloc):
                with torch.cuda.stream(self._stream(op.stream)):
                    ex._alloc(op)
            elif isinstance(op, O.Free):
                t = ex.buffers.pop(op.buffer, None)
                if t is not None:
                    for s in ex.buffer_streams.pop(op.buffer, ()):
                        if s != op.stream:
                            t.record_stream(self._stream(s))
                del t
            else:
                s = self._stream(op.stream)
                for d in op.deps:
                    s.wait_event(events[d][3])
                for b in op.buffers:
                    if b in ex.buffer_streams:
                        ex.buffer_streams[b].add(op.stream)
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(s):
                    begin.record()
                    try:
                        if isinstance(op, O.Collective):
                            work, check = ex.collective(op)
                            work.wait()
                            if check is not None:
                                checks.append((op, check))
                        elif isinstance(op, O.Compute):
                            ex.kernels.run(op)
                        else:
                            ex.kernels.copy(op)
                    except BaseException as e:  # noqa: BLE001
                        raise ex.fail(op, e) from e
                    end.record()
                events[op.id] = (op.stream, op, begin, end)
                last_on[op.stream] = end
                continue
            host_recs.append((op, start, time.perf_counter_ns()))
        torch.cuda.synchronize(ex.device)
        for op, check in checks:
            try:
                check()
            except BaseException as e:  # noqa: BLE001
                raise ex.fail(op, e) from e
        recs = []
        for stream, op, b, e in events.values():
            start = t0_host + int(ref.elapsed_time(b) * 1e6)
            recs.append(_record(ex, stream, op, start, t0_host + int(ref.elapsed_time(e) * 1e6)))
        recs.extend(_record(ex, HOST_STREAM, op, s, e) for op, s, e in host_recs)
        return t0_host, recs


def env_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun / srun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), int(os.environ.get("SLURM_LOCALID", 0))
    return None
