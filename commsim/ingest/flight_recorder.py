"""torch.distributed Flight Recorder dumps as a commsim trace of a job's collectives.

The Flight Recorder keeps each process's last ``TORCH_FR_BUFFER_SIZE`` collectives, over
every process group, in issue order; ``torch._C._distributed_c10d._dump_fr_trace()``
returns them as a pickle of plain Python values (with each call's Python stack),
``_dump_fr_trace_json()`` as JSON (without stacks). One dump per rank, conventionally
``PREFIX<rank>`` (TORCH_FR_DUMP_TEMP_FILE's naming, which torch's own analyzer also
reads the rank from). A dump (torch 2.13 writes ``version`` "2.10") holds
``pg_config`` (process group name -> ranks, where the backend filled it in),
``pg_status``, and ``entries``, each with ``pg_id``, ``process_group`` (name,
description), ``collective_seq_id``, ``profiling_name`` (``gloo:all_gather``),
``input_sizes`` / ``output_sizes`` / ``input_dtypes`` / ``output_dtypes``,
``time_created_ns``, ``state``, and ``duration_ms`` where timing was on (NCCL with
TORCH_NCCL_ENABLE_TIMING; gloo records none).

Each entry becomes a record on stream ``collectives``:

* kind: the ``torch.distributed`` function the stack shows was called, where the dump
  has stacks, else ``profiling_name`` without its backend. They differ on gloo, which
  carries out ``reduce_scatter_tensor`` as an all-reduce and records it so: a JSON
  dump of a gloo run shows its reduce-scatters as all-reduces of the same bytes;
* bytes (commsim's convention): an all-gather's output, anything else's input;
* dtype: the IR's name of the input's element type;
* group: ``pg_config``'s ranks for the entry's process group where it lists them. gloo
  in torch 2.13 leaves them out (``pg_config`` holds one entry named ``""``), so they
  are read from a folder of every rank's dump: a group's ranks are the ranks whose
  dumps hold an entry of it (group names are the same on every rank: groups are created
  in one order everywhere). That needs every member to have recorded one of the
  group's collectives, which is so within a buffer that holds whole steps; a single
  dump without ranks is refused;
* times: ``time_created_ns`` to that plus ``duration_ms``, or a zero-length record
  where no duration was recorded.

A dump has no step numbers: every record is step 0 (``meta.steps_known`` false), and
``commsim compare --collectives`` says so rather than counting steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from commsim.ir.errors import CommsimInputError
from commsim.ir.trace import Trace, TraceMeta, TraceRecord, TraceSource, make_trace

STREAM = "collectives"

# torch's c10 ScalarType names (what a dump writes) -> (the IR's name, bytes per element)
DTYPES = {"Float": ("fp32", 4), "Double": ("fp64", 8), "BFloat16": ("bf16", 2), "Half": ("fp16", 2),
          "Long": ("int64", 8), "Int": ("int32", 4), "Short": ("int16", 2), "Byte": ("uint8", 1),
          "Char": ("int8", 1), "Bool": ("bool", 1)}

# torch.distributed's functions (the innermost frame of distributed_c10d.py) -> kind
API_KINDS = {"all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
             "all_gather": "all_gather", "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
             "_all_gather_base": "all_gather", "all_gather_coalesced": "all_gather",
             "all_gather_into_tensor_coalesced": "all_gather",
             "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
             "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
             "reduce_scatter_tensor_coalesced": "reduce_scatter",
             "broadcast": "broadcast", "reduce": "reduce", "all_to_all": "all_to_all",
             "all_to_all_single": "all_to_all", "barrier": "barrier", "monitored_barrier": "barrier",
             "send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}

# profiling_name's collective (after "gloo:" / "nccl:") -> kind
NAME_KINDS = {"all_reduce": "all_reduce", "allreduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
              "all_gather": "all_gather", "_allgather_base": "all_gather", "allgather": "all_gather",
              "all_gather_into_tensor_coalesced": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
              "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
              "reduce_scatter_tensor_coalesced": "reduce_scatter", "broadcast": "broadcast", "reduce": "reduce",
              "all_to_all": "all_to_all", "alltoall": "all_to_all", "alltoall_base": "all_to_all",
              "barrier": "barrier", "send": "send", "recv": "recv"}


def _api_kind(entry: dict[str, Any]) -> str | None:
    for frame in entry.get("frames") or []:
        if isinstance(frame, dict) and str(frame.get("filename", "")).endswith("distributed_c10d.py"):
            kind = API_KINDS.get(str(frame.get("name")))
            if kind:
                return kind
    return None


def _kind(entry: dict[str, Any], where: str) -> str:
    kind = _api_kind(entry)
    if kind:
        return kind
    name = str(entry.get("profiling_name", ""))
    op = name.split(":", 1)[1] if ":" in name else name
    return NAME_KINDS.get(op, op or "unknown")


def _bytes(sizes: Any, dtypes: Any, where: str) -> tuple[int, str]:
    """Total bytes of a list of tensor shapes with their dtypes, and the first dtype."""
    if not isinstance(sizes, list) or not isinstance(dtypes, list):
        raise CommsimInputError(f"{where}: sizes and dtypes must be lists")
    total, first = 0, ""
    for shape, dt in zip(sizes, dtypes):
        if dt not in DTYPES:
            raise CommsimInputError(f"{where}: element type {dt!r} is not one commsim sizes "
                                    f"({', '.join(DTYPES)})")
        name, item = DTYPES[dt]
        n = 1
        for d in shape:
            n *= int(d)
        total += n * item
        first = first or name
    return total, first


def _check(dump: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(dump, dict) or not isinstance(dump.get("entries", []), list):
        raise CommsimInputError(f"{where}: not a Flight Recorder dump (its entries are not a list)")
    entries = [e for e in dump.get("entries", []) if isinstance(e, dict)]
    if not entries:
        raise CommsimInputError(f"{where}: the Flight Recorder dump holds no collectives (was TORCH_FR_BUFFER_SIZE "
                                "set before the process group started?)")
    return entries


def _pg_name(entry: dict[str, Any]) -> str:
    pg = entry.get("process_group")
    return str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(entry.get("pg_id", ""))


def _listed_ranks(dump: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """pg_config's ranks by group name, where they are listed."""
    out = {}
    for name, cfg in (dump.get("pg_config") or {}).items():
        ranks = cfg.get("ranks") if isinstance(cfg, dict) else None
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)
            except json.JSONDecodeError:
                ranks = None
        if name and isinstance(ranks, list) and ranks:
            out[str(name)] = tuple(int(r) for r in ranks)
    return out


