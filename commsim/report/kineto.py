"""commsim traces in the PyTorch profiler's (Kineto's) JSON layout, one file per rank,
for Holistic Trace Analysis (HTA), Perfetto and TensorBoard's PyTorch profiler plugin.

Each rank's file, ``rank<N>.pt.trace.json``, is what ``torch.profiler`` writes for one
rank of a CUDA job: a header (``schemaVersion``, ``deviceProperties``,
``distributedInfo`` with the rank, world size and process groups, and a ``commsim``
block saying what produced the trace), then ``traceEvents``, times in microseconds with
nanosecond decimals:

* the host thread (pid ``1000000 + rank``, tid the same): a kernel launch (``host_launch``
  op) is a ``cuda_runtime`` event, ``cudaLaunchKernel`` (``cudaMemcpyAsync`` before a
  copy); a host sync is ``cudaEventSynchronize`` / ``cudaStreamSynchronize`` /
  ``cudaDeviceSynchronize``; every other host op (hooks, Python work, allocations) is a
  ``cpu_op`` named by its label. Each step is a ``user_annotation`` ``ProfilerStep#<step>``.
* the device (pid = the rank, one device per rank): each commsim stream is a GPU stream,
  tid = its stream id (``compute`` 7, the others 8, 9, ... in name order, so the same
  streams get the same ids in every file of a schedule). Compute ops are ``kernel``
  events named by their label; collectives are ``kernel`` events with NCCL's kernel names
  (``ncclDevKernel_AllGather(...)``; commsim does not record NCCL's algorithm or protocol,
  so the names carry none) and the collective fields recent torch writes on them
  ("Collective name" as c10d names the tensor APIs, e.g. ``_allgather_base``, "dtype" as
  torch names it, "In msg nelems", "Out msg nelems", "Group size", "Process Group Name",
  "Process Group Description", "Process Group Ranks", "Rank"); copies are ``gpu_memcpy``
  events (``Memcpy DtoD (Device -> Device)``, ...). Every device event carries "device" and
  "stream"; commsim's own fields (op id, kind, phase, bytes, flops) ride along in args.
* a device op whose launch commsim knows (the ``host_launch`` op just before it in the
  rank's program, as the schedule generators emit them) shares a "correlation" id and an
  "External id" with that launch, joined by an ``ac2g`` flow arrow as Kineto draws it; a
  device op without one has neither.

Measured steps, each timed from its own start, are laid end to end: step ``s`` begins
where step ``s - 1``'s window (its first op's start to its last op's end, over every rank)
ends, on every rank alike. A symmetric prediction simulates one rank for identical
ranks: each other rank's file holds rank 0's timeline. An executed gloo run (``commsim
execute`` on CPUs) has no GPU: it is written in the same layout, the executor's streams
as the "GPU" streams and its collectives under NCCL's kernel names, so that HTA reads it
like a GPU run's and classes its collectives as communication.

What HTA computes from these files, in commsim's terms: ``commsim.report.hta_view``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from commsim.ir.errors import CommsimInputError
from commsim.ir.ops import DType
from commsim.ir.trace import HOST_STREAM, Trace, TraceRecord, TraceSource

SCHEMA_VERSION = 1  # Kineto's "schemaVersion"
FIRST_STREAM_ID = 7  # where Kineto's CUDA stream ids usually start (the default stream)
HOST_PID_BASE = 1_000_000  # host pids: distinct from the device pids (ranks)
# The first correlation id. HTA 0.5.0 writes event indices into a column of the
# correlation ids' type, which pandas narrows to the smallest integer type that holds the
# ids: ids from 2^16 keep it 32-bit, so a file of more than 32767 events still loads (CUPTI's
# own ids are that large in any process that ran a while).
FIRST_CORRELATION = 1 << 16

# commsim collective kind -> (NCCL's kernel function, c10d's collective name)
NCCL_NAMES = {
    "all_gather": ("AllGather", "_allgather_base"),
    "reduce_scatter": ("ReduceScatter", "_reduce_scatter_base"),
    "all_reduce": ("AllReduce", "allreduce"),
    "broadcast": ("Broadcast", "broadcast"),
    "reduce": ("Reduce", "reduce"),
    "all_to_all": ("SendRecv", "all_to_all"),
    "send": ("SendRecv", "send"),
    "recv": ("SendRecv", "recv"),
    "barrier": ("AllReduce", "barrier"),
}
_MEMCPY = {"d2d": "Memcpy DtoD (Device -> Device)", "d2h": "Memcpy DtoH (Device -> Pinned)",
           "h2d": "Memcpy HtoD (Pinned -> Device)"}
_SYNC = {"sync_ops": "cudaEventSynchronize", "sync_stream": "cudaStreamSynchronize",
         "sync_device": "cudaDeviceSynchronize"}
_TORCH_DTYPE = {"fp32": "Float", "fp16": "Half", "bf16": "BFloat16", "fp64": "Double", "int64": "Long",
                "int32": "Int", "uint8": "Byte"}


def file_name(rank: int) -> str:
    """A rank's file: HTA reads any ``*.json`` (the rank from ``distributedInfo``),
    TensorBoard's plugin ``<worker>.pt.trace.json``."""
    return f"rank{rank}.pt.trace.json"


