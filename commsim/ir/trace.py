"""The trace schema shared by predictions, measurements and recorded real runs.

One ``TraceRecord`` per executed op: rank, stream (``host`` for host ops), op id,
kind, label, start and end in nanoseconds, bytes and flops, the step it belongs to,
its training phase (an ``ops.Phase`` value: the schedule op's, or, in a recording
of a real run, what the recorder saw: forward, backward or the optimizer step), and
for a collective its element type (an ``ops.DType`` value, e.g. ``bf16``) and process
group (global ranks, ``"0,1,2,3"``); both are ``""`` for other ops, and where the
producer did not know them. ``TraceMeta`` says what produced the trace (simulator, executor, recorder), for
which schedule (its content hash), on which hardware or profile, with which seed.

On disk: JSON, columnar (a list of column names, then one list per record) to stay
compact for millions of ops. In Python: ``Trace.to_dataframe()``. For eyes:
``to_chrome_trace()`` writes the Chrome trace event format that Perfetto opens.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from commsim.ir.errors import ScheduleFormatError
from commsim.util.files import atomic_write_text, read_json

if TYPE_CHECKING:  # pandas is imported lazily: the IR must stay cheap to import
    import pandas as pd

# 2: the phase column; 3: the dtype and group columns (a collective's element type and
# ranks: the strict comparison of a recording with a schedule needs both)
TRACE_SCHEMA_VERSION = 3
HOST_STREAM = "host"


class TraceSource(enum.Enum):
    PREDICTED = "predicted"  # commsim's simulator
    MEASURED = "measured"  # commsim's executor replaying a schedule
    RECORDED = "recorded"  # a real framework's run captured by `commsim record`


@dataclass(frozen=True, slots=True)
class TraceRecord:
    rank: int
    stream: str
    op_id: int
    kind: str
    label: str
    start_ns: int
    end_ns: int
    size_bytes: int = 0
    flops: int = 0
    step: int = 0
    phase: str = "other"
    dtype: str = ""  # a collective's element type (ops.DType value); "" otherwise
    group: str = ""  # a collective's global ranks, comma-separated; "" otherwise

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


COLUMNS = tuple(f.name for f in fields(TraceRecord))
_INT_COLUMNS = {"rank", "op_id", "start_ns", "end_ns", "size_bytes", "flops", "step"}


@dataclass(frozen=True, slots=True)
class TraceMeta:
    source: TraceSource
    producer: str = ""  # e.g. "commsim.sim 0.1.0", "runtime gloo", "commsim record"
    schedule_hash: str | None = None
    hardware: str = ""  # preset name, profile path, or machine description
    seed: int | None = None
    extra: tuple[tuple[str, Any], ...] = ()  # free-form, JSON-serialisable values

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.extra:
            if k == key:
                return v
        return default


@dataclass(frozen=True, slots=True)
class Trace:
    meta: TraceMeta
    records: tuple[TraceRecord, ...]

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": TRACE_SCHEMA_VERSION,
            "kind": "commsim-trace",
            "meta": {
                "source": self.meta.source.value,
                "producer": self.meta.producer,
                "schedule_hash": self.meta.schedule_hash,
                "hardware": self.meta.hardware,
                "seed": self.meta.seed,
                "extra": dict(self.meta.extra),
            },
            "columns": list(COLUMNS),
            "rows": [[getattr(r, c) for c in COLUMNS] for r in self.records],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def save(self, path: str | Path) -> None:
        """JSON; gzip-compressed when the name ends in .gz."""
        if str(path).endswith(".gz"):
            import gzip

            from commsim.util.files import atomic_write_bytes

            atomic_write_bytes(path, gzip.compress(self.to_json().encode()))
        else:
            atomic_write_text(path, self.to_json())

    @staticmethod
    def from_dict(obj: Any, where: str = "trace") -> "Trace":
        if not isinstance(obj, dict) or obj.get("kind") != "commsim-trace":
            raise ScheduleFormatError(f"{where}: not a commsim trace (missing \"kind\": \"commsim-trace\")")
        version = obj.get("schema_version")
        if version != TRACE_SCHEMA_VERSION:
            raise ScheduleFormatError(
                f"{where}: unsupported trace schema version {version!r}; this commsim reads {TRACE_SCHEMA_VERSION}"
            )
        m = obj.get("meta", {})
        try:
            source = TraceSource(m.get("source"))
        except ValueError:
            allowed = ", ".join(s.value for s in TraceSource)
            raise ScheduleFormatError(f"{where}: meta.source {m.get('source')!r} is not one of {allowed}") from None
        meta = TraceMeta(
            source=source,
            producer=str(m.get("producer", "")),
            schedule_hash=m.get("schedule_hash"),
            hardware=str(m.get("hardware", "")),
            seed=m.get("seed"),
            extra=tuple(dict(m.get("extra", {})).items()),
        )
        columns = obj.get("columns")
        if columns != list(COLUMNS):
            raise ScheduleFormatError(f"{where}: columns must be {list(COLUMNS)}, got {columns!r}")
        records = []
        for i, row in enumerate(obj.get("rows", [])):
            if not isinstance(row, list) or len(row) != len(COLUMNS):
                raise ScheduleFormatError(f"{where}: rows[{i}] must hold {len(COLUMNS)} values")
            for c, v in zip(COLUMNS, row):
                if c in _INT_COLUMNS and (isinstance(v, bool) or not isinstance(v, int)):
                    raise ScheduleFormatError(f"{where}: rows[{i}].{c} must be an integer, got {v!r}")
            records.append(TraceRecord(*row))
        return Trace(meta, tuple(records))

    @staticmethod
    def load(path: str | Path) -> "Trace":
        return Trace.from_dict(read_json(path, ScheduleFormatError), str(path))

    def on_one_clock(self) -> "Trace":
        """The trace with every rank's records of a step counted from the earliest rank's
        start of that step. The executor counts each rank's records from its own start
        of each step (after a barrier, whose exits differ by up to a few ms on a loaded
        machine) and keeps those starts on the node's monotonic clock in
        ``meta.extra["step_start_monotonic_ns"]`` (rank -> one start per measured step);
        across ranks, times compare only after this shift. A trace without them (one
        rank, a simulation, an older run) is returned as it is."""
        starts = self.meta.get("step_start_monotonic_ns")
        if not isinstance(starts, dict) or not starts:
            return self
        first = {i: min(s[i] for s in starts.values()) for i in range(min(len(s) for s in starts.values()))}
        out = []
        for r in self.records:
            own = starts.get(str(r.rank))
            if own is None or r.step not in first:
                out.append(r)
                continue
            shift = own[r.step] - first[r.step]
            out.append(replace(r, start_ns=r.start_ns + shift, end_ns=r.end_ns + shift))
        return Trace(self.meta, tuple(out))

    # ------------------------------------------------------------ pandas
    def to_dataframe(self) -> "pd.DataFrame":
        import pandas as pd

        df = pd.DataFrame.from_records([tuple(getattr(r, c) for c in COLUMNS) for r in self.records], columns=list(COLUMNS))
        for c in _INT_COLUMNS:
            df[c] = df[c].astype("int64")
        df["duration_ns"] = df["end_ns"] - df["start_ns"]
        return df

    @staticmethod
    def from_dataframe(df: "pd.DataFrame", meta: TraceMeta) -> "Trace":
        missing = [c for c in COLUMNS if c not in df.columns]
        if missing:
            raise ValueError(f"dataframe lacks trace column(s) {', '.join(missing)}")
        records = tuple(
            TraceRecord(*(int(v) if c in _INT_COLUMNS else str(v) for c, v in zip(COLUMNS, row)))
            for row in df[list(COLUMNS)].itertuples(index=False, name=None)
        )
        return Trace(meta, records)

    # ------------------------------------------------------------ Chrome / Perfetto
    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace event format: one process per rank, one thread per stream."""
        events: list[dict[str, Any]] = []
        tids: dict[tuple[int, str], int] = {}
        for r in self.records:
            key = (r.rank, r.stream)
            if key not in tids:
                tid = len([k for k in tids if k[0] == r.rank])
                tids[key] = tid
                events.append({"ph": "M", "name": "thread_name", "pid": r.rank, "tid": tid, "args": {"name": r.stream}})
                if tid == 0:
                    events.append({"ph": "M", "name": "process_name", "pid": r.rank, "tid": 0, "args": {"name": f"rank {r.rank}"}})
            events.append({
                "ph": "X",
                "name": r.label or r.kind,
                "cat": r.kind,
                "pid": r.rank,
                "tid": tids[key],
                "ts": r.start_ns / 1000.0,
                "dur": (r.end_ns - r.start_ns) / 1000.0,
                "args": {"op_id": r.op_id, "bytes": r.size_bytes, "flops": r.flops, "step": r.step,
                         "phase": r.phase, **({"dtype": r.dtype, "group": r.group} if r.group else {})},
            })
        return {
            "traceEvents": events,
            "displayTimeUnit": "ns",
            "otherData": {"source": self.meta.source.value, "producer": self.meta.producer,
                          "schedule_hash": self.meta.schedule_hash, "hardware": self.meta.hardware},
        }

    def save_chrome_trace(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_chrome_trace()))


def make_trace(meta: TraceMeta, records: Iterable[TraceRecord]) -> Trace:
    """Records sorted by (rank, start, stream, op) so traces compare deterministically."""
    return Trace(meta, tuple(sorted(records, key=lambda r: (r.step, r.rank, r.start_ns, r.stream, r.op_id))))
