"""Recording every collective a real training run sends through torch.distributed.

``install()`` wraps the methods of ``torch.distributed.ProcessGroup`` (the point every
front end reaches: ``dist.all_reduce``, DeepSpeed's coalesced collectives, FSDP2), so
each call is logged with its kind, size in bytes (nccl-tests' convention: all-gather
output, reduce-scatter input), dtype (the trace's ``dtype`` column holds it as the
IR's name, ``bf16``; the label keeps torch's, ``bfloat16``), group (global ranks, the
``group`` column), issue order, issue and
completion time (monotonic ns from the process's start of recording, which the trace's
meta keeps as ``t0_monotonic_ns``: add it to put one node's ranks on one clock;
completion from the work's future), the training phase
(``bwd`` inside autograd's backward, ``fwd`` otherwise, ``step`` inside an optimizer
step) and the step index (counted by a global optimizer-step hook).

``runtime.record_launch.run_recorded(cmd, out_dir)`` (what ``commsim record -- CMD``
runs) puts a ``sitecustomize`` on the child's ``PYTHONPATH`` that calls
``install_from_env()``; each rank writes ``rank<N>.json`` (commsim's trace schema, source
"recorded") into ``COMMSIM_RECORD_DIR`` at exit.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from commsim.ir.trace import TraceMeta, TraceRecord, TraceSource, make_trace

# method -> (kind, which positional argument holds the tensors that define S)
_METHODS: dict[str, tuple[str, int]] = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
    "reduce": ("reduce", 0),
    "allgather": ("all_gather", 0),
    "_allgather_base": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "allgather_coalesced": ("all_gather", 0),
    "allgather_into_tensor_coalesced": ("all_gather", 0),
    "all_gather_single_coalesced": ("all_gather", 0),
    "reduce_scatter": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1),
    "alltoall": ("all_to_all", 0),
    "alltoall_base": ("all_to_all", 0),
    "all_to_all_single": ("all_to_all", 0),
    "barrier": ("barrier", -1),
    "send": ("send", 0),
    "recv": ("recv", 0),
}


# torch's dtype names -> the IR's (commsim.ir.ops.DType values), for the trace's dtype column
IR_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "int64",
             "int32": "int32", "uint8": "uint8"}


@dataclass
class Call:
    seq: int
    kind: str
    method: str
    size_bytes: int
    dtype: str
    group: tuple[int, ...]
    phase: str
    step: int
    start_ns: int
    end_ns: int = -1


class Recorder:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.lock = threading.Lock()
        self.step = 0
        self.in_optimizer = 0
        self.rank: int | None = None
        self.t0 = time.perf_counter_ns()

    def phase(self) -> str:
        if self.in_optimizer:
            return "optimizer"
        return "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"


_REC: Recorder | None = None


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _group_ranks(pg: Any) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(pg))
    except (ValueError, RuntimeError, KeyError):
        return tuple(range(pg.size()))


def _wrap(name: str, kind: str, arg: int, orig: Any) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _REC
        if rec is None:
            return orig(self, *args, **kwargs)
        ts = _tensors(args[arg]) if 0 <= arg < len(args) else []
        size = sum(t.numel() * t.element_size() for t in ts)
        dtype = str(ts[0].dtype).removeprefix("torch.") if ts else ""
        if rec.rank is None and dist.is_initialized():
            rec.rank = dist.get_rank()
        with rec.lock:
            call = Call(len(rec.calls), kind, name, size, dtype, _group_ranks(self), rec.phase(), rec.step,
                        time.perf_counter_ns())
            rec.calls.append(call)
        work = orig(self, *args, **kwargs)
        try:
            fut = work.get_future()
            fut.add_done_callback(lambda _f, c=call: setattr(c, "end_ns", time.perf_counter_ns()))
        except (AttributeError, RuntimeError):
            call.end_ns = time.perf_counter_ns()
        return work

    wrapper.__name__ = name
    wrapper._commsim_wrapped = True  # type: ignore[attr-defined]
    return wrapper


def install(out_dir: str | None = None) -> Recorder:
    """Start recording (idempotent); with ``out_dir``, write this rank's trace at exit."""
    global _REC
    if _REC is not None:
        return _REC
    _REC = Recorder()
    pg = dist.ProcessGroup
    for name, (kind, arg) in _METHODS.items():
        orig = getattr(pg, name, None)
        if orig is None or getattr(orig, "_commsim_wrapped", False):
            continue
        setattr(pg, name, _wrap(name, kind, arg, orig))
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def pre(_opt: Any, _args: Any, _kwargs: Any) -> None:
        assert _REC is not None
        _REC.in_optimizer += 1

    def post(_opt: Any, _args: Any, _kwargs: Any) -> None:
        assert _REC is not None
        _REC.in_optimizer -= 1
        if _REC.in_optimizer == 0:
            _REC.step += 1

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)
    if out_dir:
        atexit.register(write, out_dir)
    return _REC


def mark(label: str) -> None:
    """Insert a marker into the recorded sequence (debugging which module sent what)."""
    rec = _REC
    if rec is None:
        return
    with rec.lock:
        rec.calls.append(Call(len(rec.calls), "marker", label, 0, "", (), rec.phase(), rec.step,
                              time.perf_counter_ns(), time.perf_counter_ns()))


def install_from_env() -> None:
    out = os.environ.get("COMMSIM_RECORD_DIR")
    if out:
        install(out)


def recorder() -> Recorder | None:
    return _REC


def to_trace(rec: Recorder) -> Any:
    records = []
    for c in rec.calls:
        end = c.end_ns if c.end_ns >= 0 else c.start_ns
        label = f"{c.phase}:{c.method}:{c.dtype}:{','.join(map(str, c.group))}"
        records.append(TraceRecord(rec.rank or 0, "collectives", c.seq, c.kind, label, c.start_ns - rec.t0,
                                   end - rec.t0, c.size_bytes, 0, c.step, c.phase, IR_DTYPES.get(c.dtype, c.dtype),
                                   ",".join(map(str, c.group))))
    meta = TraceMeta(TraceSource.RECORDED, producer="commsim record", hardware=os.uname().nodename,
                     extra=(("pid", os.getpid()), ("backend", dist.get_backend() if dist.is_initialized() else ""),
                            # perf_counter is the system-wide monotonic clock on Linux
                            ("t0_monotonic_ns", rec.t0)))
    return make_trace(meta, records)


def write(out_dir: str) -> None:
    rec = _REC
    if rec is None or not rec.calls:
        return
    os.makedirs(out_dir, exist_ok=True)
    to_trace(rec).save(os.path.join(out_dir, f"rank{rec.rank or 0}.json"))
