"""A human summary of a schedule: ops, collectives and bytes per phase and stream."""

from __future__ import annotations

from collections import defaultdict

from commsim.ir import ops as O
from commsim.ir.schedule import Schedule

PHASES = tuple(p.value for p in O.Phase if p is not O.Phase.SETUP)


def summarize(schedule: Schedule, rank: int = 0) -> dict[str, dict[str, dict[str, int]]]:
    """{phase: {stream: {ops, collectives, collective_bytes, flops}}} for one rank."""
    out: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    for op in schedule.program_of(rank).step:
        stream = getattr(op, "stream", None) if O.is_device_op(op) else "host"
        row = out[op.phase.value][stream or "host"]
        row["ops"] += 1
        if isinstance(op, O.Collective):
            row["collectives"] += 1
            row["collective_bytes"] += op.size_bytes
        if isinstance(op, O.Compute):
            row["flops"] += op.flops
    return {ph: {s: dict(v) for s, v in streams.items()} for ph, streams in out.items()}


def format_summary(schedule: Schedule, rank: int = 0) -> str:
    data = summarize(schedule, rank)
    lines = [f"{schedule.meta.description}", f"rank {rank}: {len(schedule.program_of(rank).step)} step ops",
             f"{'phase':<10}{'stream':<11}{'ops':>7}{'collectives':>13}{'coll. GB':>10}{'TFLOP':>10}"]
    for phase in PHASES:
        for stream, row in sorted(data.get(phase, {}).items()):
            lines.append(f"{phase:<10}{stream:<11}{row.get('ops', 0):>7}{row.get('collectives', 0):>13}"
                         f"{row.get('collective_bytes', 0) / 1e9:>10.2f}{row.get('flops', 0) / 1e12:>10.2f}")
    return "\n".join(lines)
