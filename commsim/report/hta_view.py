"""What Holistic Trace Analysis (HTA) computes from commsim's Kineto traces
(``commsim.report.kineto``), stated over the commsim trace itself, and what each figure
is in commsim's own terms. Times in ns of the Kineto files' timeline (steps end to end).

* HTA's ``get_temporal_breakdown`` per rank: ``kernel_time`` is the device span, from the
  first device op's start to the last one's end (commsim's step time less the host-only
  head and tail); ``idle_time`` the span less the time some device op runs; ``compute_time``
  the time some compute kernel runs, on any stream: commsim's compute busy time
  (``Metrics.compute_busy_frac`` x step time) where all compute runs on the ``compute``
  stream, as ``compute_metrics`` counts only that stream's; ``non_compute_time`` the time
  only collectives or copies run.
* HTA's ``get_comm_comp_overlap`` per rank: the share of communication time (the union
  of collectives) during which some compute kernel runs: commsim's ``Metrics.overlap_frac``
  = 1 - exposed / communication (``StepView``: 1 - ``exposed_comm_ns`` / ``comm_ns``), again
  where compute runs on the ``compute`` stream only.
* HTA analyses every step but the last when a trace holds several (``TraceAnalysis(...,
  include_last_profiler_step=True)`` keeps it); a prediction holds one. HTA rounds each
  event inward to whole microseconds unless ``HTA_DISABLE_NS_ROUNDING=1``: on kernels of a
  few microseconds that moves its figures by percents.

``device_breakdown`` computes these figures over a commsim trace; tests/report/test_kineto.py
checks them, and commsim's own, against HTA's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from commsim.ir.trace import HOST_STREAM, Trace
from commsim.report.kineto import op_class, rank_records, step_origins
from commsim.util.intervals import length, overlap, union


@dataclass(frozen=True, slots=True)
class DeviceBreakdown:
    """One rank's device time over some steps as HTA computes it from the Kineto files
    (module docstring), in ns of the laid-out timeline."""

    span_ns: int  # first device op's start to the last one's end (HTA's kernel_time)
    busy_ns: int  # some device op runs
    compute_ns: int  # some compute kernel runs, on any stream (HTA's compute_time)
    comm_ns: int  # some collective runs
    overlap_ns: int  # some collective and some compute kernel run

    @property
    def idle_ns(self) -> int:  # HTA's idle_time
        return self.span_ns - self.busy_ns

    @property
    def non_compute_ns(self) -> int:  # HTA's non_compute_time
        return self.busy_ns - self.compute_ns

    @property
    def comm_overlap_frac(self) -> float:  # HTA's comp_comm_overlap_ratio
        return self.overlap_ns / self.comm_ns if self.comm_ns else float("nan")


def default_steps(trace: Trace) -> list[int]:
    """The steps HTA analyses by default: every one but the last when there are several."""
    steps = sorted({r.step for r in trace.records})
    return steps[:-1] if len(steps) > 1 else steps


def device_breakdown(trace: Trace, rank: int, steps: Iterable[int] | None = None) -> DeviceBreakdown:
    """``rank``'s ``DeviceBreakdown`` over ``steps`` (default: those HTA analyses)."""
    chosen = set(default_steps(trace) if steps is None else steps)
    origins = step_origins(trace)
    by_class: dict[str, list[tuple[int, int]]] = {"communication": [], "memory": [], "computation": []}
    for r in rank_records(trace, rank):
        if r.stream == HOST_STREAM or r.step not in chosen:
            continue
        lo, _, at = origins[r.step]
        by_class[op_class(r.kind)].append((at + r.start_ns - lo, at + r.end_ns - lo))
    every = union(iv for ivs in by_class.values() for iv in ivs)
    comp, comm = by_class["computation"], by_class["communication"]
    span = every[-1][1] - every[0][0] if every else 0
    return DeviceBreakdown(span, length(every), length(comp), length(comm), overlap(comm, comp))
