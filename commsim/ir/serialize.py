"""JSON form of schedules, with a schema version and strict, located load errors.

The JSON mirrors the dataclasses: each op is an object with ``"op"`` (its type name in
snake case) and its fields; enums as their values; tuples as lists. Loading refuses
unknown schema versions, unknown op types, unknown or missing fields and wrong types,
naming the JSON path of the offending value.
"""

from __future__ import annotations

import enum
import hashlib
import json
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from commsim.ir import ops as O
from commsim.ir.errors import ScheduleFormatError
from commsim.ir.schedule import PRECISIONS, SCHEMA_VERSION, Program, Schedule, ScheduleMeta

OP_TAGS: dict[type, str] = {
    O.Compute: "compute",
    O.Collective: "collective",
    O.Copy: "copy",
    O.Alloc: "alloc",
    O.Free: "free",
    O.HostWork: "host_work",
    O.HostSync: "host_sync",
}
TAG_OPS = {tag: cls for cls, tag in OP_TAGS.items()}

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


# ---------------------------------------------------------------- encoding


def _encode_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_encode_value(v) for v in value]
    if isinstance(value, O.GemmShape):
        return {"m": value.m, "n": value.n, "k": value.k, "batch": value.batch}
    return value


# Op fields added after schedules were stored: written only when stated (not 0), so a
# stored schedule's canonical form and hash stay the same.
_OP_UNSTATED_OMITTED = {O.Compute: ("reuse_bytes", "working_set_bytes", "in_place_bytes")}


def op_to_dict(op: O.Op) -> dict[str, Any]:
    out: dict[str, Any] = {"op": OP_TAGS[type(op)]}
    omitted = _OP_UNSTATED_OMITTED.get(type(op), ())
    for f in fields(op):
        value = getattr(op, f.name)
        if f.name in omitted and value == f.default:
            continue
        out[f.name] = _encode_value(value)
    return out


_META_PAIRS = ("knobs", "config")
# Fields added to the meta after schedules were stored: written only when stated, so a
# stored schedule's canonical form (and its hash, which traces cite) stays the same.
_UNSTATED_OMITTED = ("host_costs",)


def meta_to_dict(meta: ScheduleMeta) -> dict[str, Any]:
    """The meta as JSON: every field, the knob and config pairs as objects."""
    out: dict[str, Any] = {}
    for f in fields(ScheduleMeta):
        value = getattr(meta, f.name)
        if f.name in _UNSTATED_OMITTED and value == f.default:
            continue
        out[f.name] = dict(value) if f.name in _META_PAIRS else value
    return out


def meta_from_dict(obj: Any, where: str) -> ScheduleMeta:
    """A meta object back, each field checked for its type (missing fields default)."""
    if not isinstance(obj, dict):
        raise _fail(where, "expected an object")
    names = {f.name for f in fields(ScheduleMeta)}
    unknown = set(obj) - names
    if unknown:
        raise _fail(where, f"unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(names))}")
    kwargs: dict[str, Any] = {}
    hints = _hints(ScheduleMeta)
    for f in fields(ScheduleMeta):
        if f.name not in obj:
            continue
        value, w = obj[f.name], f"{where}.{f.name}"
        if f.name in _META_PAIRS:
            if not isinstance(value, dict):
                raise _fail(w, "expected an object of name: value")
            for k, v in value.items():
                if not isinstance(v, (bool, int, float, str)):
                    raise _fail(f"{w}.{k}", f"values are numbers, booleans or strings, got {v!r}")
            kwargs[f.name] = tuple(value.items())
            continue
        kwargs[f.name] = _decode_value(hints[f.name], value, w)
    if kwargs.get("precision") not in (None,) + PRECISIONS:
        raise _fail(f"{where}.precision", f"{kwargs['precision']!r}; allowed: {', '.join(PRECISIONS)} or null")
    return ScheduleMeta(**kwargs)


def schedule_to_dict(schedule: Schedule) -> dict[str, Any]:
    return {
        "schema_version": schedule.version,
        "world_size": schedule.world_size,
        "meta": meta_to_dict(schedule.meta),
        "rank_program": list(schedule.rank_program),
        "programs": [
            {
                "setup": [op_to_dict(op) for op in p.setup],
                "step": [op_to_dict(op) for op in p.step],
            }
            for p in schedule.programs
        ],
    }


def schedule_to_json(schedule: Schedule, indent: int | None = 1) -> str:
    return json.dumps(schedule_to_dict(schedule), indent=indent, sort_keys=False)


def schedule_hash(schedule: Schedule) -> str:
    """sha256 of the canonical JSON form: names a schedule in traces."""
    return hashlib.sha256(schedule_to_json(schedule, indent=None).encode()).hexdigest()


def save_schedule(schedule: Schedule, path: str | Path) -> None:
    """Write atomically: a temporary file in the same folder, then rename; gzip-compressed
    when the name ends in .gz."""
    from commsim.util.files import atomic_write_bytes, atomic_write_text

    if str(path).endswith(".gz"):
        import gzip

        atomic_write_bytes(path, gzip.compress(schedule_to_json(schedule, indent=None).encode(), mtime=0))
    else:
        atomic_write_text(path, schedule_to_json(schedule))


