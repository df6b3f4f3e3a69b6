"""A rank's step on a GPU platform (kernels queued on CUDA streams; NCCL).

Each schedule stream is a CUDA stream, created on first use. The host thread walks the
program in order, noting each op as it issues it (``RankExecutor.note``: the launcher
names a hung rank by that op), and queues every device op (kernel, copy, collective) on
its stream after a wait on each dependency's end event; collectives reach NCCL in the
host's program order, so every rank issues them in the same order. Allocations go
through PyTorch's caching allocator on the op's stream; a buffer used on other streams
than the one it was allocated on gets ``record_stream`` for each of them when it is
freed (``BufferStreams``), so the allocator reuses its block only once every user is
done, and the allocator's own behaviour is part of what is measured. What the kernels
need besides the schedule's buffers (``runtime.kernels.StreamKernels``) is allocated
once per stream, on that stream, before the first step. Host work spins the host; a
host sync waits on events, a stream or the device. Device ops are timed by CUDA events,
placed on the host's monotonic clock (ns) through an event recorded at the step's start.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from commsim.ir import ops as O
from commsim.ir.trace import HOST_STREAM, TraceRecord
from runtime.kernels import spin_ns
from runtime.step import op_record

if TYPE_CHECKING:
    from runtime.executor import RankExecutor


class BufferStreams:
    """Which stream allocated each live buffer and which streams used it.

    PyTorch's caching allocator files a block under the stream it was allocated on and
    hands it out again, once freed, to the next allocation on that stream, as soon as
    the host frees it. A buffer that kernels of another stream read or write must stay
    out of reach until those kernels are done: ``record_stream`` on each such stream.
    The streams to record are the buffer's users other than its *allocation* stream,
    whichever stream the free is issued from: ZeRO-3 allocates a gathered parameter on
    the all-gather stream and frees it from the compute stream that read it, and the
    compute stream is exactly the one that must be recorded."""

    def __init__(self) -> None:
        self.alloc_stream: dict[str, str] = {}
        self.users: dict[str, set[str]] = {}

    def allocated(self, buffer: str, stream: str) -> None:
        self.alloc_stream[buffer] = stream
        self.users[buffer] = set()

    def used(self, buffer: str, stream: str) -> None:
        if buffer in self.users:
            self.users[buffer].add(stream)

    def freed(self, buffer: str) -> list[str]:
        """The streams to ``record_stream`` the freed buffer on (sorted: the same calls
        every step)."""
        alloc = self.alloc_stream.pop(buffer, None)
        users = self.users.pop(buffer, set())
        return sorted(users - {alloc})


class GpuRank:
    """CUDA streams and events; NCCL collectives issued by the host in program order."""

    def __init__(self, ex: RankExecutor):
        self.ex = ex
        self.streams: dict[str, torch.cuda.Stream] = {}
        self.buffer_streams = BufferStreams()
        for name in ex.kernels.need:  # every stream's own memory, once, on that stream
            with torch.cuda.stream(self._stream(name)):
                ex.kernels.allocate(name)

    def _stream(self, name: str) -> torch.cuda.Stream:
        if name not in self.streams:
            self.streams[name] = torch.cuda.Stream(device=self.ex.device)
        return self.streams[name]

    def _alloc(self, op: O.Alloc) -> None:
        with torch.cuda.stream(self._stream(op.stream)):
            self.ex._alloc(op)
        self.buffer_streams.allocated(op.buffer, op.stream)

    def setup(self) -> None:
        for op in self.ex.program.setup:
            self._alloc(op)
        torch.cuda.synchronize(self.ex.device)

    def run_step(self) -> tuple[int, list[TraceRecord]]:
        ex = self.ex
        torch.cuda.synchronize(ex.device)
        ref = torch.cuda.Event(enable_timing=True)
        ref.record()
        t0_host = time.perf_counter_ns()
        events: dict[O.OpId, tuple[str, O.Op, Any, Any]] = {}
        host_recs: list[tuple[O.Op, int, int]] = []
        checks = []
        for op in ex.program.step:
            ex.note(op)
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
                self._alloc(op)
            elif isinstance(op, O.Free):
                t = ex.buffers.pop(op.buffer, None)
                for s in self.buffer_streams.freed(op.buffer):
                    if t is not None:
                        t.record_stream(self._stream(s))
                del t
            else:
                s = self._stream(op.stream)
                for d in op.deps:
                    s.wait_event(events[d][3])
                for b in op.buffers:
                    self.buffer_streams.used(b, op.stream)
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(s):
                    begin.record()
                    try:
                        if isinstance(op, O.Collective):
                            work, check = ex.collective(op)
                            work.wait()  # the stream waits for the collective; the host does not
                            # not kept until the next collective: a work holds its tensors
                            # (as on CPUs, cpu_rank's issuer), past a free the schedule made
                            del work
                            if check is not None:
                                checks.append((op, check))
                        else:
                            ex.kernels.execute(op, ex.buffers)
                    except BaseException as e:  # noqa: BLE001
                        raise ex.fail(op, e) from e
                    end.record()
                events[op.id] = (op.stream, op, begin, end)
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
            recs.append(op_record(ex.rank, stream, op, start, t0_host + int(ref.elapsed_time(e) * 1e6)))
        recs.extend(op_record(ex.rank, HOST_STREAM, op, s, e) for op, s, e in host_recs)
        return t0_host, recs