def op_class(kind: str) -> str:
    """How HTA will class a device op's event: ``communication``, ``memory`` or ``computation``."""
    if kind in NCCL_NAMES:
        return "communication"
    return "memory" if kind.startswith("copy_") else "computation"


def stream_ids(trace: Trace) -> dict[str, int]:
    """Each device stream's id: ``compute`` first, then the others by name."""
    names = sorted({r.stream for r in trace.records if r.stream != HOST_STREAM}, key=lambda s: (s != "compute", s))
    return {s: FIRST_STREAM_ID + i for i, s in enumerate(names)}


def _is_symmetric(trace: Trace) -> bool:
    return trace.meta.source is TraceSource.PREDICTED and trace.meta.get("mode") == "symmetric"


def world_size_of(trace: Trace, world_size: int | None = None) -> int:
    """``world_size`` if given, else the trace's (meta ``world_size``), else one more than
    the largest rank its records or collective groups name."""
    if world_size:
        return world_size
    if trace.meta.get("world_size"):
        return int(trace.meta.get("world_size"))
    named = [r.rank for r in trace.records]
    named += [int(x) for r in trace.records if r.group for x in r.group.split(",")]
    return max(named, default=0) + 1


def ranks_written(trace: Trace, world_size: int | None = None) -> list[int]:
    """The ranks that get a file: every rank of a symmetric prediction, else those in the trace."""
    if _is_symmetric(trace):
        return list(range(world_size_of(trace, world_size)))
    return sorted({r.rank for r in trace.records})


def rank_records(trace: Trace, rank: int) -> list[TraceRecord]:
    """``rank``'s records (a symmetric prediction's rank 0's for every rank), by step and start."""
    own = [r for r in trace.records if r.rank == rank]
    if not own and _is_symmetric(trace):
        own = [r for r in trace.records if r.rank == 0]
    return sorted(own, key=lambda r: (r.step, r.start_ns, r.op_id))


def step_origins(trace: Trace) -> dict[int, tuple[int, int, int]]:
    """step -> (its window's first ns in the step's own clock, its window's length, where
    it begins on the laid-out timeline), steps end to end from 0."""
    windows: dict[int, tuple[int, int]] = {}
    for r in trace.records:
        lo, hi = windows.get(r.step, (r.start_ns, r.end_ns))
        windows[r.step] = (min(lo, r.start_ns), max(hi, r.end_ns))
    out, at = {}, 0
    for step in sorted(windows):
        lo, hi = windows[step]
        out[step] = (lo, hi - lo, at)
        at += hi - lo
    return out


def _launches(records: list[TraceRecord]) -> dict[tuple[int, int], TraceRecord]:
    """(step, device op id) -> the launch just before it in the program."""
    launches = {(r.step, r.op_id): r for r in records if r.stream == HOST_STREAM and r.kind == "host_launch"}
    return {(r.step, r.op_id): launches[(r.step, r.op_id - 1)] for r in records
            if r.stream != HOST_STREAM and (r.step, r.op_id - 1) in launches}


# HTA classes a kernel by its name: communication if it starts "nccl...Kernel", memory if
# it starts Memcpy / Memset / dma, and never computation if "Memcpy" or "Sync" appear
# anywhere in it; a compute op's label that would say so is reworded.
def _compute_name(r: TraceRecord) -> str:
    name = r.label or r.kind
    if name.startswith(("nccl", "Memset", "dma")) or "Memcpy" in name or "Sync" in name:
        name = f"{r.kind}: " + name.replace("Memcpy", "memcpy").replace("Sync", "sync")
    return name


def _nccl_kernel(r: TraceRecord) -> str:
    return f"ncclDevKernel_{NCCL_NAMES[r.kind][0]}(ncclDevComm*, unsigned long, ncclWork*)"


def process_groups(trace: Trace) -> dict[str, str]:
    """Each collective group's ("0,1,2,3") process group name: "0", "1", ... largest first."""
    groups = {r.group for r in trace.records if r.group}
    order = sorted(groups, key=lambda g: (-len(g.split(",")), [int(x) for x in g.split(",")]))
    return {g: str(i) for i, g in enumerate(order)}


