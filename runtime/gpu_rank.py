"""A rank's step on a GPU platform (kernels queued on CUDA streams; NCCL).

Each schedule stream is a CUDA stream, created on first use. The host thread walks the
program in order and queues every device op (kernel, copy, collective) on its stream
after a wait on each dependency's end event; collectives reach NCCL in the host's
program order, so every rank issues them in the same order. Allocations and frees go
through PyTorch's caching allocator on the op's stream, with ``record_stream`` for a
buffer used on other streams, so the allocator's own behaviour is part of what is
measured. Host work spins the host; a host sync waits on events, a stream or the device.
Device ops are timed by CUDA events, placed on the host's monotonic clock (ns) through
an event recorded at the step's start.
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


class GpuRank:
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
                        else:
                            ex.kernels.execute(op)
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
            recs.append(op_record(ex.rank, stream, op, start, t0_host + int(ref.elapsed_time(e) * 1e6)))
        recs.extend(op_record(ex.rank, HOST_STREAM, op, s, e) for op, s, e in host_recs)
        return t0_host, recs
