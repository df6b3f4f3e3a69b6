"""The ops of the schedule IR: what one rank's host thread and GPU streams do in a step.

Execution model (shared by the simulator and the real executor):

* A rank's program is an ordered list of ops that its host (Python) thread issues in
  order. *Host ops* (``HostWork``, ``HostSync``, ``Alloc``, ``Free``) run on the host
  thread itself and block it while they run. *Device ops* (``Compute``, ``Collective``,
  ``Copy``) are enqueued on the named stream and the host moves on.
* A device op starts when the previous op on its stream has finished (streams are
  FIFO) and every op in its ``deps`` has finished (a cross-stream wait, like
  ``cudaStreamWaitEvent``). Deps name ops of the same rank issued earlier.
* ``HostSync`` blocks the host until its ``deps`` have finished (an event
  synchronize), or until everything issued so far on one stream / on every stream has
  finished (stream / device synchronize).
* ``Alloc`` and ``Free`` are caching-allocator calls made by the host for a stream.
  A buffer freed while another stream still uses it is only reusable once those uses
  have finished (``record_stream`` semantics).

Units are in the field names: bytes, flops, nanoseconds.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import NewType, Union

OpId = NewType("OpId", int)
StreamName = NewType("StreamName", str)
BufferName = NewType("BufferName", str)

# Names appear unquoted in the text form, so they may not hold spaces, commas or '='.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:/\[\]-]+$")


def check_name(value: str, what: str) -> None:
    """Raise ValueError unless ``value`` is a well-formed stream or buffer name."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(
            f"{what} {value!r} is not a valid name: use letters, digits and _ . : / [ ] -"
        )


