"""Compare a recorded collective sequence with a schedule's: kind, order and bytes.

A real run's trace (``commsim record``) holds every step, warm-up included, and its
step boundaries (an optimizer-step hook) need not fall where a schedule's step starts
(DeepSpeed re-gathers persistent parameters after the optimizer step). So the
comparison (kind, bytes and group) looks for the schedule's whole per-step sequence as a contiguous run of the
recorded one, and reports every place it occurs, or else the longest partial match
and the first difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from commsim.ir.schedule import Schedule
from commsim.ir.trace import Trace, TraceRecord

IGNORED = ("barrier", "marker")
Key = tuple[str, int, str]  # kind, bytes, group ("0,1,2,3"; "" where a recording did not say)


@dataclass(frozen=True)
class Alignment:
    expected: int  # collectives in the schedule's step
    matches: tuple[tuple[int, int], ...]  # (recorded index, recorded step) of each full match
    best_start: int
    best_length: int
    mismatch: tuple[Key | None, Key | None] | None  # (expected, recorded) at the first difference

    @property
    def ok(self) -> bool:
        return bool(self.matches)


def load_recorded(path: str | Path, rank: int = 0) -> Trace:
    """A trace file, or a ``commsim record`` folder (rank<N>.json)."""
    p = Path(path)
    if p.is_dir():
        p = p / f"rank{rank}.json"
        if not p.exists():
            raise CommsimInputError(f"{path}: no rank{rank}.json in this folder (is it a commsim record output?)")
    return Trace.load(p)


def schedule_sequence(schedule: Schedule, rank: int = 0) -> list[Key]:
    return [(op.kind.value, op.size_bytes, ",".join(map(str, op.group)))
            for op in schedule.program_of(rank).step if isinstance(op, O.Collective)]


def recorded_group(record: TraceRecord) -> str:
    """The group a ``commsim record`` label names (``phase:method:dtype:ranks``), or ""."""
    parts = record.label.split(":")
    return parts[3] if len(parts) == 4 else ""


def recorded_sequence(trace: Trace) -> list[TraceRecord]:
    return [r for r in sorted(trace.records, key=lambda r: r.op_id) if r.kind not in IGNORED]


def align(expected: list[Key], recorded: list[TraceRecord]) -> Alignment:
    # A recording that does not name groups is compared on kind and bytes only.
    if recorded and not any(recorded_group(r) for r in recorded):
        expected = [(k, b, "") for k, b, _ in expected]
    seq = [(r.kind, r.size_bytes, recorded_group(r)) for r in recorded]
    n = len(expected)
    matches = tuple((i, recorded[i].step) for i in range(len(seq) - n + 1) if seq[i:i + n] == expected) if n else ()
    best_start, best_len = 0, -1
    for i in range(len(seq)):
        k = 0
        while k < n and i + k < len(seq) and seq[i + k] == expected[k]:
            k += 1
        if k > best_len:
            best_start, best_len = i, k
    mismatch = None
    if not matches:
        e = expected[best_len] if best_len < n else None
        r = seq[best_start + best_len] if best_start + best_len < len(seq) else None
        mismatch = (e, r)
    return Alignment(n, matches, best_start, max(best_len, 0), mismatch)


def format_alignment(a: Alignment) -> str:
    """One line: where the schedule's step occurs in the recording, or where they part."""
    if a.ok:
        where = ", ".join(f"call {i} (step {s})" for i, s in a.matches)
        return f"match: the schedule's {a.expected} collectives per step occur in the recording at {where}"
    exp, rec = a.mismatch or (None, None)
    return (f"no match: the longest agreement is {a.best_length} of {a.expected} collectives from recorded call "
            f"{a.best_start}; then the schedule has {exp} and the recording {rec}")


def describe_recording(trace: Trace) -> str:
    """A recorded trace in a few words: its calls, steps and calls by kind."""
    kinds: dict[str, int] = {}
    for r in trace.records:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    steps = 1 + max((r.step for r in trace.records), default=0)
    desc = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
    return f"{len(trace.records)} calls over {steps} step(s): {desc}"
