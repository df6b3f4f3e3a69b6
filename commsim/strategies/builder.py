"""ProgramBuilder: appends IR ops for one rank with fresh ids and stream bookkeeping.

Every op it makes carries the builder's current ``phase``: a generator sets
``builder.phase`` as it moves from forward to backward to the optimizer step, and the
ops it emits in between (host work, allocations, syncs included) belong to that phase.
Setup allocations are always ``Phase.SETUP``.

``host_blocking``: the process group completes collectives on the host (gloo on CPU
tensors), where c10d's ``work.wait()`` after a call with ``async_op=False`` blocks the
calling thread until the collective is done (on NCCL it only orders the current
stream). A generator marks such calls ``blocking``; with ``host_blocking`` set, the host
then waits for each one right after issuing it.
"""

from __future__ import annotations

from commsim.ir import ops as O
from commsim.ir.schedule import Program


class ProgramBuilder:
    def __init__(self) -> None:
        self._next = 0
        self.setup: list[O.Alloc] = []
        self.step: list[O.Op] = []
        self.last_on_stream: dict[str, O.OpId] = {}
        self.phase = O.Phase.OTHER
        self.host_blocking = False  # async_op=False collectives block the host (module docstring)

    def _id(self) -> O.OpId:
        self._next += 1
        return O.OpId(self._next)

    def _device(self, op: O.Op) -> O.OpId:
        self.step.append(op)
        self.last_on_stream[op.stream] = op.id
        return op.id

    def wait_stream(self, stream: str) -> tuple[O.OpId, ...]:
        """Deps that make an op wait for everything queued on ``stream`` so far."""
        last = self.last_on_stream.get(stream)
        return (last,) if last is not None else ()

    def setup_alloc(self, buffer: str, size_bytes: int, label: str, stream: str = "compute") -> None:
        self.setup.append(O.Alloc(self._id(), stream, label, buffer, size_bytes, phase=O.Phase.SETUP))

    def alloc(self, buffer: str, size_bytes: int, stream: str, label: str, touch_bytes: int | None = None) -> O.OpId:
        op = O.Alloc(self._id(), stream, label, buffer, size_bytes, touch_bytes, phase=self.phase)
        self.step.append(op)
        return op.id

    def free(self, buffer: str, stream: str, label: str) -> O.OpId:
        op = O.Free(self._id(), stream, label, buffer, phase=self.phase)
        self.step.append(op)
        return op.id

    def compute(self, stream: str, label: str, kind: O.ComputeKind, flops: int, bytes_read: int,
                bytes_written: int, gemm: O.GemmShape | None = None, deps: tuple[O.OpId, ...] = (),
                buffers: tuple[str, ...] = (), reuse_bytes: int = 0, working_set_bytes: int = 0,
                in_place_bytes: int = 0) -> O.OpId:
        return self._device(O.Compute(self._id(), stream, label, kind, flops, bytes_read, bytes_written, gemm,
                                      _dedup(deps), buffers, phase=self.phase, reuse_bytes=reuse_bytes,
                                      working_set_bytes=working_set_bytes, in_place_bytes=in_place_bytes))

    def collective(self, stream: str, label: str, kind: O.CollectiveKind, size_bytes: int, dtype: O.DType,
                   group: tuple[int, ...], reduce_op: O.ReduceOp | None = None, root: int | None = None,
                   deps: tuple[O.OpId, ...] = (), buffers: tuple[str, ...] = (), blocking: bool = False) -> O.OpId:
        """``blocking``: the framework calls it with ``async_op=False`` (see host_blocking)."""
        op = self._device(O.Collective(self._id(), stream, label, kind, size_bytes, dtype, group, reduce_op, root,
                                       _dedup(deps), buffers, phase=self.phase))
        if blocking and self.host_blocking:
            self.sync_ops((op,), f"{label}: async_op=False, waited on the host")
        return op

    def copy(self, stream: str, label: str, direction: O.CopyDirection, size_bytes: int,
             deps: tuple[O.OpId, ...] = (), buffers: tuple[str, ...] = ()) -> O.OpId:
        return self._device(O.Copy(self._id(), stream, label, direction, size_bytes, _dedup(deps), buffers, phase=self.phase))

    def reduce_to_host(self, label: str, size_bytes: int, dtype: O.DType, group: tuple[int, ...],
                       reduce_op: O.ReduceOp, launch_ns: int, why: str, deps: tuple[O.OpId, ...] = ()) -> None:
        """An all-reduce of a scalar the host then reads (``.item()``): launch, collective on
        the compute stream, device-to-host copy, host sync on it."""
        self.host(f"{label} launch", O.HostKind.LAUNCH, launch_ns)
        ar = self.collective("compute", label, O.CollectiveKind.ALL_REDUCE, size_bytes, dtype, group,
                             reduce_op=reduce_op, deps=deps)
        cp = self.copy("compute", label.replace("allreduce", "item"), O.CopyDirection.D2H, size_bytes, deps=(ar,))
        self.sync_ops((cp,), why)

    def host(self, label: str, kind: O.HostKind, duration_ns: int) -> O.OpId | None:
        if duration_ns <= 0:
            return None
        op = O.HostWork(self._id(), label, kind, duration_ns, phase=self.phase)
        self.step.append(op)
        return op.id

    def sync_ops(self, deps: tuple[O.OpId, ...], label: str) -> None:
        if deps:
            self.step.append(O.HostSync(self._id(), label, O.SyncScope.OPS, deps=_dedup(deps), phase=self.phase))

    def sync_stream(self, stream: str, label: str) -> None:
        self.step.append(O.HostSync(self._id(), label, O.SyncScope.STREAM, stream=stream, phase=self.phase))

    def sync_device(self, label: str) -> None:
        self.step.append(O.HostSync(self._id(), label, O.SyncScope.DEVICE, phase=self.phase))

    def program(self) -> Program:
        return Program(setup=tuple(self.setup), step=tuple(self.step))


def _dedup(deps: tuple[O.OpId, ...]) -> tuple[O.OpId, ...]:
    return tuple(dict.fromkeys(deps))