class DType(enum.Enum):
    """Element types that collectives and buffers carry."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP64 = "fp64"
    INT64 = "int64"
    INT32 = "int32"
    UINT8 = "uint8"

    @property
    def itemsize_bytes(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.FP32: 4,
    DType.FP16: 2,
    DType.BF16: 2,
    DType.FP64: 8,
    DType.INT64: 8,
    DType.INT32: 4,
    DType.UINT8: 1,
}


class ComputeKind(enum.Enum):
    """What kind of kernel a compute op is; decides which cost curve applies."""

    GEMM = "gemm"  # tensor-core matmul (mm, addmm, bmm): flops-bound when large
    ATTENTION = "attention"  # a fused attention core: batched score / context matmuls plus softmax
    ELEMENTWISE = "elementwise"  # memory-bound pointwise: activations, casts, adds, copies
    REDUCTION = "reduction"  # memory-bound reduction: bias gradients, sums, means
    NORM = "norm"  # LayerNorm forward / backward (a row-wise reduction and a pointwise pass)
    SOFTMAX = "softmax"  # softmax / log-softmax forward and backward over rows
    DROPOUT = "dropout"  # dropout forward (output and its mask) and backward
    OPTIMIZER = "optimizer"  # Adam over a shard: memory-bound over the state
    EMBEDDING = "embedding"  # gather / scatter-add of embedding rows


class CollectiveKind(enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    MAX = "max"


class CopyDirection(enum.Enum):
    D2H = "d2h"  # device to host (offload, .item())
    H2D = "h2d"  # host to device
    D2D = "d2d"  # within device memory (flatten / unflatten copies)


class HostKind(enum.Enum):
    """Why the host spends the time: lets the simulator attribute host-bound stalls."""

    PYTHON = "python"  # framework bookkeeping (fetch decisions, ...)
    MODULE_HOOK = "module_hook"  # a framework's per-module hook (ZeRO-3's pre/post forward and backward)
    GRAD_HOOK = "grad_hook"  # a framework's per-parameter gradient hook or reduce bookkeeping
    LAUNCH = "launch"  # kernel / collective launch overhead
    OPTIMIZER = "optimizer"  # CPU optimizer step (offload)
    DEBUG = "debug"  # logging / debug-string formatting


class Phase(enum.Enum):
    """The part of a training step an op belongs to: summaries, comparisons and
    calibration group ops by it (generators set it; hand-made ops default to OTHER)."""

    SETUP = "setup"  # persistent state allocated once, before the first step
    FORWARD = "fwd"
    RECOMPUTE = "recompute"  # activation checkpointing: a layer's forward again in backward
    BACKWARD = "bwd"  # backward, gradient reduction included
    OPTIMIZER = "optimizer"  # gradient norm, overflow check, the optimizer step, re-gathers after it
    OTHER = "other"


PHASES = tuple(Phase)


class SyncScope(enum.Enum):
    OPS = "ops"  # wait for the ops in deps (event synchronize)
    STREAM = "stream"  # wait for everything issued so far on one stream
    DEVICE = "device"  # wait for everything issued so far on every stream


@dataclass(frozen=True, slots=True)
class GemmShape:
    """A (batched) matmul C[m, n] = A[m, k] @ B[k, n]; flops = 2*m*n*k*batch."""

    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch


@dataclass(frozen=True, slots=True)
class Compute:
    """A kernel on a stream: ``flops`` arithmetic, ``bytes_read`` + ``bytes_written`` traffic.

    ``gemm`` is the matmul shape: for kind GEMM exactly the kernel (its flops equal
    ``flops``); for ATTENTION the shape of each of its batched score / context matmuls,
    which sets their efficiency while ``flops`` also counts softmax work.

    ``reuse_bytes``: of the op's traffic, the bytes that the ops just before it in the
    same sequence already touched (a single-tensor optimizer's later passes over one
    parameter's arrays); ``working_set_bytes``: the bytes that sequence keeps touching.
    Both are facts of the program; whether the reused bytes stay in a cache is the cost
    model's question (``commsim.hardware.profile``). 0: none stated.

    ``in_place_bytes``: of ``bytes_written``, those written over bytes the op read
    (``x.mul_(c)``): a CPU's write-allocate cache reads every other written line from
    memory first (a read for ownership), these not. 0: every write is to fresh memory.
    """

    id: OpId
    stream: StreamName
    label: str
    kind: ComputeKind
    flops: int
    bytes_read: int
    bytes_written: int
    gemm: GemmShape | None = None
    deps: tuple[OpId, ...] = ()
    buffers: tuple[BufferName, ...] = ()
    phase: Phase = Phase.OTHER
    reuse_bytes: int = 0
    working_set_bytes: int = 0
    in_place_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Collective:
    """A collective over ``group`` (global ranks, ascending).

    ``size_bytes`` follows nccl-tests' S: the all-gather *output*, the reduce-scatter
    *input*, the all-reduce / broadcast buffer. Each rank's shard of an all-gather or
    reduce-scatter is ``size_bytes / len(group)``.
    """

    id: OpId
    stream: StreamName
    label: str
    kind: CollectiveKind
    size_bytes: int
    dtype: DType
    group: tuple[int, ...]
    reduce_op: ReduceOp | None = None  # reduce-scatter / all-reduce only
    root: int | None = None  # broadcast only: a global rank in the group
    deps: tuple[OpId, ...] = ()
    buffers: tuple[BufferName, ...] = ()
    phase: Phase = Phase.OTHER


@dataclass(frozen=True, slots=True)
class Copy:
    """A memory copy on a stream (offload traffic, flatten / unflatten copies)."""

    id: OpId
    stream: StreamName
    label: str
    direction: CopyDirection
    size_bytes: int
    deps: tuple[OpId, ...] = ()
    buffers: tuple[BufferName, ...] = ()
    phase: Phase = Phase.OTHER


@dataclass(frozen=True, slots=True)
class Alloc:
    """A caching-allocator request by the host for ``stream``.

    ``touch_bytes``: how much of the block is ever written while it lives; None means
    all of it. It matters without a caching allocator (CPUs): a large block comes as
    fresh pages from the OS, and each page costs a fault on its first write, so a
    ``torch.empty`` of which only part is written (DeepSpeed's 500M-element gradient
    bucket, say) costs only what is written. The cost is charged at the allocation."""

    id: OpId
    stream: StreamName
    label: str
    buffer: BufferName
    size_bytes: int
    touch_bytes: int | None = None
    phase: Phase = Phase.OTHER


@dataclass(frozen=True, slots=True)
class Free:
    """Returns ``buffer`` to the caching allocator (deferred while other streams use it)."""

    id: OpId
    stream: StreamName
    label: str
    buffer: BufferName
    phase: Phase = Phase.OTHER


@dataclass(frozen=True, slots=True)
class HostWork:
    """Host-thread time: Python bookkeeping, launch overhead, CPU optimizer work."""

    id: OpId
    label: str
    kind: HostKind
    duration_ns: int
    phase: Phase = Phase.OTHER


@dataclass(frozen=True, slots=True)
class HostSync:
    """The host blocks until ``deps`` (scope OPS), one ``stream``, or the device is done."""

    id: OpId
    label: str
    scope: SyncScope
    stream: StreamName | None = None  # scope STREAM only
    deps: tuple[OpId, ...] = ()  # scope OPS only
    phase: Phase = Phase.OTHER


DeviceOp = Union[Compute, Collective, Copy]
HostOp = Union[HostWork, HostSync, Alloc, Free]
Op = Union[Compute, Collective, Copy, Alloc, Free, HostWork, HostSync]

DEVICE_OP_TYPES = (Compute, Collective, Copy)
HOST_OP_TYPES = (HostWork, HostSync, Alloc, Free)
OP_TYPES = DEVICE_OP_TYPES + HOST_OP_TYPES


def op_kind_name(op: Op) -> str:
    """The short kind used in traces and the text form (e.g. ``all_gather``, ``gemm``)."""
    if isinstance(op, Compute):
        return op.kind.value
    if isinstance(op, Collective):
        return op.kind.value
    if isinstance(op, Copy):
        return "copy_" + op.direction.value
    if isinstance(op, Alloc):
        return "alloc"
    if isinstance(op, Free):
        return "free"
    if isinstance(op, HostWork):
        return "host_" + op.kind.value
    if isinstance(op, HostSync):
        return "sync_" + op.scope.value
    raise TypeError(f"not an op: {op!r}")


def op_deps(op: Op) -> tuple[OpId, ...]:
    """The explicit dependency edges of an op (host ops other than syncs have none)."""
    return getattr(op, "deps", ())


def op_buffers(op: Op) -> tuple[BufferName, ...]:
    """Buffers a device op reads or writes."""
    return getattr(op, "buffers", ())


def is_device_op(op: Op) -> bool:
    return isinstance(op, DEVICE_OP_TYPES)


def op_size_bytes(op: Op) -> int:
    """Bytes an op moves or allocates (0 for host work and syncs)."""
    if isinstance(op, Compute):
        return op.bytes_read + op.bytes_written
    if isinstance(op, (Collective, Copy, Alloc)):
        return op.size_bytes
    return 0


def op_flops(op: Op) -> int:
    return op.flops if isinstance(op, Compute) else 0


def collective_columns(op: Op) -> tuple[str, str]:
    """A trace record's (dtype, group) columns: a collective's element type and its
    global ranks (``"0,1"``); ``("", "")`` for every other op."""
    if isinstance(op, Collective):
        return op.dtype.value, ",".join(map(str, op.group))
    return "", ""
