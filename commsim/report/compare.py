"""Prediction vs measurement: step time, busy time per stream and phase, exposed
communication, and per-op duration errors, with the largest discrepancies named.

Both traces are in commsim's schema: the predicted one from ``commsim predict --trace``
(the simulated step; symmetric mode holds rank 0 only), the measured one from
``commsim execute`` (several measured steps). Ops are matched by (rank, op id); a
measured op's duration is its mean over the measured steps. Phases are rank 0's; the
communication time is the mean over the ranks (see ``compare``). A noisy prediction
(per-rank, its ranks drifting) holds its seeded steps in ``meta.extra["step_samples"]``:
its phases, op durations and communication time are then medians over them, as the
measured ones are over the measured steps.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from commsim.ir.ops import ComputeKind
from commsim.ir.trace import HOST_STREAM, Trace, TraceRecord
from commsim.util.intervals import length, uncovered

COLLECTIVES = {"all_gather", "reduce_scatter", "all_reduce", "broadcast"}
COMPUTE = {k.value for k in ComputeKind}  # every compute op kind


# A step's phases as wall time, one after the other: forward from the step's start to
# its last forward op's end, backward (recompute included) from there to its last
# backward op's end, the optimizer step from there to the step's end. The same
# boundaries a training script's own timer sees (runtime/examples/ds_train.py times
# forward, backward and engine.step so), so they compare with real runs' phase times.
STEP_PHASES = ("forward", "backward", "optimizer")
_PHASE_OF = {"fwd": "forward", "recompute": "backward", "bwd": "backward", "optimizer": "optimizer"}


def phase_times(records: list[TraceRecord]) -> dict[str, int]:
    """Wall time of each of STEP_PHASES in one rank's step (ns); a phase with no ops
    takes no time."""
    return span_phase_times([(r.phase, r.start_ns, r.end_ns) for r in records])


def span_phase_times(spans) -> dict[str, int]:
    """``phase_times`` of one rank's ops given as (phase, start ns, end ns)."""
    if not spans:
        return {p: 0 for p in STEP_PHASES}
    start = min(a for _, a, _ in spans)
    end = max(b for _, _, b in spans)
    last = {p: start for p in STEP_PHASES}
    for phase, _, b in spans:
        p = _PHASE_OF.get(phase)
        if p is not None and b > last[p]:
            last[p] = b
    out, t = {}, start
    for p in STEP_PHASES[:-1]:
        t_end = max(t, last[p])
        out[p] = t_end - t
        t = t_end
    out[STEP_PHASES[-1]] = max(0, end - t)
    return out


def sampled_phase_times(samples, rank: int | None = None) -> dict[str, int]:
    """Each phase's median on ``rank`` (default: the lowest) over a noisy prediction's
    seeded steps (``SimResult.step_samples_spans``), as a measurement's phase is the
    median over its steps: the returned step is the median by step time, but its phases
    are one draw each."""
    per = []
    for s in samples:
        on = min(r for r, *_ in s) if rank is None else rank
        per.append(span_phase_times([(ph, a, b) for r, _, ph, a, b in s if r == on]))
    return {p: int(statistics.median(t[p] for t in per)) for p in STEP_PHASES}


def sampled_op_ns(samples, rank: int) -> dict[int, int]:
    """Each op's duration on ``rank``, the median over the seeded steps (op id -> ns)."""
    durs: dict[int, list[int]] = {}
    for s in samples:
        for r, op, _, a, b in s:
            if r == rank:
                durs.setdefault(op, []).append(b - a)
    return {op: int(statistics.median(d)) for op, d in durs.items()}


def sampled_comm_ns(samples, records: list[TraceRecord]) -> float:
    """The communication time (``_mean_comm_ns``), the median over the seeded steps:
    each step's ops take their kind and stream from ``records`` (the returned step's)."""
    rec = {(r.rank, r.op_id): r for r in records if r.step == 0}
    per = [_mean_comm_ns([replace(rec[rank, op], start_ns=a, end_ns=b) for rank, op, _, a, b in s
                          if (rank, op) in rec], 0) for s in samples]
    return float(statistics.median(per)) if per else 0.0


@dataclass
class StepView:
    """One rank's step: step time and busy / exposed figures, in ns."""

    step_ns: int
    busy_by_stream: dict[str, int]
    busy_by_phase: dict[str, int]
    comm_ns: int
    exposed_comm_ns: int
    phase_ns: dict[str, int]  # wall time per STEP_PHASES


