"""A torch.profiler trace of a real job (Kineto's Chrome trace JSON, one file per rank)
as a commsim trace of source RECORDED: the job's own ops, not a replay of a schedule
(commsim execute's MEASURED traces number their ops as the schedule does; a real job's
ops have no such numbers, so nothing here can be matched to a schedule op by its id).

What is read, per rank (``distributedInfo.rank``), CPU activities only (GPU kernel
events are not read):

* steps: each ``ProfilerStep#N`` annotation (what ``prof.step()`` writes) is step N, and
  a ``host`` record of kind ``step`` spans it, so a step's time is the annotation's;
  events outside every step are left out (a trace without the annotations is one step,
  0, spanning its events);
* per op: every outermost ``aten::`` op (one not inside another op) of the threads that
  run the job's Python and autograd, a ``compute`` record whose kind is the op's kernel
  class (``gemm`` for mm / addmm / bmm / matmul / linear, ``norm``, ``softmax``, ...;
  every op inside an ``Optimizer.step#...`` or ``Optimizer.zero_grad#...`` annotation is
  ``optimizer``);
* collectives: each outermost ``c10d::`` op (the call, in issue order; its kind and
  bytes from the op and its tensors' shapes and types, commsim's convention: an
  all-gather's output, a reduce-scatter's input) becomes a ``host_launch`` record of the
  call and a collective record on stream ``comm``. gloo runs a collective on its own
  worker threads, where torch 2.13 annotates it as ``gloo:<kind>`` with its input
  shapes and types: the collective record spans that annotation (the first one after
  the call with the call's shapes), and takes its dtype from it where the call's own
  types say only ``TensorList``. gloo in torch 2.13 writes no ``record_param_comms``
  events; where one sits inside a call (NCCL backends), its group ranks and dtype are
  used. Otherwise the group is the ranks of ``distributedInfo.pg_config``'s process
  groups that hold this rank and, where the call shows it (an all-gather's output over
  its input), have the call's size; when those groups differ, the group is unknown
  (``""``). gloo carries out a reduce-scatter as an all-reduce on its workers, but
  the call says reduce-scatter, and so does the record.

Phases: an op inside ``Optimizer.*`` annotations is ``optimizer``; one inside an
``autograd::engine::evaluate_function: ...`` span (the autograd engine running a
backward node, on whichever thread) is ``bwd``; after a step's first backward node,
ops outside those spans (the engine's final callbacks, e.g. FSDP's last reduce-scatter)
stay ``bwd`` until an op that records autograd history again (the source of a
``fwdbwd`` flow: the next forward) or the optimizer; all else is ``fwd``.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from commsim.ir.errors import CommsimInputError
from commsim.ir.trace import HOST_STREAM, Trace, TraceMeta, TraceRecord, TraceSource, make_trace

COMM_STREAM = "comm"
_BACKEND_SPAN = re.compile(r"^(gloo|nccl|ucc|mpi|xccl):(\w+)$")

# Kineto's "Input type" names -> (the IR's dtype name, bytes per element)
DTYPES = {"float": ("fp32", 4), "double": ("fp64", 8), "c10::BFloat16": ("bf16", 2), "c10::Half": ("fp16", 2),
          "long int": ("int64", 8), "int": ("int32", 4), "unsigned char": ("uint8", 1), "signed char": ("int8", 1),
          "bool": ("bool", 1), "short int": ("int16", 2)}

# c10d op -> (kind, argument whose tensors define the bytes, times the group size?)
C10D_OPS: dict[str, tuple[str, int, bool]] = {
    "allreduce_": ("all_reduce", 0, False), "allreduce_coalesced_": ("all_reduce", 0, False),
    "broadcast_": ("broadcast", 0, False), "reduce_": ("reduce", 0, False),
    "_allgather_base_": ("all_gather", 0, False), "allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "allgather_": ("all_gather", 1, True), "allgather_coalesced_": ("all_gather", 1, True),
    "_reduce_scatter_base_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False), "reduce_scatter_": ("reduce_scatter", 0, True),
    "alltoall_base_": ("all_to_all", 1, False), "alltoall_": ("all_to_all", 1, False),
    "send": ("send", 0, False), "recv_": ("recv", 0, False), "recv_any_source_": ("recv", 0, False),
    "barrier": ("barrier", -1, False), "monitored_barrier_": ("barrier", -1, False),
}

_KERNEL_CLASSES = (  # first match wins; names without the "aten::" prefix
    ("attention", re.compile(r"scaled_dot_product|flash_attention|efficient_attention")),
    ("gemm", re.compile(r"^(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_addmm_activation)(_backward)?$")),
    ("norm", re.compile(r"layer_norm|rms_norm|group_norm|batch_norm")),
    ("softmax", re.compile(r"softmax")),
    ("dropout", re.compile(r"dropout")),
    ("embedding", re.compile(r"embedding")),
    ("reduction", re.compile(r"^(sum|mean|norm|linalg_vector_norm|amax|max|min|nll_loss|cross_entropy_loss)")),
)


def kernel_class(aten_name: str) -> str:
    """The compute kind (commsim.ir.ops.ComputeKind value) of an aten op."""
    name = aten_name.removeprefix("aten::")
    for kind, pat in _KERNEL_CLASSES:
        if pat.search(name):
            return kind
    return "elementwise"


@dataclass
class _Ev:
    tid: Any
    name: str
    start_ns: int
    end_ns: int
    args: dict[str, Any]
    in_optimizer: bool = False
    in_backward: bool = False
    under_op: bool = False  # inside an aten:: or c10d:: op
    children: list["_Ev"] = field(default_factory=list)


def _events(doc: dict[str, Any]) -> tuple[list[_Ev], dict[Any, list[int]]]:
    """Complete events with their nesting flags, and each thread's fwdbwd flow starts."""
    threads: dict[Any, list[_Ev]] = {}
    flows: dict[Any, list[int]] = {}
    for e in doc["traceEvents"]:
        if not isinstance(e, dict):
            continue
        ph, ts = e.get("ph"), e.get("ts")
        if not isinstance(ts, (int, float)):
            continue
        tid = (e.get("pid"), e.get("tid"))
        if ph == "s" and e.get("cat") == "fwdbwd":
            flows.setdefault(tid, []).append(round(ts * 1000))
        dur = e.get("dur")
        if ph == "X" and isinstance(dur, (int, float)) and isinstance(e.get("name"), str):
            start = round(ts * 1000)
            threads.setdefault(tid, []).append(_Ev(tid, e["name"], start, start + round(dur * 1000),
                                                   e.get("args") if isinstance(e.get("args"), dict) else {}))
    out: list[_Ev] = []
    for evs in threads.values():
        evs.sort(key=lambda x: (x.start_ns, -x.end_ns))
        stack: list[_Ev] = []
        for ev in evs:
            # pop what ends before it does: what ended before it began, or what it only
            # overlaps (not nested, so not a parent)
            while stack and stack[-1].end_ns < ev.end_ns:
                stack.pop()
            if stack:
                parent = stack[-1]
                parent.children.append(ev)
                ev.in_optimizer = parent.in_optimizer or parent.name.startswith("Optimizer.")
                ev.in_backward = parent.in_backward or parent.name.startswith("autograd::engine::evaluate_function")
                ev.under_op = parent.under_op or parent.name.startswith(("aten::", "c10d::"))
            stack.append(ev)
        out.extend(evs)
    for ts_list in flows.values():
        ts_list.sort()
    return out, flows


