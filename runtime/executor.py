"""The real executor: one rank of a commsim schedule through torch.distributed.

Every op of the rank's program runs for real:

* buffers are real tensors of their stated size, allocated and freed in program order
  (through PyTorch's caching allocator where the platform has one, with
  ``record_stream`` for buffers used on other streams than their allocation's, so its
  behaviour is measured and ``torch.cuda.memory_stats`` is kept, along with the device
  memory the executor holds beyond the schedule's buffers; else zeroed host memory, as
  malloc gives it);
* compute and copy ops are real kernels (``runtime.kernels``): a GEMM of the op's shape,
  a memory-bound kernel moving the op's bytes otherwise, a pinned non-blocking copy
  between host and device;
* collectives are real ``torch.distributed`` collectives of the op's kind, size, dtype
  and process group, issued asynchronously (``runtime.collectives``);
* host work spins the host for its duration; host syncs wait for their ops / streams.

How the rank runs its step is picked from its platform
(``commsim.hardware.platform``): where kernels are queued on device streams, CUDA
streams and events (``runtime.gpu_rank``); where they run inline on the host thread,
threads and tickets (``runtime.cpu_rank``). Either way collectives reach the backend in
program order, so every rank issues them in the same order.

With ``check_data`` the collectives carry known values and every result is checked:
an all-gather must hold the concatenation of every rank's shard, a reduce-scatter or
all-reduce the sum.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from commsim.hardware.platform import platform_of_backend
from commsim.ir import ops as O
from commsim.ir.schedule import Schedule
from commsim.ir.text import op_to_text
from commsim.ir.trace import TraceRecord
from runtime.collectives import Collectives
from runtime.cpu_rank import CpuRank
from runtime.gpu_rank import GpuRank
from runtime.rendezvous import LaunchEnv, launch_env
from runtime.kernels import Kernels, StreamKernels, default_precision, device_of
from runtime.step import DataMismatch, ExecutionError, RankStep, op_failure, rebased

__all__ = ["DataMismatch", "ExecutionError", "RankExecutor", "RankOptions", "RankRun", "env_rank"]


@dataclass
class RankOptions:
    steps: int = 3
    warmup: int = 1
    check_data: bool = False
    compute_dtype: torch.dtype | None = None  # default: the platform's precision (bf16 on GPU, fp32 on CPU)
    progress: Any = None  # a shared array: progress[rank] = id of the op being issued


@dataclass
class RankRun:
    records: list[TraceRecord] = field(default_factory=list)
    step_times_ns: list[int] = field(default_factory=list)
    # each measured step's start on the host's monotonic clock (perf_counter_ns, one clock
    # for a node's ranks): the records are counted from it, rank by rank
    step_starts_ns: list[int] = field(default_factory=list)
    memory_stats: dict[str, int] = field(default_factory=dict)
    own_device_bytes: int = 0  # the executor's own device memory (kernels' rings, scratch, partitions)


class RankExecutor:
    """One rank of a schedule: its buffers, kernels and collectives, and the step loop
    (warm-up steps, then measured ones, each after a barrier) that collects records."""

    def __init__(self, schedule: Schedule, rank: int, backend: str, options: RankOptions):
        self.schedule = schedule
        self.rank = rank
        self.world = schedule.world_size
        self.program = schedule.program_of(rank)
        self.opts = options
        self.platform = platform_of_backend(backend)
        self.device = device_of(self.platform)
        # kernels in the schedule's precision (what the real model would run in)
        precision = schedule.meta.precision or default_precision(self.platform)
        dtype = options.compute_dtype or {"fp32": torch.float32, "fp16": torch.float16}.get(precision, torch.bfloat16)
        # Streams that run at once (GPUs) each get memory of their own, sized before the
        # first step; kernels that run one at a time on the host thread share one ring.
        self.kernels: Any = (Kernels(self.device, dtype) if self.platform.inline_kernels
                             else StreamKernels(self.device, dtype, self.program))
        self.buffers: dict[str, torch.Tensor] = {}
        self.collectives = Collectives(schedule, rank, self.device, self.buffers, options.check_data)
        self.text = {op.id: op_to_text(op) for op in self.program.all_ops()}
        self.current: O.Op | None = None
        self.step = 0

    # ------------------------------------------------------------ helpers
    def note(self, op: O.Op) -> None:
        """The host is issuing ``op``: the launcher names a rank that dies or hangs by it."""
        self.current = op
        if self.opts.progress is not None:
            self.opts.progress[self.rank] = int(op.id)

    def fail(self, op: O.Op, err: BaseException) -> ExecutionError:
        return op_failure(self.rank, self.step, op, self.text.get(op.id, str(op)), err)

    def _alloc(self, op: O.Alloc) -> None:
        if self.platform.caching_allocator:
            self.buffers[op.buffer] = torch.empty(op.size_bytes, dtype=torch.uint8, device=self.device)
        elif op.touch_bytes is None:
            # Host memory comes fresh from the OS for large blocks (no caching allocator in
            # front of malloc): touch it now, so its page faults are paid by the allocation
            # rather than by whichever kernel or collective writes it first.
            self.buffers[op.buffer] = torch.zeros(op.size_bytes, dtype=torch.uint8, device=self.device)
        else:  # only part of it is ever written: touch that part, as the model prices it
            buf = torch.empty(op.size_bytes, dtype=torch.uint8, device=self.device)
            buf[:op.touch_bytes].zero_()
            self.buffers[op.buffer] = buf

    def collective(self, op: O.Collective) -> tuple[Any, Callable[[], None] | None]:
        """Issue one collective asynchronously; returns (work, check) where check()
        verifies the data once the work is done."""
        return self.collectives.issue(op)

    # ------------------------------------------------------------ run
    def run(self) -> RankRun:
        impl: RankStep = CpuRank(self) if self.platform.inline_kernels else GpuRank(self)
        impl.setup()
        out = RankRun()
        for step in range(self.opts.warmup + self.opts.steps):
            self.step = step
            measured = step >= self.opts.warmup
            dist.barrier()
            t0, recs = impl.run_step()
            if measured:
                s = step - self.opts.warmup
                out.records.extend(rebased(r, t0, s) for r in recs)
                out.step_times_ns.append(max((r.end_ns for r in recs), default=t0) - t0)
                out.step_starts_ns.append(t0)
        if self.device.type == "cuda":
            out.memory_stats = {k: int(v) for k, v in torch.cuda.memory_stats(self.device).items()
                                if isinstance(v, (int, float))}
            out.own_device_bytes = self.kernels.nbytes + self.collectives.own_bytes
        return out


def env_rank() -> LaunchEnv | None:
    """This rank's place in a job torchrun / srun started (``runtime.rendezvous``), else None."""
    return launch_env(os.environ)