def _collective_args(r: TraceRecord, rank: int, world: int, pgs: dict[str, str]) -> dict[str, Any]:
    args: dict[str, Any] = {"Collective name": NCCL_NAMES[r.kind][1]}
    ranks = [int(x) for x in r.group.split(",")] if r.group else []
    try:
        itemsize = DType(r.dtype).itemsize_bytes
    except ValueError:  # an element type commsim does not know ("" where the producer did not say)
        itemsize = 0
    if itemsize:
        args["dtype"] = _TORCH_DTYPE[r.dtype]
        total = r.size_bytes // itemsize  # nccl-tests' S: the all-gather's output, the reduce-scatter's input
        shard = total // len(ranks) if ranks else total
        args["In msg nelems"] = shard if r.kind == "all_gather" else total
        args["Out msg nelems"] = shard if r.kind == "reduce_scatter" else total
    if ranks:
        args.update({"In split size": "[]", "Out split size": "[]", "Group size": len(ranks),
                     "Process Group Name": pgs[r.group],
                     "Process Group Description": "default_pg" if len(ranks) == world else "undefined",
                     "Process Group Ranks": str(ranks)})
    args["Rank"] = rank
    return args


def _backend(trace: Trace) -> str:
    m = trace.meta
    said = f"{m.producer} {m.get('backend', '')}"
    return "gloo" if "gloo" in said else "nccl"


def kineto_document(trace: Trace, rank: int, world_size: int | None = None) -> dict[str, Any]:
    """One rank's Kineto JSON document (see the module docstring)."""
    world = world_size_of(trace, world_size)
    sids = stream_ids(trace)
    origins = step_origins(trace)
    pgs = process_groups(trace)
    records = rank_records(trace, rank)
    launches = _launches(records)  # (step, device op id) -> its launch
    by_key = {(r.step, r.op_id): r for r in records}
    target = {(launch.step, launch.op_id): by_key[k] for k, launch in launches.items()}  # launch -> its op
    host, device = HOST_PID_BASE + rank, rank
    # External ids: the steps' annotations, then the host ops in time order; correlation
    # ids: the launches whose op is known, in time order
    ext = {("step", s): i + 1 for i, s in enumerate(sorted(origins))}
    host_ops = [r for r in records if r.stream == HOST_STREAM]
    ext.update({(r.step, r.op_id): len(origins) + i + 1 for i, r in enumerate(host_ops)})
    corr = {(r.step, r.op_id): FIRST_CORRELATION + i
            for i, r in enumerate(r for r in host_ops if (r.step, r.op_id) in target)}

    def us(r: TraceRecord, ns: int) -> float:
        lo, _, at = origins[r.step]
        return (at + ns - lo) / 1000

    events: list[dict[str, Any]] = [
        _meta("process_name", host, 0, name=f"rank {rank} host"), _meta("process_labels", host, 0, labels="CPU"),
        _meta("process_sort_index", host, 0, sort_index=host),
        _meta("thread_name", host, host, name=f"thread {host} (host)"),
        _meta("process_name", device, 0, name=f"rank {rank} device"),
        _meta("process_labels", device, 0, labels=f"GPU {device}"),
        _meta("process_sort_index", device, 0, sort_index=device)]
    for s in sorted({r.stream for r in records if r.stream != HOST_STREAM}, key=sids.__getitem__):
        events.append(_meta("thread_name", device, sids[s], name=f"stream {sids[s]} {s}"))
        events.append(_meta("thread_sort_index", device, sids[s], sort_index=sids[s]))
    for step, (_, length, at) in sorted(origins.items()):
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": host, "tid": host,
                       "ts": at / 1000, "dur": length / 1000, "args": {"External id": ext[("step", step)]}})
    for r in records:
        key = (r.step, r.op_id)
        ts, dur = _span_us(us(r, r.start_ns), us(r, r.end_ns))
        ours = {"op id": r.op_id, "kind": r.kind, "phase": r.phase, "step": r.step}
        if r.stream == HOST_STREAM:
            args: dict[str, Any] = {"External id": ext[key]}
            if key in corr:
                args["correlation"] = corr[key]
                cat = "cuda_runtime"
                name = "cudaMemcpyAsync" if op_class(target[key].kind) == "memory" else "cudaLaunchKernel"
            elif r.kind in _SYNC:
                cat, name = "cuda_runtime", _SYNC[r.kind]
            elif r.kind == "host_launch":
                cat, name = "cuda_runtime", "cudaLaunchKernel"
            else:
                cat, name = "cpu_op", r.label or r.kind
            events.append({"ph": "X", "cat": cat, "name": name, "pid": host, "tid": host, "ts": ts, "dur": dur,
                           "args": {**args, **ours}})
            continue
        tid = sids[r.stream]
        args = {"device": device, "stream": tid}
        launch = launches.get(key)
        if launch is not None:
            lkey = (launch.step, launch.op_id)
            args.update({"correlation": corr[lkey], "External id": ext[lkey]})
            events.append({"ph": "s", "id": corr[lkey], "pid": host, "tid": host, "ts": us(launch, launch.start_ns),
                           "cat": "ac2g", "name": "ac2g"})
            events.append({"ph": "f", "id": corr[lkey], "pid": device, "tid": tid, "ts": ts, "cat": "ac2g",
                           "name": "ac2g", "bp": "e"})
        cls = op_class(r.kind)
        if cls == "communication":
            cat, name = "kernel", _nccl_kernel(r)
            args.update(_collective_args(r, rank, world, pgs))
        elif cls == "memory":
            cat, name = "gpu_memcpy", _MEMCPY.get(r.kind[len("copy_"):], _MEMCPY["d2d"])
            if r.end_ns > r.start_ns:
                args["memory bandwidth (GB/s)"] = r.size_bytes / (r.end_ns - r.start_ns)
        else:
            cat, name = "kernel", _compute_name(r)
        events.append({"ph": "X", "cat": cat, "name": name, "pid": device, "tid": tid, "ts": ts, "dur": dur,
                       "args": {**args, **ours, "bytes": r.size_bytes, "flops": r.flops}})
    m = trace.meta
    backend = _backend(trace)
    return {
        "schemaVersion": SCHEMA_VERSION,
        "deviceProperties": [{"id": device, "name": m.hardware}],
        "distributedInfo": {
            "backend": backend, "rank": rank, "world_size": world, "pg_count": len(pgs),
            "pg_config": [{"pg_name": name, "pg_desc": "default_pg" if len(g.split(",")) == world else "undefined",
                           "backend_config": f"cuda:{backend}", "pg_size": len(g.split(",")),
                           "ranks": [int(x) for x in g.split(",")]} for g, name in pgs.items()]},
        "commsim": {"source": m.source.value, "producer": m.producer, "schedule_hash": m.schedule_hash,
                    "hardware": m.hardware, "seed": m.seed, "mode": m.get("mode", "")},
        "displayTimeUnit": "ms",
        "traceName": file_name(rank),
        "traceEvents": events,
    }