# ---------------------------------------------------------------- decoding


def _fail(where: str, msg: str) -> ScheduleFormatError:
    return ScheduleFormatError(f"{where}: {msg}")


def _decode_value(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        assert len(non_none) == 1, tp
        return _decode_value(non_none[0], value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise _fail(where, f"expected a list, got {type(value).__name__}")
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_decode_value(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    supertype = getattr(tp, "__supertype__", None)
    if supertype is not None:  # NewType
        return _decode_value(supertype, value, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise _fail(where, f"{value!r} is not one of {allowed}") from None
    if tp is O.GemmShape:
        if not isinstance(value, dict):
            raise _fail(where, "expected an object with m, n, k, batch")
        return _decode_dataclass(O.GemmShape, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(where, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(where, f"expected an integer, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _fail(where, f"expected a string, got {value!r}")
        return value
    raise AssertionError(f"unhandled type {tp} at {where}")


def _decode_dataclass(cls: type, obj: dict[str, Any], where: str, skip: tuple[str, ...] = ()) -> Any:
    hints = _hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = set(obj) - names - set(skip)
    if unknown:
        raise _fail(where, f"unknown field(s) {', '.join(sorted(unknown))} for {cls.__name__}")
    kwargs = {}
    for f in fields(cls):
        if f.name not in obj:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise _fail(where, f"missing field {f.name!r} for {cls.__name__}")
        kwargs[f.name] = _decode_value(hints[f.name], obj[f.name], f"{where}.{f.name}")
    return cls(**kwargs)


def op_from_dict(obj: Any, where: str) -> O.Op:
    if not isinstance(obj, dict):
        raise _fail(where, "expected an op object")
    tag = obj.get("op")
    cls = TAG_OPS.get(tag)  # type: ignore[arg-type]
    if cls is None:
        raise _fail(where, f"unknown op {tag!r}; allowed: {', '.join(TAG_OPS)}")
    return _decode_dataclass(cls, obj, where, skip=("op",))


def _expect(obj: dict[str, Any], key: str, tp: type, where: str) -> Any:
    if key not in obj:
        raise _fail(where, f"missing field {key!r}")
    value = obj[key]
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise _fail(f"{where}.{key}", f"expected an integer, got {value!r}")
    if not isinstance(value, tp):
        raise _fail(f"{where}.{key}", f"expected {tp.__name__}, got {type(value).__name__}")
    return value


def schedule_from_dict(obj: Any) -> Schedule:
    if not isinstance(obj, dict):
        raise _fail("$", "a schedule file holds one JSON object")
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise _fail(
            "$.schema_version",
            f"unsupported schema version {version!r}; this commsim reads version {SCHEMA_VERSION}"
            " (regenerate the schedule with this commsim)",
        )
    world = _expect(obj, "world_size", int, "$")
    meta = meta_from_dict(_expect(obj, "meta", dict, "$"), "$.meta")
    rank_program = _expect(obj, "rank_program", list, "$")
    programs_obj = _expect(obj, "programs", list, "$")
    programs = []
    for pi, p in enumerate(programs_obj):
        where = f"$.programs[{pi}]"
        if not isinstance(p, dict):
            raise _fail(where, "expected an object with setup and step")
        setup_list = _expect(p, "setup", list, where)
        step_list = _expect(p, "step", list, where)
        setup = tuple(op_from_dict(o, f"{where}.setup[{i}]") for i, o in enumerate(setup_list))
        for i, op in enumerate(setup):
            if not isinstance(op, O.Alloc):
                raise _fail(f"{where}.setup[{i}]", "setup holds alloc ops only")
        step = tuple(op_from_dict(o, f"{where}.step[{i}]") for i, o in enumerate(step_list))
        programs.append(Program(setup=setup, step=step))  # type: ignore[arg-type]
    for r, idx in enumerate(rank_program):
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < len(programs):
            raise _fail(f"$.rank_program[{r}]", f"{idx!r} is not a program index (0..{len(programs) - 1})")
    if len(rank_program) != world:
        raise _fail("$.rank_program", f"has {len(rank_program)} entries for world_size {world}")
    return Schedule(
        world_size=world,
        programs=tuple(programs),
        rank_program=tuple(rank_program),
        meta=meta,
        version=version,
    )


def schedule_from_json(text: str) -> Schedule:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ScheduleFormatError(f"not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    return schedule_from_dict(obj)


def load_schedule(path: str | Path) -> Schedule:
    """Load a schedule file (gzip-compressed when its name ends in .gz); errors name the
    file and the JSON path."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            import gzip

            text = gzip.decompress(path.read_bytes()).decode()
        else:
            text = path.read_text()
    except (OSError, EOFError) as e:
        raise ScheduleFormatError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    try:
        return schedule_from_json(text)
    except ScheduleFormatError as e:
        raise ScheduleFormatError(f"{path}: {e}") from None
