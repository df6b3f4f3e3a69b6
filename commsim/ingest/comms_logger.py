"""DeepSpeed's comms-logger output as collective calibration points.

With ``"comms_logger": {"enabled": true, "verbose": true, "prof_all": true}`` in the
ds_config (and ``"log_level": "info"``, without which DeepSpeed's logger drops the lines),
``deepspeed.comm``'s ``timed_op`` times every collective it sends and rank 0 logs one
line per op::

    comm op: all_reduce | time (ms): 0.52 | msg size: 32.5 KB | algbw (Gbps): 1.02 | busbw (Gbps): 1.02

(``msg size`` rounded by ``convert_size`` to 2 decimals of KB / MB / GB). The same
values are kept in ``comms_logger.get_raw_data()``: op name -> message bytes ->
``[count, [ms...], [algbw...], [busbw...]]``, exact sizes, which a script can save as
JSON. ``log_summary()`` prints, and ``log_summary(return_dict=True)`` returns, only
averages and totals per size.

DeepSpeed 0.19.8 (deepspeed/comm/comm.py, utils/timer.py) times each op with a timer
named after the op (and, with the logger's ``debug``, its caller: ``all_reduce |
[Caller Func: f]``) that it stops but never resets, and logs ``elapsed(reset=False)``:
every logged time is the sum of all of that timer's times so far. Per-op times are the
differences between a timer's consecutive values (rounded to 0.01 ms in the text); in
the raw data, each timer's values of all sizes sorted ascending restore their order.
The reader takes the values as cumulative when each timer's values never decrease (in
log order, or per size in the raw data), and as per-op times otherwise.
The summary (table or dictionary) averages the cumulative values, which cannot be
undone, so it is refused.

A logged op ran synchronised: DeepSpeed synchronises the accelerator before stopping
its timer (on the CPU accelerator that is a no-op, so an op issued with
``async_op=True`` is timed only until its call returns: ZeRO-3's parameter gathers).
A time is the whole call on rank 0, waiting for its peers included; the reader takes
the median per (kind, size). Sizes follow commsim's convention: DeepSpeed logs an
all-gather's input, so it is multiplied by the group size; all-reduce, reduce-scatter
(its input) and broadcast are as logged. The log does not say the group; the whole job
is assumed, as DeepSpeed's own bandwidth figures do. Other ops (barriers, point to
point, all-to-all, names of the caller's choosing) are counted and left out.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Any

from commsim.hardware.profile import CollectiveFit
from commsim.ir.errors import CommsimInputError

# DeepSpeed's op (log) names -> (kind, multiplied by the group size?)
DS_KINDS = {"all_reduce": ("all_reduce", False), "all_reduce_coalesced": ("all_reduce", False),
            "inference_all_reduce": ("all_reduce", False), "all_gather": ("all_gather", True),
            "all_gather_into_tensor": ("all_gather", True), "reduce_scatter": ("reduce_scatter", False),
            "reduce_scatter_tensor": ("reduce_scatter", False), "broadcast": ("broadcast", False)}

_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40, "PB": 1 << 50}
_LINE = re.compile(r"comm op: (?P<name>.+?) \| time \(ms\): (?P<ms>[\d.]+) \| msg size: (?P<size>[\d.]+) ?"
                   r"(?P<unit>[KMGTP]?B) \| algbw \(Gbps\): (?P<alg>[\d.]+) \| busbw \(Gbps\): (?P<bus>[\d.]+)")
_CALLER = re.compile(r" \| \[Caller Func: .*\]$")


@dataclass(frozen=True)
class LoggedOp:
    name: str  # DeepSpeed's op (log) name
    size_bytes: float  # as DeepSpeed logs it (from the text: rounded by convert_size)
    seconds: float  # this op's own time
    algbw_gbps: float
    busbw_gbps: float


@dataclass(frozen=True)
class CommsLog:
    ops: tuple[LoggedOp, ...]
    cumulative: bool  # the logged values were running sums (DeepSpeed 0.19.8's timer)
    exact_sizes: bool  # from get_raw_data (exact), not the text (rounded)


def looks_like_comms_json(obj: Any) -> bool:
    """``get_raw_data()`` or ``log_summary(return_dict=True)`` saved as JSON."""
    if not isinstance(obj, dict) or not obj:
        return False
    if {"summary", "metadata"} <= obj.keys():
        return True
    return all(isinstance(v, dict) and v and all(isinstance(x, list) and len(x) == 4 for x in v.values())
               for v in obj.values())


def _op_name(timer_name: str) -> str:
    """The op's name without the caller ``debug`` adds (`` | [Caller Func: f]``)."""
    return _CALLER.sub("", timer_name).strip()


