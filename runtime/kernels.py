"""The real kernels that stand in for a schedule's compute and copy ops.

A GEMM (or attention) op runs a batched matmul of its shape, as many times as its flops
ask (at most 4). Every other compute op is a memory-bound kernel moving the op's bytes
(half read, half written) at the next place of a ring larger than the last-level
cache, so its data comes from memory, as a step's tensors do; the bytes an op states it
reuses (``reuse_bytes``: what the ops just before it touched) it moves on the ring's
most recently touched bytes instead, so they come from the cache where they fit, as in
the program it stands for (``ring_step``). Host work is a busy loop of its duration
(``spin_ns``).

Two holders of the kernels' memory, one per platform:

* ``Kernels`` (host platforms, and ``calibrate``'s micro-benchmarks): one ring, and GEMM
  operands kept per shape. Kernels run one at a time on the host thread, so one ring
  serves every stream; a copy is the memory-bound kernel over its bytes read and
  written (host and "device" are the same memory). With ``cold_gemms`` (calibrate's
  GEMM timings) each call reads its operands from the next place of a ring of inputs
  larger than the last-level cache and writes the next place of a ring of outputs
  (``ColdOperands``), as a step's GEMMs do: the memory-bound kernels and other GEMMs
  between two calls of one shape have evicted its operands.
* ``StreamKernels`` (GPU ranks): what a rank's kernels touch besides the schedule's own
  buffers is fixed before the first step and never reallocated, so that the caching
  allocator sees the schedule's allocations and nothing else: per stream, a ring for
  memory-bound kernels (kernels of different streams run at once and must not write
  one region), a scratch for GEMM operands no buffer of the op holds and for GEMM
  outputs, and a pinned host buffer for copies. GEMM inputs are read from the op's own
  buffers where one is large enough (``plan_operands``). Host<->device copies are
  pinned and non-blocking, each in its direction, so they run on the copy engines at
  PCIe rate, as DeepSpeed's offload copies do.

The executor runs these kernels for the schedule's ops and ``calibrate`` times the very
same ones, so that a profile prices what the executor will run. Sizes in bytes, times
in nanoseconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from commsim.hardware.platform import KernelExecution, Platform
from commsim.ir import ops as O


def device_of(platform: Platform) -> torch.device:
    """Where a platform's kernels and buffers live: the current GPU where kernels are
    queued on device streams, else the host."""
    if platform.kernels is KernelExecution.QUEUED:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_precision(platform: Platform) -> str:
    """The precision a platform's kernels run in when a schedule does not say: bf16 on
    GPUs (what training runs in there), fp32 on CPUs (most have no bf16 units)."""
    return "fp32" if platform.inline_kernels else "bf16"


def spin_ns(duration_ns: int) -> None:
    """Host work of ``duration_ns``: a busy loop, as the Python it stands for keeps a core
    busy and holds the GIL. The interpreter hands the GIL to this rank's stream threads at
    its switch interval (the launcher sets 0.2 ms), as it would to a framework's threads.
    (Sleeping or ``time.sleep(0)`` is no substitute: each such call costs the kernel's
    timer slack, 50 us by default, far more than a short host op.)"""
    end = time.perf_counter_ns() + duration_ns
    while time.perf_counter_ns() < end:
        pass


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
# reused region a copy runs from cache, several times faster than the same copy in a
# step (traces/README.md, runs M to P).
MIN_RING_BYTES = 64 << 20


class Kernels:
    """Real kernels standing in for compute ops, with one ring and operands cached per
    shape: for kernels that run one at a time on the host thread (CPU ranks) and for
    calibrate's benchmarks (which drop the operands after each shape)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, cold_gemms: bool = False):
        self.device, self.dtype = device, dtype
        self.operands: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.ring_bytes = max(MIN_RING_BYTES, 2 * last_level_cache_bytes(device))
        self.cold = ColdOperands(device, dtype, self.ring_bytes) if cold_gemms else None
        self.scratch = torch.empty(0, dtype=torch.uint8, device=device)
        self.offset = self.end = 0
        self.copies: PinnedCopies | None = None

    def _mem(self, nbytes: int, reuse_bytes: int = 0) -> None:
        """Read ``nbytes / 2`` and write as many: the reused bytes on the ring's most
        recently touched ones, the rest at the next place in the ring (``ring_step``)."""
        half = max(1, nbytes // 2)
        if self.scratch.numel() < max(2 * half, self.ring_bytes):
            self.scratch = torch.zeros(max(2 * half, self.ring_bytes), dtype=torch.uint8, device=self.device)
        self.offset, self.end = ring_step(self.scratch, self.offset, self.end, nbytes, reuse_bytes)

    def execute(self, op: O.Compute | O.Copy, buffers: dict[str, torch.Tensor] | None = None) -> None:
        """The kernel standing in for a compute or copy op (``buffers``: unused here;
        the operands are this object's own)."""
        if isinstance(op, O.Compute):
            self.run(op)
        else:
            self.copy(op)

    def run(self, op: O.Compute) -> None:
        g = op.gemm
        if g is not None and op.kind in (O.ComputeKind.GEMM, O.ComputeKind.ATTENTION):
            key = (g.batch, g.m, g.k, g.n)
            if self.cold is not None:
                for _ in range(gemm_repeats(op)):
                    a, b, c = self.cold.next(key)
                    torch.bmm(a, b, out=c)
                return
            if key not in self.operands:
                a = torch.randn(g.batch, g.m, g.k, dtype=self.dtype, device=self.device)
                b = torch.randn(g.batch, g.k, g.n, dtype=self.dtype, device=self.device)
                c = torch.zeros(g.batch, g.m, g.n, dtype=self.dtype, device=self.device)
                self.operands[key] = (a, b, c)
            a, b, c = self.operands[key]
            # Into a kept output: the schedule's allocs and frees stand for the memory of
            # activations and gradients, so a fresh output per kernel would allocate twice
            # (on CPUs its page faults are a cost no framework's step pays).
            for _ in range(gemm_repeats(op)):
                torch.bmm(a, b, out=c)
        else:
            self._mem(op.bytes_read + op.bytes_written, op.reuse_bytes)

    def copy(self, op: O.Copy) -> None:
        if op.direction is O.CopyDirection.D2D or self.device.type == "cpu":
            # on a host platform, host and "device" memory are one: a copy is the
            # memory-bound kernel over its bytes read and written
            self._mem(2 * op.size_bytes)
            return
        if self.copies is None or self.copies.capacity < op.size_bytes:
            self.copies = PinnedCopies(self.device, op.size_bytes)
        self.copies.run(op.direction, op.size_bytes)


# ColdOperands keeps at most this many operand sets of one shape: the smallest shapes'
# sets then span a few MiB (colder than the core's own caches, not the last level's).
MAX_COLD_SETS = 4096


class ColdOperands:
    """GEMM operands that come from memory at every call: the inputs at the next place of
    a ring of random values and the output at the next place of a ring of its own, both
    larger than the last-level cache, so no call finds what an earlier one touched.
    calibrate times GEMMs this way because a step's GEMMs read cold operands: on this
    project's 2-core VM a 512^3 fp32 GEMM takes 8-10% longer and a batched attention
    matmul (32 x 128 x 64 x 128) 40-60% longer than with the same operands back to back
    (traces/README.md, "GEMMs with cold operands"). The views of each shape are built
    once, so a call costs what the matmul costs."""

    def __init__(self, device: torch.device, dtype: torch.dtype, ring_bytes: int):
        self.device, self.dtype, self.ring_bytes = device, dtype, ring_bytes
        self.inputs = torch.empty(0, dtype=dtype, device=device)
        self.outputs = torch.empty(0, dtype=dtype, device=device)
        self.sets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.turn: dict[tuple, int] = {}

    def _rings(self, in_elems: int, out_elems: int) -> None:
        item = self.inputs.element_size()
        need_in = max(self.ring_bytes // item, in_elems)
        if self.inputs.numel() < need_in:
            self.sets.clear()  # the views were of the old rings
            self.inputs = torch.randn(need_in, device=self.device).to(self.dtype)
        need_out = max(self.ring_bytes // item, out_elems)
        if self.outputs.numel() < need_out:
            self.sets.clear()
            self.outputs = torch.zeros(need_out, dtype=self.dtype, device=self.device)

    def next(self, key: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(a, b, out) of the shape ``key`` = (batch, m, k, n) for the next call."""
        views = self.sets.get(key)
        if views is None:
            batch, m, k, n = key
            na, nb, nc = (_aligned(batch * x * y, 16) for x, y in ((m, k), (k, n), (m, n)))
            self._rings(na + nb, nc)
            count = min(MAX_COLD_SETS, max(2, self.inputs.numel() // (na + nb), self.outputs.numel() // nc))
            views = []
            for i in range(count):
                at = i * (na + nb) % max(1, self.inputs.numel() - na - nb + 1)
                out_at = i * nc % max(1, self.outputs.numel() - nc + 1)
                views.append((self.inputs[at:at + batch * m * k].view(batch, m, k),
                              self.inputs[at + na:at + na + batch * k * n].view(batch, k, n),
                              self.outputs[out_at:out_at + batch * m * n].view(batch, m, n)))
            self.sets[key] = views
            self.turn[key] = 0
        i = self.turn[key]
        self.turn[key] = (i + 1) % len(views)
        return views[i]

    def clear(self) -> None:
        """Drop the rings (device memory between shapes of very different sizes)."""
        self.sets.clear()
        self.inputs = self.inputs.new_empty(0)
        self.outputs = self.outputs.new_empty(0)


def gemm_repeats(op: O.Compute) -> int:
    """How many matmuls of its shape an op's flops ask for (attention: both of its
    matmuls), at most 4."""
    g = op.gemm
    assert g is not None
    reps = max(1, round(op.flops / g.flops)) if g.flops else 1
    return min(reps, 4)


def _aligned(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def ring_step(ring: torch.Tensor, offset: int, end: int, nbytes: int, reuse_bytes: int = 0) -> tuple[int, int]:
    """The memory-bound kernel over ``nbytes`` (each part: read half, write half) on a
    ring whose next free place is ``offset`` and whose most recently touched byte ends
    at ``end``: the ``reuse_bytes`` of them on the bytes just before ``end`` (what the
    ops before touched, so in the cache where it fits), the rest at ``offset``, a fresh
    page-aligned region (back at the start when it does not fit). Returns the new
    (offset, end)."""
    reuse = min(max(reuse_bytes, 0), nbytes)
    if reuse:
        half = max(1, reuse // 2)
        at = max(0, end - 2 * half)
        ring[at + half:at + 2 * half].copy_(ring[at:at + half])
        if reuse == nbytes:
            return offset, end
    half = max(1, (nbytes - reuse) // 2)
    if offset + 2 * half > ring.numel():
        offset = 0
    ring[offset + half:offset + 2 * half].copy_(ring[offset:offset + half])
    return offset + _aligned(2 * half, 4096), offset + 2 * half  # page-aligned regions


class PinnedCopies:
    """Host<->device copies as a framework's offload makes them: between a pinned host
    buffer and device memory, ``non_blocking``, so each runs on a copy engine at PCIe
    rate without the host waiting (a pageable host tensor makes the copy synchronous and
    staged through a bounce buffer). H2D reads the host and writes the device; D2H the
    reverse. On a CPU device (tests) the same calls are plain memory copies."""

    def __init__(self, device: torch.device, capacity: int):
        self.device, self.capacity = device, max(1, capacity)
        pin = device.type == "cuda"
        self.host = torch.zeros(self.capacity, dtype=torch.uint8, device="cpu", pin_memory=pin)
        self.dev = torch.zeros(self.capacity, dtype=torch.uint8, device=device)

    def run(self, direction: O.CopyDirection, nbytes: int) -> None:
        assert 0 < nbytes <= self.capacity, (nbytes, self.capacity)
        if direction is O.CopyDirection.H2D:
            self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        elif direction is O.CopyDirection.D2H:
            self.host[:nbytes].copy_(self.dev[:nbytes], non_blocking=True)
        else:
            raise ValueError(f"{direction}: PinnedCopies moves between host and device only")


# Scratch regions start at multiples of this: any dtype's view of them is aligned, and
# so are the vectorised loads of the kernels that read them.
_SCRATCH_ALIGN = 256


@dataclass(frozen=True)
class OperandPlan:
    """Where a GEMM op's operands come from: ``a`` and ``b`` from one of the op's own
    buffers (its name) or the stream's scratch (None, at ``a_at`` / ``b_at``); the output
    ``c`` always from the scratch at ``c_at``. ``scratch_bytes``: how much of the
    stream's scratch the op needs."""

    a: str | None
    b: str | None
    a_at: int
    b_at: int
    c_at: int
    scratch_bytes: int


def plan_operands(op: O.Compute, buffer_sizes: dict[str, int], itemsize: int) -> OperandPlan:
    """The operands of ``op``'s matmul. Its inputs are read from the op's own buffers
    where one is large enough (its gathered weight, an activation): the memory the
    schedule allocates for them, so no tensor beyond the schedule's holds them. The
    weight operand (``b``) is placed first, as the larger of the two in a layer's
    GEMMs; a buffer serves one operand. The output is written to the stream's scratch,
    never to a buffer: a collective on another stream may be reading or writing the
    op's buffers while it runs (a gradient bucket, a prefetched weight), and a kernel's
    output must not change what the collective sends or checks."""
    g = op.gemm
    assert g is not None
    a_bytes = g.batch * g.m * g.k * itemsize
    b_bytes = g.batch * g.k * g.n * itemsize
    c_bytes = g.batch * g.m * g.n * itemsize
    free = [n for n in op.buffers if n in buffer_sizes]
    chosen: dict[str, str | None] = {}
    for which, need in (("b", b_bytes), ("a", a_bytes)):
        pick = next((n for n in free if buffer_sizes[n] >= need), None)
        chosen[which] = pick
        if pick is not None:
            free.remove(pick)
    at = 0
    offsets = {}
    for which, need in (("a", a_bytes), ("b", b_bytes)):
        if chosen[which] is None:
            offsets[which] = at
            at += _aligned(need, _SCRATCH_ALIGN)
        else:
            offsets[which] = 0
    c_at = at
    at += _aligned(c_bytes, _SCRATCH_ALIGN)
    return OperandPlan(chosen["a"], chosen["b"], offsets["a"], offsets["b"], c_at, at)


def ring_need(op: O.Op) -> int:
    """The bytes of a stream's ring a memory-bound kernel or copy of ``op`` touches."""
    if isinstance(op, O.Compute):
        if op.gemm is not None and op.kind in (O.ComputeKind.GEMM, O.ComputeKind.ATTENTION):
            return 0
        return 2 * max(1, (op.bytes_read + op.bytes_written) // 2)
    if isinstance(op, O.Copy):
        return 2 * op.size_bytes if op.direction is O.CopyDirection.D2D else 0
    return 0


class StreamMemory:
    """One stream's own memory: the memory-bound kernels' ring, the GEMM scratch and the
    pinned copy buffers, each sized for the largest op of the stream."""

    def __init__(self, device: torch.device, ring_bytes: int, scratch_bytes: int, copy_bytes: int):
        self.ring = torch.zeros(ring_bytes, dtype=torch.uint8, device=device)
        self.scratch = torch.zeros(max(scratch_bytes, 1), dtype=torch.uint8, device=device)
        self.copies = PinnedCopies(device, copy_bytes) if copy_bytes else None
        self.offset = self.end = 0

    @property
    def nbytes(self) -> int:
        """Device bytes this stream holds (pinned host memory is not the device's)."""
        return self.ring.numel() + self.scratch.numel() + (self.copies.dev.numel() if self.copies else 0)

    def mem(self, nbytes: int, reuse_bytes: int = 0) -> None:
        """Read ``nbytes / 2`` and write as many on this stream's ring (``ring_step``)."""
        assert 2 * max(1, nbytes // 2) <= self.ring.numel(), "the ring was sized for the stream's largest op"
        self.offset, self.end = ring_step(self.ring, self.offset, self.end, nbytes, reuse_bytes)


class StreamKernels:
    """The kernels of a rank whose streams run at once (GPU ranks): every stream's
    memory (``StreamMemory``) and every GEMM's operand plan are made once, from the
    rank's program, before the first step (``allocate``, on each stream), so nothing is
    allocated or reallocated while a kernel may still use it."""

    def __init__(self, device: torch.device, dtype: torch.dtype, program: Any):
        self.device, self.dtype = device, dtype
        self.itemsize = dtype.itemsize
        self.ring_floor = max(MIN_RING_BYTES, 2 * last_level_cache_bytes(device))
        # a buffer name may be allocated more than once: it holds an operand only if
        # every allocation under that name is large enough
        sizes: dict[str, int] = {}
        for op in program.all_ops():
            if isinstance(op, O.Alloc):
                sizes[op.buffer] = min(sizes.get(op.buffer, op.size_bytes), op.size_bytes)
        self.plans: dict[O.OpId, OperandPlan] = {}
        self.need: dict[str, list[int]] = {}  # stream -> [ring, scratch, copy] bytes
        for op in program.step:
            if not isinstance(op, (O.Compute, O.Copy)):
                continue
            need = self.need.setdefault(op.stream, [0, 0, 0])
            need[0] = max(need[0], ring_need(op))
            if isinstance(op, O.Compute) and op.gemm is not None and op.kind in (O.ComputeKind.GEMM,
                                                                                  O.ComputeKind.ATTENTION):
                plan = self.plans[op.id] = plan_operands(op, sizes, self.itemsize)
                need[1] = max(need[1], plan.scratch_bytes)
            if isinstance(op, O.Copy) and op.direction is not O.CopyDirection.D2D:
                need[2] = max(need[2], op.size_bytes)
        self.memory: dict[str, StreamMemory] = {}

    def allocate(self, stream: str) -> StreamMemory:
        """This stream's memory (call with the stream current, so the caching allocator
        files it under the stream that uses it)."""
        ring, scratch, copy = self.need.get(stream, [0, 0, 0])
        mem = StreamMemory(self.device, max(ring, self.ring_floor) if ring else 0, scratch, copy)
        self.memory[stream] = mem
        return mem

    @property
    def nbytes(self) -> int:
        """Device bytes of every stream's memory: the executor's own, beyond the schedule's."""
        return sum(m.nbytes for m in self.memory.values())

    def execute(self, op: O.Compute | O.Copy, buffers: dict[str, torch.Tensor]) -> None:
        mem = self.memory[op.stream]
        if isinstance(op, O.Copy):
            if op.direction is O.CopyDirection.D2D:
                mem.mem(2 * op.size_bytes)
            else:
                assert mem.copies is not None
                mem.copies.run(op.direction, op.size_bytes)
            return
        plan = self.plans.get(op.id)
        if plan is None:
            mem.mem(op.bytes_read + op.bytes_written, op.reuse_bytes)
            return
        g = op.gemm
        assert g is not None
        a = self._view(buffers, plan.a, mem.scratch, plan.a_at, (g.batch, g.m, g.k))
        b = self._view(buffers, plan.b, mem.scratch, plan.b_at, (g.batch, g.k, g.n))
        c = self._view(buffers, None, mem.scratch, plan.c_at, (g.batch, g.m, g.n))
        for _ in range(gemm_repeats(op)):
            torch.bmm(a, b, out=c)

    def _view(self, buffers: dict[str, torch.Tensor], name: str | None, scratch: torch.Tensor, at: int,
              shape: tuple[int, int, int]) -> torch.Tensor:
        nbytes = shape[0] * shape[1] * shape[2] * self.itemsize
        src = scratch[at:at + nbytes] if name is None else buffers[name][:nbytes]
        return src.view(self.dtype).view(shape)