def _span_us(ts: float, end: float) -> tuple[float, float]:
    """(ts, dur) such that ts + dur, as a reader computes the end, is not past ``end``:
    back-to-back ops must not overlap by a rounding error (trace viewers reject ranges on
    one thread that intersect)."""
    dur = end - ts
    while ts + dur > end:
        dur = math.nextafter(dur, 0.0)
    return ts, dur


def _meta(what: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": what, "pid": pid, "tid": tid, "ts": 0, "args": args}


def folder_problem(path: str | Path) -> str | None:
    """Why a Kineto folder could not be written at ``path`` (it must be new or empty, in
    a writable folder: it is renamed into place there), or None."""
    from commsim.util.files import output_folder_problem

    p = Path(path)
    if p.exists():
        if not p.is_dir():
            return "exists and is not a folder"
        if any(p.iterdir()):
            return "is a folder that is not empty; give a new or empty one"
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        return f"folder {parent} does not exist"
    return output_folder_problem(parent)


def write_kineto(trace: Trace, folder: str | Path, world_size: int | None = None) -> list[Path]:
    """Write ``folder/rank<N>.pt.trace.json`` for every rank, as one folder: into a
    temporary folder beside it, renamed into place (over an empty ``folder``) when all
    files are written. Returns the files."""
    folder = Path(folder)
    problem = folder_problem(folder)
    if problem:
        raise CommsimInputError(f"{folder}: {problem}")
    parent = folder.parent if str(folder.parent) else Path(".")
    tmp = parent / f".{folder.name}.{uuid.uuid4().hex}.tmp"
    os.mkdir(tmp)  # the mode a plain mkdir gives: 0777 less the umask
    try:
        for rank in ranks_written(trace, world_size):
            with open(tmp / file_name(rank), "w") as f:
                # json's default ", " / ": " separators: HTA finds the rank by '"rank": N'
                json.dump(kineto_document(trace, rank, world_size), f)
        os.rename(tmp, folder)  # replaces an empty folder; fails on one filled meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(folder.iterdir())