def step_view(records: list[TraceRecord]) -> StepView:
    dev = [r for r in records if r.stream != HOST_STREAM]
    step = max((r.end_ns for r in records), default=0) - min((r.start_ns for r in records), default=0)
    streams: dict[str, list[tuple[int, int]]] = {}
    phases: dict[str, int] = {}
    for r in dev:
        streams.setdefault(r.stream, []).append((r.start_ns, r.end_ns))
        phases[r.phase] = phases.get(r.phase, 0) + r.end_ns - r.start_ns
    comm = [(r.start_ns, r.end_ns) for r in dev if r.kind in COLLECTIVES]
    comp = [(r.start_ns, r.end_ns) for r in dev if r.kind in COMPUTE and r.stream == "compute"]
    return StepView(step, {s: length(iv) for s, iv in streams.items()}, phases, length(comm), uncovered(comm, comp),
                    phase_times(records))


@dataclass
class Comparison:
    """A prediction against a measurement. Measured figures are the median over the
    measured steps (of the step time, of each phase time, of the communication time):
    one definition everywhere."""

    predicted_step_ns: float
    measured_step_ns: float  # the median measured step
    measured_step_spread_ns: float
    predicted: StepView
    measured: StepView
    op_errors: list[tuple[float, int, int, TraceRecord]]  # (signed rel. error, predicted ns, measured ns, record)
    measured_phase_ns: dict[str, float]  # median over steps, per STEP_PHASES and "communication"
    predicted_comm_ns: float  # communication time, the mean over the predicted ranks (comm_ns)
    # the collectives' own time and the waits for peers (comm_split): predicted, and the
    # median over the measured steps of each
    predicted_comm_split_ns: tuple[float, float] = (0.0, 0.0)
    measured_comm_split_ns: tuple[float, float] = (0.0, 0.0)

    @property
    def step_time_error_frac(self) -> float:
        return (self.predicted_step_ns - self.measured_step_ns) / self.measured_step_ns

    def phase_errors(self) -> dict[str, float]:
        """(predicted - measured) / measured of each phase's wall time and of the total
        communication time (phases the measurement did not see are left out)."""
        pred = self.predicted_phase_ns()
        return {p: (pred[p] - m) / m for p, m in self.measured_phase_ns.items() if m > 0}

    def predicted_phase_ns(self) -> dict[str, float]:
        """The predicted wall time of each of STEP_PHASES (the compared rank's) and the
        communication time (the mean over the predicted ranks)."""
        return dict(self.predicted.phase_ns, communication=self.predicted_comm_ns)

    def percentiles(self) -> dict[str, float]:
        errs = sorted(e for e, *_ in self.op_errors)
        if not errs:
            return {}

        def q(p: float) -> float:
            return errs[min(len(errs) - 1, int(p * (len(errs) - 1) + 0.5))]

        return {"p10": q(0.1), "p50": q(0.5), "p90": q(0.9), "mean_abs": statistics.mean(abs(e) for e in errs)}

    def busy_by_kind(self) -> dict[str, tuple[int, int]]:
        """Kind of op -> (predicted ns, measured ns) summed over the ops compared (each
        op's measured time the mean over the measured steps): where a step's error lies
        by class of work (a GEMM error common to every GEMM is the machine's speed)."""
        out: dict[str, tuple[int, int]] = {}
        for _, p, m, r in self.op_errors:
            a, b = out.get(r.kind, (0, 0))
            out[r.kind] = (a + p, b + m)
        return out

    def worst(self, n: int = 10) -> list[tuple[float, int, int, TraceRecord]]:
        return sorted(self.op_errors, key=lambda t: -abs(t[1] - t[2]))[:n]

    def to_json(self, n_worst: int = 10) -> dict:
        def view(v: StepView) -> dict:
            return {"step_s": v.step_ns / 1e9, "busy_s_by_stream": {k: x / 1e9 for k, x in v.busy_by_stream.items()},
                    "busy_s_by_phase": {k: x / 1e9 for k, x in v.busy_by_phase.items()},
                    "comm_s": v.comm_ns / 1e9, "exposed_comm_s": v.exposed_comm_ns / 1e9}

        return {
            "step_time_error_frac": self.step_time_error_frac,
            "predicted_step_s": self.predicted_step_ns / 1e9,
            "measured_step_s": self.measured_step_ns / 1e9,
            "measured_step_spread_s": self.measured_step_spread_ns / 1e9,
            "predicted": view(self.predicted), "measured": view(self.measured),
            "phase_s": {p: {"predicted": self.predicted_phase_ns()[p] / 1e9,
                            "measured": m / 1e9} for p, m in self.measured_phase_ns.items()},
            "phase_error_frac": self.phase_errors(),
            "communication_split_s": {
                name: {"predicted": self.predicted_comm_split_ns[i] / 1e9,
                       "measured": self.measured_comm_split_ns[i] / 1e9}
                for i, name in enumerate(("own", "peer_wait"))},
            "op_duration_error": self.percentiles(),
            "busy_s_by_kind": {k: {"predicted": p / 1e9, "measured": m / 1e9}
                               for k, (p, m) in self.busy_by_kind().items()},
            "ops_compared": len(self.op_errors),
            "largest_discrepancies": [
                {"op_id": r.op_id, "rank": r.rank, "stream": r.stream, "kind": r.kind, "label": r.label,
                 "bytes": r.size_bytes, "flops": r.flops, "predicted_s": p / 1e9, "measured_s": m / 1e9}
                for _, p, m, r in self.worst(n_worst)],
        }