def _tensors(dims: Any, typ: Any) -> list[tuple[int, str]]:
    """(elements, Kineto type) of each tensor of one op argument."""
    if typ == "TensorList" and isinstance(dims, list):
        return [(math.prod(d), "") for d in dims if isinstance(d, list) and all(isinstance(x, int) for x in d)]
    if typ in DTYPES and isinstance(dims, list) and all(isinstance(x, int) for x in dims):
        return [(math.prod(dims), typ)]
    return []


def _shapes(args: dict[str, Any]) -> set[tuple[int, ...]]:
    """Every tensor shape an event's arguments hold, lists flattened."""
    out: set[tuple[int, ...]] = set()
    for d in args.get("Input Dims") or []:
        if isinstance(d, list) and d and all(isinstance(x, list) for x in d):
            out.update(tuple(x) for x in d if all(isinstance(y, int) for y in x))
        elif isinstance(d, list) and all(isinstance(x, int) for x in d):
            out.add(tuple(d))
    return out


@dataclass(frozen=True)
class _Groups:
    """The process groups ``distributedInfo.pg_config`` lists: (size, ranks) each."""

    groups: tuple[tuple[int, tuple[int, ...]], ...]

    def of(self, rank: int, size: int | None) -> str:
        sets = {ranks for n, ranks in self.groups if rank in ranks and (size is None or n == size)}
        return ",".join(map(str, next(iter(sets)))) if len(sets) == 1 else ""