def _differences(values: list[float]) -> list[float]:
    out, last = [], 0.0
    for v in values:
        out.append(v - last)
        last = v
    return out


def parse_text(text: str, where: str) -> CommsLog:
    rows = []  # (timer name, bytes, ms, algbw, busbw); with comms_logger "debug" the name
    for m in _LINE.finditer(text):  # carries its caller, and each caller has its own timer
        rows.append((m.group("name"), float(m.group("size")) * _UNITS[m.group("unit")], float(m.group("ms")),
                     float(m.group("alg")), float(m.group("bus"))))
    if not rows:
        if re.search(r"^Comm\. Op\s+Message Size", text, re.M):
            raise CommsimInputError(f"{where}: holds only log_summary's table, whose averages are of DeepSpeed's "
                                    "running sums per op name (its timer is never reset); log every op "
                                    "(comms_logger verbose true, log_level info) or save get_raw_data()")
        raise CommsimInputError(f"{where}: no DeepSpeed comms-logger op lines (\"comm op: ... | time (ms): ...\")")
    by_name: dict[str, list[float]] = {}
    for name, _, ms, _, _ in rows:
        by_name.setdefault(name, []).append(ms)
    cumulative = all(all(b >= a for a, b in zip(v, v[1:])) for v in by_name.values())
    per_op = {n: iter(_differences(v) if cumulative else v) for n, v in by_name.items()}
    ops = tuple(LoggedOp(_op_name(name), size, next(per_op[name]) / 1e3, alg, bus)
                for name, size, _, alg, bus in rows)
    return CommsLog(ops, cumulative, exact_sizes=False)


def parse_raw(obj: Any, where: str) -> CommsLog:
    if isinstance(obj, dict) and {"summary", "metadata"} <= obj.keys():
        raise CommsimInputError(f"{where}: log_summary's dictionary holds only averages of DeepSpeed's running sums "
                                "per op name (its timer is never reset); save comms_logger.get_raw_data() instead")
    values: dict[str, list[tuple[float, float, float, float]]] = {}  # name -> (ms, bytes, algbw, busbw)
    monotone = True
    for name, sizes in obj.items():
        for size, rec in sizes.items():
            try:
                count, lat, alg, bus = rec
                nbytes = float(size)
                lat = [float(x) for x in lat]
                if len(lat) != count or len(alg) != count or len(bus) != count:
                    raise ValueError("lengths differ from the count")
            except (TypeError, ValueError) as e:
                raise CommsimInputError(f"{where}: {name}.{size}: not [count, [ms...], [algbw...], [busbw...]] "
                                        f"({e})") from None
            monotone = monotone and all(b >= a for a, b in zip(lat, lat[1:]))
            values.setdefault(name, []).extend(
                (ms, nbytes, float(a), float(b)) for ms, a, b in zip(lat, alg, bus))
    if not any(values.values()):
        raise CommsimInputError(f"{where}: DeepSpeed's raw comms data holds no ops")
    ops = []
    for name, vals in values.items():
        if monotone:  # running sums: sorting them restores the order, differences the times
            vals.sort()
            times = _differences([v[0] for v in vals])
        else:
            times = [v[0] for v in vals]
        ops.extend(LoggedOp(_op_name(name), nbytes, t / 1e3, a, b) for t, (_, nbytes, a, b) in zip(times, vals))
    return CommsLog(tuple(ops), monotone, exact_sizes=True)


