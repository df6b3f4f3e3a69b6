"""Does a recorded run's steady-state step equal a schedule's step, collective for collective?

A real run's trace (``commsim record``) holds every step, warm-up included, in issue
order. A schedule describes one steady-state step. They match only if the recording
*ends* with the schedule's whole step repeated at least ``min_steps`` times back to
back (kind, order, bytes, dtype and group of every collective equal; nothing between
two repetitions, nothing after the last but the script's closing barriers), and those
repetitions cover every collective of the recording's last ``min_steps`` steps.

The recorder counts steps at each optimizer step's end (a global optimizer hook), and
a framework may communicate after that hook inside its own step: DeepSpeed gathers
its updated ZeRO-1/2 partitions and re-gathers ZeRO-3's persistent parameters after
the inner optimizer's step. So a recorded step need not start where a schedule's step
starts, but in steady state it holds exactly one step's collectives, rotated; hence
the last condition counts recorded steps, not their boundaries. Everything before the
matched repetitions (initialisation, warm-up steps) is not compared.

A recording without step numbers (a Flight Recorder dump: ``steps_known`` false) cannot
say which collectives its last steps hold, so that condition is not checked there: it
matches when it ends with at least ``min_steps`` back-to-back repetitions, and the
report says how many collectives before them were not compared.

A schedule that lacks one collective, has one too many, or has one dtype or group
wrong cannot repeat to the recording's end; one that is a fragment of the step
(a single all-gather that happens to repeat at the end) cannot cover the last steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from commsim.ir.schedule import Schedule
from commsim.ir.trace import Trace, TraceRecord

# collective kinds a recording holds (runtime/record.py); "marker" records are ignored
COLLECTIVE_KINDS = frozenset({"all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all",
                              "send", "recv", "barrier"})
Key = tuple[str, int, str, str]  # kind, bytes, dtype ("bf16"), group ("0,1,2,3")


@dataclass(frozen=True)
class Difference:
    """Where the step before the matched repetitions parts from the schedule."""

    position: int  # index of the collective within the schedule's step (-1: none differs)
    expected: Key | None
    recorded: Key | None  # None: the recording starts before that step is complete
    recorded_index: int | None  # index in the recorded sequence
    recorded_step: int | None


@dataclass(frozen=True)
class StepMatch:
    expected: int  # collectives in the schedule's step
    repeats: int  # back-to-back repetitions ending at the recording's end
    starts: tuple[tuple[int, int], ...]  # (recorded index, recorded step) of each repetition's first collective
    min_steps: int
    covered: bool  # the repetitions cover every collective of the recording's last min_steps steps
    difference: Difference | None  # the first difference in the step before the repetitions
    steps_known: bool = True  # False: the recording has no step numbers; coverage is not checked

    @property
    def ok(self) -> bool:
        return self.expected > 0 and self.repeats >= self.min_steps and self.covered

    def to_json(self) -> dict:
        d = self.difference
        return {"match": self.ok, "expected": self.expected, "repeats": self.repeats, "min_steps": self.min_steps,
                "covered": self.covered, "steps_known": self.steps_known, "starts": [list(s) for s in self.starts],
                "difference": None if d is None else {
                    "position": d.position, "expected": d.expected, "recorded": d.recorded,
                    "recorded_index": d.recorded_index, "recorded_step": d.recorded_step}}


def load_recorded(path: str | Path, rank: int = 0) -> Trace:
    """A trace file, or a ``commsim record`` folder (rank<N>.json)."""
    p = Path(path)
    if p.is_dir():
        p = p / f"rank{rank}.json"
        if not p.exists():
            raise CommsimInputError(f"{path}: no rank{rank}.json in this folder (is it a commsim record output?)")
    return Trace.load(p)


def schedule_sequence(schedule: Schedule, rank: int = 0) -> list[Key]:
    """A rank's step collectives, in issue order."""
    return [(op.kind.value, op.size_bytes, op.dtype.value, ",".join(map(str, op.group)))
            for op in schedule.program_of(rank).step if isinstance(op, O.Collective)]


def recorded_sequence(trace: Trace) -> list[TraceRecord]:
    """A recording's collectives (barriers included, markers not) in issue order."""
    return [r for r in sorted(trace.records, key=lambda r: r.op_id) if r.kind in COLLECTIVE_KINDS]