def compare(predicted: Trace, measured: Trace, rank: int = 0) -> Comparison:
    pred = [r for r in predicted.records if r.rank == rank and r.step == 0]
    if not pred:
        raise ValueError(f"the predicted trace has no records for rank {rank}")
    steps = sorted({r.step for r in measured.records})
    per_step = {s: [r for r in measured.records if r.step == s and r.rank == rank] for s in steps}
    if not any(per_step.values()):
        raise ValueError(f"the measured trace has no records for rank {rank}")
    step_times = measured.meta.get("step_times_ns") or [step_view(per_step[s]).step_ns for s in steps]
    pv = step_view(pred)
    # A noisy prediction's step is the median of its seeded steps, each one draw of the
    # ranks' drift: its phases, ops and communication are medians over those steps too,
    # as the measured ones are over the measured steps.
    samples = predicted.meta.get("step_samples") or ()
    op_ns = sampled_op_ns(samples, rank) if samples else {}
    if samples:
        pv = replace(pv, phase_ns=sampled_phase_times(samples, rank))
    views = [step_view(per_step[s]) for s in steps if per_step[s]]
    # the measured view: the step closest to the median step time
    med = statistics.median(step_times)
    mv = min(views, key=lambda v: abs(v.step_ns - med))
    durs: dict[int, list[int]] = {}
    for s in steps:
        for r in per_step[s]:
            durs.setdefault(r.op_id, []).append(r.end_ns - r.start_ns)
    errors = []
    for r in pred:
        if r.op_id in durs and r.stream != HOST_STREAM:
            m = statistics.mean(durs[r.op_id])
            p = op_ns.get(r.op_id, r.end_ns - r.start_ns)
            errors.append(((p - m) / m if m else 0.0, p, int(m), r))
    spread = (max(step_times) - min(step_times)) / 2 if step_times else 0.0
    phases = {p: float(statistics.median(v.phase_ns[p] for v in views)) for p in STEP_PHASES}
    # Communication time holds the time a rank waits in a collective for its peers, which
    # falls to whichever rank is ahead: in a measurement to each rank by turns, in one
    # simulated draw of the ranks' speeds often to one rank throughout. The mean over
    # ranks is what does not depend on which rank is looked at.
    phases["communication"] = float(statistics.median(_mean_comm_ns(measured.records, s) for s in steps
                                                      if per_step[s]))
    splits = [comm_split(measured.records, s) for s in steps if per_step[s]]
    measured_split = (float(statistics.median(x[0] for x in splits)), float(statistics.median(x[1] for x in splits)))
    pred_comm = sampled_comm_ns(samples, predicted.records) if samples else _mean_comm_ns(predicted.records, 0)
    return Comparison(float(pv.step_ns), float(med), float(spread), pv, mv, errors, phases,
                      pred_comm, comm_split(predicted.records, 0), measured_split)


