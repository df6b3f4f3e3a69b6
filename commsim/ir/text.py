"""Compact text form of schedules: one line per op, for diffs, golden files and errors.

    # commsim schedule text v1
    world_size 2
    meta {"model": "tiny", ...}
    rank_program 0,0
    program 0
    setup
      0 alloc stream=compute buffer=w size_bytes=4096 label="init.w"
    step
      1 collective stream=allgather kind=all_gather size_bytes=8192 dtype=bf16 group=0-1 buffers=w label="fetch"

Fields equal to their default are omitted; tuples are comma-joined; the label is a
JSON string and always last. ``schedule_from_text(schedule_to_text(s)) == s``.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from dataclasses import MISSING, fields
from typing import Any

from commsim.ir import ops as O
from commsim.ir.errors import ScheduleFormatError
from commsim.ir.schedule import SCHEMA_VERSION, Program, Schedule, ScheduleMeta
from commsim.ir.serialize import OP_TAGS, TAG_OPS, _hints, meta_from_dict, meta_to_dict

HEADER_PREFIX = "# commsim schedule text v"
HEADER = f"{HEADER_PREFIX}{SCHEMA_VERSION}"


def _fmt(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return ",".join(_fmt(v) for v in value)
    if isinstance(value, O.GemmShape):
        return f"{value.m}x{value.n}x{value.k}x{value.batch}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _fmt_ranks(ranks: tuple[int, ...]) -> str:
    """Ascending ranks as runs: (0, 1, 2, 3, 8) -> "0-3,8"."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if j == i else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def _parse_ranks(raw: str, where: str) -> tuple[int, ...]:
    out: list[int] = []
    try:
        for piece in raw.split(","):
            lo, dash, hi = piece.partition("-")
            out.extend(range(int(lo), int(hi) + 1) if dash else [int(lo)])
    except ValueError:
        raise ScheduleFormatError(f"{where}: group must be ranks or runs like 0-7,16, got {raw!r}") from None
    return tuple(out)


def op_to_text(op: O.Op) -> str:
    """One line (no indent) describing ``op``: ``<id> <op> key=value ... label="..."``."""
    parts = [str(op.id), OP_TAGS[type(op)]]
    for f in fields(op):
        if f.name in ("id", "label"):
            continue
        value = getattr(op, f.name)
        default = f.default
        if default is not MISSING and value == default:
            continue
        parts.append(f"{f.name}={_fmt_ranks(value) if f.name == 'group' else _fmt(value)}")
    parts.append("label=" + json.dumps(op.label))
    return " ".join(parts)


def schedule_to_text(schedule: Schedule) -> str:
    meta = meta_to_dict(schedule.meta)
    lines = [
        HEADER,
        f"world_size {schedule.world_size}",
        "meta " + json.dumps(meta),
        "rank_program " + ",".join(str(i) for i in schedule.rank_program),
    ]
    for pi, program in enumerate(schedule.programs):
        lines.append(f"program {pi}")
        lines.append("setup")
        lines.extend("  " + op_to_text(op) for op in program.setup)
        lines.append("step")
        lines.extend("  " + op_to_text(op) for op in program.step)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- parsing


def _parse_value(tp: Any, raw: str, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in typing.get_args(tp) if a is not type(None)]
        return _parse_value(non_none[0], raw, where)
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if raw == "":
            return ()
        return tuple(_parse_value(item_tp, piece, where) for piece in raw.split(","))
    supertype = getattr(tp, "__supertype__", None)
    if supertype is not None:
        return _parse_value(supertype, raw, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(raw)
        except ValueError:
            raise ScheduleFormatError(f"{where}: {raw!r} is not a valid {tp.__name__}") from None
    if tp is O.GemmShape:
        try:
            m, n, k, b = (int(x) for x in raw.split("x"))
        except ValueError:
            raise ScheduleFormatError(f"{where}: gemm shape must be MxNxKxBATCH, got {raw!r}") from None
        return O.GemmShape(m, n, k, b)
    if tp is int:
        try:
            return int(raw)
        except ValueError:
            raise ScheduleFormatError(f"{where}: expected an integer, got {raw!r}") from None
    if tp is str:
        return raw
    raise AssertionError(f"unhandled type {tp}")


def op_from_text(line: str, where: str = "op") -> O.Op:
    body, sep, label_json = line.strip().partition(" label=")
    if not sep:
        raise ScheduleFormatError(f"{where}: missing label=\"...\" at the end of the line")
    try:
        label = json.loads(label_json)
    except json.JSONDecodeError:
        raise ScheduleFormatError(f"{where}: label is not a JSON string: {label_json!r}") from None
    tokens = body.split()
    if len(tokens) < 2:
        raise ScheduleFormatError(f"{where}: expected '<id> <op> key=value ...'")
    cls = TAG_OPS.get(tokens[1])
    if cls is None:
        raise ScheduleFormatError(f"{where}: unknown op {tokens[1]!r}; allowed: {', '.join(TAG_OPS)}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {"id": _parse_value(int, tokens[0], where), "label": label}
    for tok in tokens[2:]:
        key, eq, raw = tok.partition("=")
        if not eq or key not in hints or key in ("id", "label"):
            raise ScheduleFormatError(f"{where}: unexpected token {tok!r} for {tokens[1]}")
        kwargs[key] = _parse_ranks(raw, f"{where}.group") if key == "group" else \
            _parse_value(hints[key], raw, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ScheduleFormatError(f"{where}: {e}") from None


def schedule_from_text(text: str) -> Schedule:
    lines = text.splitlines()
    if not lines or lines[0].strip() != HEADER:
        first = lines[0].strip() if lines else ""
        if first.startswith(HEADER_PREFIX):
            raise ScheduleFormatError(f"line 1: unsupported schema version {first[len(HEADER_PREFIX):]!r}; this "
                                      f"commsim reads version {SCHEMA_VERSION} (regenerate the schedule with it)")
        raise ScheduleFormatError(f"line 1: expected {HEADER!r}")
    world = None
    meta = ScheduleMeta()
    rank_program: tuple[int, ...] = ()
    programs: list[Program] = []
    setup: list[O.Op] = []
    step: list[O.Op] = []
    section = None

    def close_program() -> None:
        if section is not None:
            programs.append(Program(setup=tuple(setup), step=tuple(step)))  # type: ignore[arg-type]

    for n, line in enumerate(lines[1:], start=2):
        where = f"line {n}"
        if not line.strip():
            continue
        if line.startswith("  "):
            if section is None:
                raise ScheduleFormatError(f"{where}: op outside a setup/step section")
            (setup if section == "setup" else step).append(op_from_text(line, where))
            continue
        word, _, rest = line.partition(" ")
        if word == "world_size":
            world = _parse_value(int, rest, where)
        elif word == "meta":
            try:
                m = json.loads(rest)
            except json.JSONDecodeError as e:
                raise ScheduleFormatError(f"{where}: meta is not a JSON object: {e.msg}") from None
            meta = meta_from_dict(m, f"{where}: meta")
        elif word == "rank_program":
            rank_program = _parse_value(tuple[int, ...], rest, where)
        elif word == "program":
            close_program()
            setup, step, section = [], [], "setup"
        elif word in ("setup", "step") and section is not None:
            section = word
        else:
            raise ScheduleFormatError(f"{where}: unexpected {line.strip()!r}")
    close_program()
    if world is None:
        raise ScheduleFormatError("missing 'world_size' line")
    return Schedule(world_size=world, programs=tuple(programs), rank_program=rank_program, meta=meta)