def read_dumps(dumps: Iterable[tuple[Path, int | None, Any]]) -> Trace:
    """(file, rank, loaded dump) of one or more ranks -> one trace of their collectives."""
    dumps = list(dumps)
    ranks = [r for _, r, _ in dumps]
    if len(dumps) > 1 and (None in ranks or len(set(ranks)) != len(ranks)):
        raise CommsimInputError(f"{dumps[0][0].parent}: Flight Recorder dumps are named PREFIX<rank>, one per rank; "
                                f"these names do not give distinct ranks ({', '.join(p.name for p, _, _ in dumps)})")
    checked = [(p, r if r is not None else 0, d, _check(d, str(p))) for p, r, d in dumps]
    members: dict[str, set[int]] = {}
    for _, rank, _, entries in checked:
        for e in entries:
            members.setdefault(_pg_name(e), set()).add(rank)
    records, timed = [], False
    for path, rank, dump, entries in checked:
        listed = _listed_ranks(dump)
        for i, e in enumerate(entries):
            where = f"{path}: entries[{i}]"
            kind = _kind(e, where)
            name = _pg_name(e)
            group = listed.get(name) or (tuple(sorted(members[name])) if len(checked) > 1 else None)
            if group is None:
                raise CommsimInputError(f"{path}: the dump does not list process group {name!r}'s ranks (gloo's "
                                        "Flight Recorder leaves pg_config empty); give the folder holding every "
                                        "rank's dump")
            if kind == "all_gather":
                size, dtype = _bytes(e.get("output_sizes"), e.get("output_dtypes"), where)
            else:
                size, dtype = _bytes(e.get("input_sizes"), e.get("input_dtypes"), where)
            start = int(e.get("time_created_ns") or 0)
            dur = e.get("duration_ms")
            timed = timed or isinstance(dur, (int, float))
            end = start + int(dur * 1e6) if isinstance(dur, (int, float)) else start
            label = f"{e.get('profiling_name', '')} pg {name} seq {e.get('collective_seq_id', '')}"
            records.append(TraceRecord(rank, STREAM, int(e.get("record_id", i)), kind, label, start, end, size, 0, 0,
                                       "other", dtype if kind != "barrier" else "", ",".join(map(str, group))))
    t0 = min(r.start_ns for r in records)
    records = [TraceRecord(r.rank, r.stream, r.op_id, r.kind, r.label, r.start_ns - t0, r.end_ns - t0, r.size_bytes,
                           r.flops, r.step, r.phase, r.dtype, r.group) for r in records]
    version = str(checked[0][2].get("version", ""))
    meta = TraceMeta(TraceSource.RECORDED, producer=f"torch Flight Recorder (dump version {version})",
                     extra=(("ranks", sorted(r for _, r, _, _ in checked)), ("steps_known", False),
                            ("durations_recorded", timed)))
    return make_trace(meta, records)
