"""The real kernels that stand in for a schedule's compute and copy ops.

A GEMM (or attention) op runs a batched matmul of its shape, as many times as its flops
ask (at most 4), into a kept output. Every other compute op and every copy is a
memory-bound kernel moving the op's bytes (half read, half written) at the next place of
a ring larger than the last-level cache, so its data comes from memory, as a step's
tensors do. Host work is a busy loop of its duration (``spin_ns``).

The executor runs these kernels for the schedule's ops and ``calibrate`` times the very
same ones, so that a profile prices what the executor will run. Sizes in bytes, times
in nanoseconds.
"""

from __future__ import annotations

import time
from pathlib import Path

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
    """Real kernels standing in for compute ops, with operands cached per shape."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.operands: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
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

    def execute(self, op: O.Compute | O.Copy) -> None:
        """The kernel standing in for a compute or copy op."""
        if isinstance(op, O.Compute):
            self.run(op)
        else:
            self.copy(op)

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
            # (on CPUs its page faults are a cost no framework's step pays).
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