def _groups(info: dict[str, Any]) -> _Groups:
    out = []
    for pg in info.get("pg_config") or []:
        if isinstance(pg, dict) and isinstance(pg.get("ranks"), list):
            ranks = tuple(int(r) for r in pg["ranks"])
            out.append((int(pg.get("pg_size") or len(ranks)), ranks))
    return _Groups(tuple(out))


@dataclass
class _Collective:
    call: _Ev
    kind: str
    size_bytes: int
    dtype: str
    group: str
    span: _Ev | None  # the backend's execution of it, on a worker thread


def _collective(ev: _Ev, rank: int, groups: _Groups) -> _Collective:
    op = ev.name.removeprefix("c10d::")
    kind, arg, times_group = C10D_OPS.get(op, (op.rstrip("_"), -1, False))
    dims, types = ev.args.get("Input Dims") or [], ev.args.get("Input type") or []
    per_arg = [_tensors(d, t) for d, t in zip(dims, types)]
    tensors = per_arg[arg] if 0 <= arg < len(per_arg) else []
    dtype_name = next((t for ts in per_arg for _, t in ts if t), "")
    group_size = None
    if kind in ("all_gather", "reduce_scatter") and not times_group and len(per_arg) >= 2:
        big, small = (per_arg[0], per_arg[1]) if kind == "all_gather" else (per_arg[1], per_arg[0])
        if big and small and sum(n for n, _ in small):
            group_size = sum(n for n, _ in big) // sum(n for n, _ in small)
    rpc = next((c for c in ev.children if c.name == "record_param_comms"), None)
    group = groups.of(rank, group_size)
    if rpc is not None and isinstance(rpc.args.get("Process Group Ranks"), str):
        group = ",".join(re.findall(r"\d+", rpc.args["Process Group Ranks"]))
    elements = sum(n for n, _ in tensors)
    if times_group:  # a list all-gather's input (or a list reduce-scatter's output): times the group
        elements *= len(group.split(",")) if group else 0
    return _Collective(ev, kind, elements, dtype_name, group, None)


def _pair_spans(colls: list[_Collective], spans: list[_Ev]) -> None:
    """Each call's execution: the first unpaired backend span starting after the call
    whose tensor shapes are among the call's (or, for a barrier, that is a barrier)."""
    pending = sorted(spans, key=lambda s: s.start_ns)
    starts = [s.start_ns for s in pending]
    for c in sorted(colls, key=lambda c: c.call.start_ns):
        want = _shapes(c.call.args)
        for i in range(bisect.bisect_left(starts, c.call.start_ns), len(pending)):
            s = pending[i]
            have = _shapes(s.args)
            barrier = _BACKEND_SPAN.match(s.name).group(2) == "barrier"  # type: ignore[union-attr]
            if (c.kind == "barrier") == barrier and (barrier or (have and have <= want)):
                c.span = s
                if not c.dtype:
                    c.dtype = next((t for t in s.args.get("Input type") or [] if t in DTYPES), "")
                del pending[i], starts[i]
                break


