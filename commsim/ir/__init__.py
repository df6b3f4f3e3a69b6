"""The schedule IR: typed ops, per-rank programs, JSON / text forms, validation, traces.

This package is the contract between the generators, the simulator and the real
executor; it depends on nothing but the standard library (traces use pandas lazily).
"""

from commsim.ir.errors import CommsimInputError, ScheduleFormatError, ScheduleInvalidError
from commsim.ir.ops import (
    Alloc,
    BufferName,
    Collective,
    CollectiveKind,
    Compute,
    ComputeKind,
    Copy,
    CopyDirection,
    DType,
    Free,
    GemmShape,
    HostKind,
    HostSync,
    HostWork,
    Op,
    OpId,
    ReduceOp,
    StreamName,
    SyncScope,
)
from commsim.ir.schedule import SCHEMA_VERSION, Program, Schedule, ScheduleMeta
from commsim.ir.serialize import load_schedule, save_schedule, schedule_from_json, schedule_to_json
from commsim.ir.text import op_to_text, schedule_from_text, schedule_to_text
from commsim.ir.validate import Finding, check_valid, validate

__all__ = [
    "Alloc", "BufferName", "Collective", "CollectiveKind", "CommsimInputError", "Compute",
    "ComputeKind", "Copy", "CopyDirection", "DType", "Finding", "Free", "GemmShape",
    "HostKind", "HostSync", "HostWork", "Op", "OpId", "Program", "ReduceOp",
    "SCHEMA_VERSION", "Schedule", "ScheduleFormatError", "ScheduleInvalidError",
    "ScheduleMeta", "StreamName", "SyncScope", "check_valid", "load_schedule",
    "op_to_text", "save_schedule", "schedule_from_json", "schedule_from_text",
    "schedule_to_json", "schedule_to_text", "validate",
]