def comm_split(records: list[TraceRecord], step: int) -> tuple[float, float]:
    """One step's collectives as (their own time, the ranks' waits for their peers), ns,
    each summed over the step's collectives and averaged over the ranks that recorded the
    step. A collective ends on all its members at about the same time (within a hop), so
    the member that arrived last waited for nobody: the shortest member's duration is the
    collective's own time, and each member's duration beyond it is its wait. Durations
    only, so ranks on different hosts' clocks compare as well as one node's. A collective
    that only one rank recorded (a symmetric prediction holds rank 0) is all own time.
    A member that learns of the end late (its thread woken a scheduler tick after it)
    counts that delay as its wait. Where communication is off, this says whether it is the wire and the collective
    (own) or the ranks arriving apart (waits: host, allocator or kernel time that
    differs between ranks)."""
    members: dict[tuple[int, str], list[TraceRecord]] = {}
    ranks: set[int] = set()
    for r in records:
        if r.step != step:
            continue
        ranks.add(r.rank)
        if r.kind in COLLECTIVES:
            members.setdefault((r.op_id, r.group), []).append(r)
    if not ranks:
        return 0.0, 0.0
    own = wait = 0
    for rs in members.values():
        shortest = min(r.duration_ns for r in rs)
        own += shortest * len(rs)
        wait += sum(r.duration_ns - shortest for r in rs)
    return own / len(ranks), wait / len(ranks)


def _mean_comm_ns(records: list[TraceRecord], step: int) -> float:
    """One step's communication time (StepView.comm_ns), the mean over the ranks that
    recorded the step."""
    by_rank: dict[int, list[TraceRecord]] = {}
    for r in records:
        if r.step == step:
            by_rank.setdefault(r.rank, []).append(r)
    return statistics.mean(step_view(rs).comm_ns for rs in by_rank.values()) if by_rank else 0.0


def format_comparison(c: Comparison, n_worst: int = 8) -> str:
    """The comparison as a text table (times in ms, op durations in us), one line per figure."""
    lines = [f"step time: predicted {c.predicted_step_ns / 1e6:.2f} ms, measured {c.measured_step_ns / 1e6:.2f} ms "
             f"(median of the measured steps, +- {c.measured_step_spread_ns / 1e6:.2f}): error "
             f"{c.step_time_error_frac:+.1%}",
             f"{'phase (wall time)':<22}{'predicted ms':>14}{'measured ms':>14}{'error':>9}"]

    def row(name: str, p_ns: float, m_ns: float) -> str:
        return f"  {name:<20}{p_ns / 1e6:>14.2f}{m_ns / 1e6:>14.2f}"

    errs = c.phase_errors()
    pred = c.predicted_phase_ns()
    for p, m in c.measured_phase_ns.items():
        lines.append(row(p, pred[p], m) + (f"{errs[p]:>+9.1%}" if p in errs else ""))
    for i, name in enumerate(("  collectives' own", "  waits for peers")):
        p_ns, m_ns = c.predicted_comm_split_ns[i], c.measured_comm_split_ns[i]
        if not (p_ns or m_ns):
            continue  # no collectives on either side
        lines.append(row(name, p_ns, m_ns) + (f"{(p_ns - m_ns) / m_ns:>+9.1%}" if m_ns else ""))
    lines.append(f"{'busy per stream':<22}{'predicted ms':>14}{'measured ms':>14}")

    for s in sorted(set(c.predicted.busy_by_stream) | set(c.measured.busy_by_stream)):
        lines.append(row(s, c.predicted.busy_by_stream.get(s, 0), c.measured.busy_by_stream.get(s, 0)))
    lines.append(f"{'busy per phase':<22}")
    for s in sorted(set(c.predicted.busy_by_phase) | set(c.measured.busy_by_phase)):
        lines.append(row(s, c.predicted.busy_by_phase.get(s, 0), c.measured.busy_by_phase.get(s, 0)))
    lines.append(row("exposed comm.", c.predicted.exposed_comm_ns, c.measured.exposed_comm_ns))
    kinds = c.busy_by_kind()
    if kinds:
        lines.append(f"{'busy per op kind':<22}{'predicted ms':>14}{'measured ms':>14}{'error':>9}")
        for k, (p, m) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
            lines.append(row(k, p, m) + (f"{(p - m) / m:>+9.1%}" if m else ""))
    pc = c.percentiles()
    if pc:
        lines.append(f"per-op duration error over {len(c.op_errors)} ops: p10 {pc['p10']:+.0%}, median "
                     f"{pc['p50']:+.0%}, p90 {pc['p90']:+.0%}")
    lines.append("largest discrepancies:")
    for _, p, m, r in c.worst(n_worst):
        lines.append(f"  {p / 1e3:>10.1f} us predicted {m / 1e3:>10.1f} us measured  op {r.op_id} {r.kind} "
                     f"{r.size_bytes or ''} \"{r.label}\"")
    return "\n".join(lines)