def _rank_records(doc: dict[str, Any], where: str, rank: int) -> tuple[list[TraceRecord], list[int]]:
    events, flows = _events(doc)
    groups = _groups(doc.get("distributedInfo") or {})
    steps = sorted(((int(e.name.split("#", 1)[1]), e) for e in events
                    if re.fullmatch(r"ProfilerStep#\d+", e.name)), key=lambda t: t[1].start_ns)
    if not steps and events:
        steps = [(0, _Ev(None, "trace", min(e.start_ns for e in events), max(e.end_ns for e in events), {}))]
    starts = [s.start_ns for _, s in steps]

    def step_of(t: int) -> int | None:
        i = bisect.bisect_right(starts, t) - 1
        return steps[i][0] if i >= 0 and t < steps[i][1].end_ns else None

    spans = [e for e in events if _BACKEND_SPAN.match(e.name) and not e.under_op]
    workers = {s.tid for s in spans}
    ops = sorted((e for e in events if e.tid not in workers and not e.under_op
                  and e.name.startswith(("aten::", "c10d::"))), key=lambda e: e.start_ns)
    colls = [_collective(e, rank, groups) for e in ops if e.name.startswith("c10d::")]
    if colls and not any("Input Dims" in c.call.args for c in colls):
        raise CommsimInputError(f"{where}: profiled without record_shapes, so its collectives' sizes are unknown; "
                                "profile with torch.profiler.profile(record_shapes=True)")
    _pair_spans(colls, spans)
    by_call = {id(c.call): c for c in colls}

    def flow_source(e: _Ev) -> bool:
        ts = flows.get(e.tid, [])
        i = bisect.bisect_left(ts, e.start_ns)
        return i < len(ts) and ts[i] <= e.end_ns

    rows: list[tuple[int, TraceRecord]] = []  # (issue time, record)
    backward: dict[tuple[Any, int], bool] = {}  # (thread, step) -> after a backward node, no forward since
    for e in ops:
        step = step_of(e.start_ns)
        if step is None:
            continue
        key = (e.tid, step)
        if e.in_optimizer:
            phase, backward[key] = "optimizer", False
        elif e.in_backward:
            phase, backward[key] = "bwd", True
        elif backward.get(key) and not flow_source(e):
            phase = "bwd"
        else:
            phase, backward[key] = "fwd", False
        c = by_call.get(id(e))
        if c is None:
            kind = "optimizer" if e.in_optimizer else kernel_class(e.name)
            rows.append((e.start_ns, TraceRecord(rank, "compute", 0, kind, e.name, e.start_ns, e.end_ns, step=step,
                                                 phase=phase)))
            continue
        if c.dtype and c.dtype not in DTYPES:
            raise CommsimInputError(f"{where}: {e.name} carries tensors of type {c.dtype!r}, which commsim cannot size")
        dtype, itemsize = DTYPES.get(c.dtype, ("", 0))
        run = c.span or e
        rows.append((e.start_ns, TraceRecord(rank, HOST_STREAM, 0, "host_launch", e.name, e.start_ns, e.end_ns,
                                             step=step, phase=phase)))
        rows.append((e.start_ns, TraceRecord(rank, COMM_STREAM, 0, c.kind, e.name, run.start_ns, run.end_ns,
                                             c.size_bytes * itemsize, 0, step, phase,
                                             dtype if c.kind != "barrier" else "", c.group)))
    for n, s in steps:
        rows.append((s.start_ns, TraceRecord(rank, HOST_STREAM, 0, "step", s.name, s.start_ns, s.end_ns, step=n,
                                             phase="other")))
    rows.sort(key=lambda t: (t[0], t[1].stream != HOST_STREAM or t[1].kind != "step"))
    return [r for _, r in rows], [n for n, _ in steps]


def read_profiler_traces(docs: Iterable[tuple[str, dict[str, Any]]]) -> Trace:
    """(file name, parsed Kineto JSON) of each rank -> one trace of every rank; times in
    ns from the earliest step's start on any rank (one host's clock)."""
    per_rank: dict[int, list[TraceRecord]] = {}
    info: dict[str, Any] = {}
    steps: dict[int, list[int]] = {}
    docs = list(docs)
    for i, (where, doc) in enumerate(docs):
        dist = doc.get("distributedInfo") if isinstance(doc.get("distributedInfo"), dict) else {}
        rank = dist.get("rank")
        if not isinstance(rank, int):
            if len(docs) > 1:
                raise CommsimInputError(f"{where}: a torch.profiler trace without distributedInfo.rank, among "
                                        f"{len(docs)} traces: which rank it is cannot be told")
            rank = 0
        recs, nums = _rank_records(doc, where, rank)
        per_rank.setdefault(rank, []).extend(recs)
        steps.setdefault(rank, []).extend(nums)
        info = info or {k: dist[k] for k in ("backend", "world_size") if k in dist}
        info.setdefault("host", doc.get("host_name", ""))
    t0 = min((r.start_ns for recs in per_rank.values() for r in recs if r.kind == "step"), default=0)
    records = []
    for rank, recs in per_rank.items():
        for op_id, r in enumerate(recs):  # issue order: recorded_sequence sorts collectives by op id
            records.append(TraceRecord(r.rank, r.stream, op_id, r.kind, r.label, r.start_ns - t0, r.end_ns - t0,
                                       r.size_bytes, r.flops, r.step, r.phase, r.dtype, r.group))
    host = str(info.pop("host", ""))
    info.update(ranks=sorted(per_rank), steps=sorted({n for nums in steps.values() for n in nums}))
    meta = TraceMeta(TraceSource.RECORDED, producer="torch.profiler", hardware=host, extra=tuple(sorted(info.items())))
    return make_trace(meta, records)