def ranks_from_bandwidths(log: CommsLog) -> int | None:
    """The group size DeepSpeed's busbw / algbw ratio implies ((n - 1) / n for all-reduce,
    all-gather and reduce-scatter), where the values are exact enough to tell: the raw
    data's, or printed ones of at least 10 Gbps (4 digits); None if they disagree."""
    seen = set()
    least = 0.0 if log.exact_sizes else 10.0
    for op in log.ops:
        if op.name in DS_KINDS and DS_KINDS[op.name][0] != "broadcast" and op.algbw_gbps > least \
                and op.busbw_gbps < op.algbw_gbps:
            seen.add(round(1 / (1 - op.busbw_gbps / op.algbw_gbps)))
    return seen.pop() if len(seen) == 1 else None


@dataclass(frozen=True)
class KindPoints:
    kind: str
    points: tuple[tuple[float, float], ...]  # (commsim bytes, median seconds), ascending
    ops: int
    counts: tuple[int, ...] = ()  # logged ops of each point's size

    def fit(self) -> CollectiveFit:
        """Latency from the smallest size, bandwidth from the slope between the smallest
        and the largest (as ``commsim calibrate`` fits its measurements)."""
        (x0, y0), (x1, y1) = self.points[0], self.points[-1]
        bw = (x1 - x0) / (y1 - y0) if y1 > y0 and x1 > x0 else x1 / max(y1, 1e-9) if x1 else 1e12
        return CollectiveFit(int(max(0.0, y0 - x0 / bw) * 1e9), bw, self.points)


def calibration_points(log: CommsLog, ranks: int) -> tuple[dict[str, KindPoints], dict[str, int]]:
    """Per collective kind, the median time of each size; and the ops left out, by name."""
    by: dict[str, dict[float, list[float]]] = {}
    skipped: dict[str, int] = {}
    for op in log.ops:
        if op.name not in DS_KINDS:
            skipped[op.name] = skipped.get(op.name, 0) + 1
            continue
        kind, times_group = DS_KINDS[op.name]
        size = round(op.size_bytes * (ranks if times_group else 1))
        by.setdefault(kind, {}).setdefault(size, []).append(max(op.seconds, 0.0))
    out = {kind: KindPoints(kind, tuple((float(s), statistics.median(sizes[s])) for s in sorted(sizes)),
                            sum(len(t) for t in sizes.values()), tuple(len(sizes[s]) for s in sorted(sizes)))
           for kind, sizes in by.items()}
    return out, skipped


def merged_profile(base: dict[str, Any], points: dict[str, KindPoints], ranks: int, placement: str,
                   source: str) -> dict[str, Any]:
    """The base profile document with each logged kind's fit over ``ranks`` in
    ``placement`` replaced by the log's (its other fields, contention included, kept)."""
    import copy

    doc = copy.deepcopy(base)
    colls = doc.setdefault("collectives", {})
    sources = doc.setdefault("collective_sources", {})
    for kind, kp in sorted(points.items()):
        fit = kp.fit()
        entry = colls.setdefault(kind, {}).setdefault(placement, {})
        old = entry.get(str(ranks), {})
        entry[str(ranks)] = {"latency_ns": fit.latency_ns, "bytes_per_s": fit.bytes_per_s,
                             "points": [[int(x), y] for x, y in fit.points],
                             # host time a call holds its thread: the log does not time it apart
                             **({"call_points": old["call_points"]} if "call_points" in old else {})}
        sources.setdefault(kind, {}).setdefault(placement, {})[str(ranks)] = f"DeepSpeed comms log {source}"
    kinds = ", ".join(sorted(points))
    doc["description"] = f"{base.get('description', '')}; {kinds} over {ranks} ranks from DeepSpeed comms log {source}"
    return doc
