"""A path given to ``commsim compare``, read as a trace or as a collective sequence,
whatever record of a run it holds (``detect``), and a real job's trace lined up with a
prediction so that their ops can be compared one by one.

* ``load_trace``: a commsim trace file, or a torch.profiler trace (a file or a folder of
  per-rank files). Flight Recorder dumps hold no steps or compute, and DeepSpeed's
  comms log no order: both are refused here, naming what reads them.
* ``load_collectives``: one rank's collectives from a commsim trace, a ``commsim record``
  folder, a torch.profiler trace or Flight Recorder dumps.
* ``as_prediction``: a real job's trace on compare's first (predicted) side: its step
  nearest the median step time, as step 0.
* ``align_to_prediction``: a real job's ops carry no schedule op ids; compare matches
  ops by id, so each recorded step whose collectives equal the prediction's (kind,
  bytes, issue order) gets the predicted collectives' ids on its own, and every other
  record an id no predicted op has: compute ops are compared by phase and stream, not
  one by one.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path

from commsim.ingest.detect import Format, detect, rank_from_name
from commsim.ir.errors import CommsimInputError
from commsim.ir.trace import HOST_STREAM, Trace, TraceRecord

# kinds the per-op alignment pairs (what a prediction's collectives are)
_ALIGNED = frozenset({"all_gather", "reduce_scatter", "all_reduce", "broadcast"})


def load_trace(path: str | Path) -> Trace:
    found = detect(path)
    if found.format is Format.TORCH_PROFILER:
        from commsim.ingest.profiler import read_profiler_traces

        return read_profiler_traces((str(r.path), r.content) for r in found.records)
    if found.format is Format.COMMSIM_TRACE:
        if len(found.records) > 1:
            raise CommsimInputError(f"{path}: a folder of {len(found.records)} commsim traces; give one trace file "
                                    "(or, for a commsim record folder, use compare --collectives)")
        return Trace.from_dict(found.records[0].content, str(found.records[0].path))
    if found.format is Format.FLIGHT_RECORDER:
        raise CommsimInputError(f"{path}: a Flight Recorder dump holds collectives only, no steps or compute: compare "
                                "it with a schedule (commsim compare --collectives DUMP SCHEDULE)")
    raise CommsimInputError(f"{path}: DeepSpeed comms-logger output holds per-op timings, not a step: turn it into "
                            "a hardware profile (commsim calibrate --from-comms-log LOG --hw-profile BASE)")


def load_collectives(path: str | Path, rank: int) -> Trace:
    """One rank's records, from any record of a run that holds its collectives."""
    found = detect(path)
    if found.format is Format.COMMSIM_TRACE:
        if Path(path).is_dir():
            from commsim.report.collectives import load_recorded

            return load_recorded(path, rank)
        trace = Trace.from_dict(found.records[0].content, str(found.records[0].path))
    elif found.format is Format.TORCH_PROFILER:
        from commsim.ingest.profiler import read_profiler_traces

        trace = read_profiler_traces((str(r.path), r.content) for r in found.records)
    elif found.format is Format.FLIGHT_RECORDER:
        from commsim.ingest.flight_recorder import read_dumps

        trace = read_dumps((r.path, rank_from_name(r.path), r.content) for r in found.records)
    else:
        raise CommsimInputError(f"{path}: DeepSpeed comms-logger output does not keep the collectives' order or "
                                "groups: record the run (commsim record), profile it or dump its Flight Recorder")
    mine = tuple(r for r in trace.records if r.rank == rank)
    if not mine:
        ranks = sorted({r.rank for r in trace.records})
        raise CommsimInputError(f"{path}: no records of rank {rank} (it holds rank(s) {', '.join(map(str, ranks))})")
    return Trace(trace.meta, mine)


def as_prediction(trace: Trace, rank: int) -> Trace:
    """A recorded trace's step nearest the median step time (of ``rank``), as step 0."""
    steps: dict[int, list[TraceRecord]] = {}
    for r in trace.records:
        if r.rank == rank:
            steps.setdefault(r.step, []).append(r)
    if not steps:
        return trace
    span = {s: max(r.end_ns for r in rs) - min(r.start_ns for r in rs) for s, rs in steps.items()}
    med = statistics.median(span.values())
    pick = min(span, key=lambda s: (abs(span[s] - med), s))
    return Trace(trace.meta, tuple(_with(r, step=0) for r in trace.records if r.step == pick))


def _with(r: TraceRecord, **kw: int) -> TraceRecord:
    return dataclasses.replace(r, **kw)


@dataclass(frozen=True)
class Alignment:
    trace: Trace
    steps_matched: tuple[int, ...]
    steps_differing: tuple[int, ...]
    collectives: int  # the prediction's collectives per step

    def describe(self) -> str:
        n = len(self.steps_matched) + len(self.steps_differing)
        head = (f"per op: {len(self.steps_matched)} of {n} recorded step(s) issue the prediction's "
                f"{self.collectives} collectives (kind, bytes, order); their collectives are compared one by one")
        if self.steps_differing:
            head += f" (steps {', '.join(map(str, self.steps_differing))} differ)"
        return head + "; the real job's compute ops have no schedule op ids, so they are compared by phase and stream"


def align_to_prediction(predicted: Trace, recorded: Trace, rank: int) -> Alignment:
    pred = sorted((r for r in predicted.records if r.rank == rank and r.step == 0 and r.kind in _ALIGNED
                   and r.stream != HOST_STREAM), key=lambda r: r.op_id)
    want = [(r.kind, r.size_bytes) for r in pred]
    next_id = 1 + max((r.op_id for r in predicted.records), default=0)
    by_step: dict[int, list[TraceRecord]] = {}
    for r in recorded.records:
        if r.rank == rank and r.kind in _ALIGNED and r.stream != HOST_STREAM:
            by_step.setdefault(r.step, []).append(r)
    ids: dict[tuple[int, int], int] = {}  # (step, recorded op id) -> predicted op id
    matched, differing = [], []
    for step, rs in sorted(by_step.items()):
        rs.sort(key=lambda r: r.op_id)
        if want and [(r.kind, r.size_bytes) for r in rs] == want:
            matched.append(step)
            ids.update({(step, r.op_id): p.op_id for r, p in zip(rs, pred)})
        else:
            differing.append(step)
    out = []
    for r in recorded.records:
        new = ids.get((r.step, r.op_id))
        if new is None:
            new, next_id = next_id, next_id + 1
        out.append(_with(r, op_id=new))
    return Alignment(Trace(recorded.meta, tuple(out)), tuple(matched), tuple(differing), len(want))
