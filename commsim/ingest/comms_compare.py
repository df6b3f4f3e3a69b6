"""A prediction's collectives beside DeepSpeed's comms log: ``commsim compare PREDICTED LOG``.

The log times each collective on its own (DeepSpeed synchronises before stopping the
op's timer), so it holds no step, no overlap and no order to match; what it can check
is each collective's duration by kind and size. Per (kind, size) that the log holds:
the logged median time (``comms_logger.calibration_points``, sizes in commsim's
convention over the job's ranks) beside the median duration of the predicted rank's
collectives of that kind and size. A predicted collective runs inside the step, beside
compute and other collectives, so its duration includes the contention the log's ops
did not have: the table says how the prediction's collectives compare with the same
ops timed alone, not whether the step is right. Sizes from the printed log are rounded
(two decimals of KB / MB: at most 0.5% off), so a logged size matches the nearest
predicted size of its kind within 1%.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from commsim.ingest.comms_logger import CommsLog, calibration_points
from commsim.ir.trace import HOST_STREAM, Trace

_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
SIZE_TOLERANCE = 0.01  # a printed size is rounded to two decimals of its unit: < 1% off


@dataclass(frozen=True, slots=True)
class SizeRow:
    kind: str
    size_bytes: int  # the logged size (commsim's convention)
    logged_s: float  # median of the logged ops
    logged_ops: int
    predicted_s: float | None  # median of the predicted collectives of this kind and size
    predicted_ops: int

    @property
    def error_frac(self) -> float | None:
        """(predicted - logged) / logged."""
        if self.predicted_s is None or self.logged_s <= 0:
            return None
        return (self.predicted_s - self.logged_s) / self.logged_s

    def to_json(self) -> dict:
        return {"kind": self.kind, "size_bytes": self.size_bytes, "logged_s": self.logged_s,
                "logged_ops": self.logged_ops, "predicted_s": self.predicted_s, "predicted_ops": self.predicted_ops,
                "error_frac": self.error_frac}


def job_ranks(trace: Trace) -> int:
    """The job's ranks as the prediction states them: its largest collective group (the
    log does not say a collective's group; DeepSpeed's own figures assume the job)."""
    groups = [len(r.group.split(",")) for r in trace.records if r.group]
    return max(groups) if groups else 1 + max((r.rank for r in trace.records), default=0)


def compare_log(trace: Trace, log: CommsLog, rank: int = 0) -> list[SizeRow]:
    ranks = job_ranks(trace)
    points, _ = calibration_points(log, ranks)
    durations: dict[tuple[str, int], list[int]] = {}
    for r in trace.records:
        if r.rank == rank and r.kind in _KINDS and r.stream != HOST_STREAM:
            durations.setdefault((r.kind, r.size_bytes), []).append(r.duration_ns)
    rows = []
    for kind, kp in sorted(points.items()):
        for (size, seconds), logged in zip(kp.points, kp.counts):
            near = [(abs(b - size), b) for k, b in durations if k == kind and abs(b - size) <= SIZE_TOLERANCE * size]
            got = durations[(kind, min(near)[1])] if near else []
            rows.append(SizeRow(kind, round(size), seconds, logged,
                                statistics.median(got) / 1e9 if got else None, len(got)))
    return rows


def summary(rows: list[SizeRow]) -> tuple[float | None, float | None, int]:
    """(median |error|, max |error|, sizes compared)."""
    errs = [abs(r.error_frac) for r in rows if r.error_frac is not None]
    if not errs:
        return None, None, 0
    return statistics.median(errs), max(errs), len(errs)


def format_rows(rows: list[SizeRow], ranks: int) -> str:
    lines = [f"collectives: the prediction's (in the step) against DeepSpeed's comms log (each op synchronised, "
             f"alone on its timer: no overlap), sizes over {ranks} ranks",
             f"{'kind':<15} {'bytes':>12} {'logged ms':>10} {'ops':>5} {'predicted ms':>13} {'ops':>5} {'error':>8}"]
    for r in rows:
        pred = f"{r.predicted_s * 1e3:13.3f}" if r.predicted_s is not None else f"{'-':>13}"
        err = f"{r.error_frac * 100:+7.1f}%" if r.error_frac is not None else f"{'-':>8}"
        lines.append(f"{r.kind:<15} {r.size_bytes:>12} {r.logged_s * 1e3:10.3f} {r.logged_ops:>5} {pred} "
                     f"{r.predicted_ops:>5} {err}")
    med, worst, n = summary(rows)
    unmatched = sum(1 for r in rows if r.predicted_s is None)
    tail = f" ({unmatched} logged size(s) the prediction does not have)" if unmatched else ""
    if n:
        lines.append(f"collectives vs comms log: median |error| = {med * 100:.1f}%  max |error| = {worst * 100:.1f}%  "
                     f"sizes = {n}{tail}")
    else:
        lines.append(f"collectives vs comms log: no logged size matches a predicted collective{tail}")
    return "\n".join(lines)
