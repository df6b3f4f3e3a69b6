"""Which record of a run a file (or a folder of files) holds, told by its content.

A path names one file or a folder of them (one per rank, as torch.profiler's
``tensorboard_trace_handler``, a Flight Recorder dump prefix or ``commsim record``
write them). Each file is read once and recognised by what it holds, never by its
name:

* a commsim trace: JSON with ``"kind": "commsim-trace"``;
* a torch.profiler trace (Kineto's Chrome trace JSON, maybe gzip-compressed): an
  object with ``traceEvents``;
* a torch.distributed Flight Recorder dump: an object with ``version``, ``pg_config``
  and ``entries`` (or, empty, ``pg_status``), as JSON (``_dump_fr_trace_json``) or as the pickle
  ``_dump_fr_trace`` writes. A pickle is read by an unpickler that builds plain
  Python values only (dicts, lists, tuples, strings, numbers, ``set`` / ``frozenset``):
  one that names any other class or function is refused before it is built, since
  unpickling arbitrary objects runs code;
* DeepSpeed's comms-logger output: text holding its per-op lines (``comm op: ...``)
  or ``log_summary``'s table, or JSON of ``get_raw_data()`` / ``log_summary(
  return_dict=True)``.

A folder's recognised files must all be of one kind; files of no known kind in it are
left aside (a profiler folder may hold other things).
"""

from __future__ import annotations

import enum
import gzip
import io
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commsim.ir.errors import CommsimInputError

_MAX_BYTES = 2 << 30  # a file larger than this is no run record commsim reads


class Format(enum.Enum):
    COMMSIM_TRACE = "commsim trace"
    TORCH_PROFILER = "torch.profiler trace"
    FLIGHT_RECORDER = "Flight Recorder dump"
    COMMS_LOG = "DeepSpeed comms-logger output"


@dataclass(frozen=True)
class Record:
    """One recognised file and what it holds (parsed JSON, a dump's values, or text)."""

    path: Path
    content: Any


@dataclass(frozen=True)
class Found:
    format: Format
    records: tuple[Record, ...]  # in file-name order


class _Refused(pickle.UnpicklingError):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """Builds only what pickle's own opcodes build (dicts, lists, tuples, strings,
    numbers, None, booleans) and the two set types; any other class or function a
    pickle names is refused, so reading it runs no code."""

    _ALLOWED = {("builtins", "set"), ("builtins", "frozenset")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return getattr(__import__("builtins"), name)
        raise _Refused(f"holds a {module}.{name} object")


def read_plain_pickle(data: bytes, where: str) -> Any:
    """A pickle of plain Python values; anything else is refused with one line."""
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise CommsimInputError(f"{where}: a pickle that is not plain Python values ({e}); commsim reads only "
                                "Flight Recorder dumps of plain values (torch's _dump_fr_trace)") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            MemoryError) as e:
        raise CommsimInputError(f"{where}: a damaged pickle ({type(e).__name__}: {e})") from None


_COMMS_LINE = re.compile(r"comm op: .+? \| time \(ms\): ")
_COMMS_TABLE = re.compile(r"^Comm\. Op\s+Message Size\s+Count", re.M)


def _classify_json(obj: Any) -> Format | None:
    if not isinstance(obj, dict):
        return None
    if obj.get("kind") == "commsim-trace":
        return Format.COMMSIM_TRACE
    if isinstance(obj.get("traceEvents"), list):
        return Format.TORCH_PROFILER
    # (_dump_fr_trace_json leaves "entries" out when it has none)
    if {"version", "pg_config"} <= obj.keys() and ("entries" in obj or "pg_status" in obj):
        return Format.FLIGHT_RECORDER
    from commsim.ingest.comms_logger import looks_like_comms_json

    return Format.COMMS_LOG if looks_like_comms_json(obj) else None


def recognise(path: Path) -> tuple[Format | None, Any]:
    """What one file holds, and its content (None when it is no known record)."""
    try:
        if path.stat().st_size > _MAX_BYTES:
            return None, None
        data = path.read_bytes()
    except OSError as e:
        raise CommsimInputError(f"{path}: cannot read: {e.strerror}") from None
    if data[:2] == b"\x1f\x8b":  # gzip (tensorboard_trace_handler(use_gzip=True))
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise CommsimInputError(f"{path}: a damaged gzip file ({e})") from None
    if data[:1] == b"\x80":  # pickle protocol 2 and later
        obj = read_plain_pickle(data, str(path))
        fmt = Format.FLIGHT_RECORDER if isinstance(obj, dict) and {"version", "pg_config"} <= obj.keys() else None
        return fmt, obj if fmt else None
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return None, None
    head = text.lstrip()[:1]
    if head in ("{", "["):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            if head == "{" and not _COMMS_LINE.search(text):
                raise CommsimInputError(f"{path}: not valid JSON (line {e.lineno}): {e.msg}") from None
        else:
            fmt = _classify_json(obj)
            return fmt, obj if fmt else None
    if _COMMS_LINE.search(text) or _COMMS_TABLE.search(text):
        return Format.COMMS_LOG, text
    return None, None


def detect(path: str | Path) -> Found:
    """The format and content of a record file, or of every record file in a folder."""
    p = Path(path)
    if not p.exists():
        raise CommsimInputError(f"{path}: no such file or folder")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
        found: dict[Format, list[Record]] = {}
        for f in files:
            fmt, content = recognise(f)
            if fmt is not None:
                found.setdefault(fmt, []).append(Record(f, content))
        if not found:
            raise CommsimInputError(f"{path}: holds no file commsim reads ({_KNOWN})")
        if len(found) > 1:
            (a, ra), (b, rb) = list(found.items())[:2]
            raise CommsimInputError(f"{path}: mixes a {a.value} ({ra[0].path.name}) and a {b.value} "
                                    f"({rb[0].path.name}); give a folder of one kind")
        fmt, records = next(iter(found.items()))
        return Found(fmt, tuple(records))
    fmt, content = recognise(p)
    if fmt is None:
        raise CommsimInputError(f"{path}: not a file commsim reads ({_KNOWN})")
    return Found(fmt, (Record(p, content),))


_KNOWN = ("a commsim trace, a torch.profiler trace, a Flight Recorder dump or DeepSpeed comms-logger output")


def rank_from_name(path: Path) -> int | None:
    """The rank a per-rank file's name ends with (Flight Recorder's PREFIX<rank>)."""
    m = re.search(r"(\d+)(\.json)?$", path.name)
    return int(m.group(1)) if m else None