def record_key(r: TraceRecord) -> Key:
    return (r.kind, r.size_bytes, r.dtype, r.group)


def strict_match(expected: list[Key], recorded: list[TraceRecord], min_steps: int = 2,
                 steps_known: bool = True) -> StepMatch:
    """Match ``expected`` (one step) against the end of ``recorded``; see the module doc."""
    if min_steps < 1:
        raise ValueError("min_steps must be >= 1")
    end = len(recorded)
    while end and recorded[end - 1].kind == "barrier":  # the script's closing barrier(s)
        end -= 1
    seq = [record_key(r) for r in recorded[:end]]
    n = len(expected)
    repeats = 0
    if n:
        while (repeats + 1) * n <= end and seq[end - (repeats + 1) * n:end - repeats * n] == expected:
            repeats += 1
    run_start = end - repeats * n
    starts = tuple((i, recorded[i].step) for i in range(run_start, end, n)) if n else ()
    # the recording's last min_steps steps: those of the last collective and the ones before it
    covered = not steps_known
    if end and steps_known:
        last = recorded[end - 1].step
        first_steady = next(i for i in range(end) if recorded[i].step >= last - min_steps + 1)
        covered = run_start <= first_steady
    difference = None
    if not (n and repeats >= min_steps and covered):
        difference = _first_difference(expected, seq, recorded, run_start)
    return StepMatch(n, repeats, starts, min_steps, covered, difference, steps_known)


def _first_difference(expected: list[Key], seq: list[Key], recorded: list[TraceRecord], run_start: int) -> Difference:
    """The recorded step that ends where the repetitions begin, compared with ``expected``
    from its last collective backwards (the end is where the two are aligned)."""
    n = len(expected)
    for i in range(n - 1, -1, -1):
        j = run_start - (n - i)
        r = seq[j] if j >= 0 else None
        if expected[i] != r:
            return Difference(i, expected[i], r, j if r is not None else None,
                              recorded[j].step if r is not None else None)
    # the step before equals the schedule's: what fails is the coverage of the last steps
    return Difference(-1, None, None, None, None)


def _fmt(k: Key | None) -> str:
    if k is None:
        return "nothing"
    kind, size, dtype, group = k
    return f"{kind} {size} B {dtype or '?'} over [{group or '?'}]"


def format_match(m: StepMatch) -> str:
    """One line: whether the recording's steady-state steps equal the schedule's step."""
    what = "collective for collective (kind, order, bytes, dtype, group)"
    if m.ok:
        if not m.steps_known:
            first = m.starts[0][0] if m.starts else 0
            return (f"match: the recording ends with the schedule's step of {m.expected} collectives {m.repeats} "
                    f"times back to back, {what}, from call {first}; it has no step numbers (a Flight Recorder "
                    f"dump), so the {first} collective(s) before them are not compared")
        where = ", ".join(f"call {i} (step {s})" for i, s in m.starts)
        return (f"match: the recording ends with the schedule's step of {m.expected} collectives {m.repeats} times "
                f"back to back, {what}, from {where}")
    if not m.expected:
        return "no match: the schedule's step has no collectives"
    head = (f"no match: the recording ends with the schedule's step of {m.expected} collectives {m.repeats} time(s) "
            f"back to back ({m.min_steps} needed")
    head += ")" if m.repeats < m.min_steps else f", but they do not cover the recording's last {m.min_steps} steps)"
    d = m.difference
    if d is None or d.position < 0:
        return head
    at = f" at recorded call {d.recorded_index} (step {d.recorded_step})" if d.recorded_index is not None else ""
    return (f"{head}; in the step before them, counting back from its end, collective {d.position} differs: the "
            f"schedule has {_fmt(d.expected)}, the recording {_fmt(d.recorded)}{at}")


def describe_recording(trace: Trace) -> str:
    """A recorded trace in a few words: its calls, steps and calls by kind."""
    kinds: dict[str, int] = {}
    for r in trace.records:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    steps = 1 + max((r.step for r in trace.records), default=0)
    desc = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
    return f"{len(trace.records)} calls over {steps} step(s): {desc}"
