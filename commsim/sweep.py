"""Sweeps: predict every point of a grid, in parallel, resumably, as a tidy table.

A grid axis is ``NAME=V1,V2,...`` where NAME is a ``Scenario`` field (``model``,
``cluster``, ``nodes``, ``gpus_per_node``, ``net``, ``stage``, ``preset``,
``micro_batch``, ``seq``, ``checkpointing``, ``mode``, ``seed``, ...), a knob
(``knob.coalesced_collectives``), a DeepSpeed config key (``ds.reduce_bucket_size``
for ``zero_optimization`` keys, ``ds.train_micro_batch_size_per_gpu`` and the other
top-level keys by their names) or, with ``strategy`` fsdp2, an FSDP2 setting
(``fsdp.reshard_after_forward``, ``fsdp.hsdp_replicas``, ...; ``null`` for None). Each
point becomes one row: its parameters, a stable
``point_id``, and the prediction's metrics (or its error). Rows are appended to a CSV
as they finish, so a rerun with the same output skips the points already there.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import multiprocessing as mp
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Iterable

from commsim.api import Scenario, predict
from commsim.ir.errors import CommsimInputError

_SCENARIO = {f.name: f for f in fields(Scenario)} if hasattr(Scenario, "__dataclass_fields__") else {}
_INT = {"nodes", "gpus_per_node", "stage", "micro_batch", "seq", "seed"}
_FLOAT = {"jitter"}
_BOOL = {"checkpointing"}
_TOP_LEVEL_DS = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                 "gradient_clipping"}
METRICS = ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "compute_busy_frac",
           "comm_time_s", "exposed_comm_s", "overlap_frac", "peak_allocated_bytes", "peak_reserved_bytes",
           "alloc_retries", "cost_usd_per_step", "cost_usd_per_million_tokens", "mode")


def _value(name: str, raw: str) -> Any:
    if name.startswith("fsdp.") and raw.lower() in ("null", "none"):
        return None
    if name in _INT:
        return int(raw)
    if name in _FLOAT:
        return float(raw)
    if name in _BOOL:
        return raw.lower() in ("1", "true", "on", "yes")
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    return raw


def parse_grid(items: Iterable[str]) -> dict[str, list[Any]]:
    grid: dict[str, list[Any]] = {}
    for item in items:
        name, eq, raw = item.partition("=")
        if not eq or not raw:
            raise CommsimInputError(f"--grid {item!r}: expected NAME=V1,V2,...")
        if not (name in _SCENARIO or name.startswith(("knob.", "ds.", "fsdp."))):
            allowed = ", ".join(n for n in _SCENARIO if n not in ("warnings", "host_costs", "knobs", "ds_config",
                                                                  "fsdp_config"))
            raise CommsimInputError(f"--grid {item!r}: {name} is not a predict setting ({allowed}), "
                                    "knob.NAME, ds.KEY or fsdp.KEY")
        try:
            grid[name] = [_value(name, v) for v in raw.split(",")]
        except ValueError:
            raise CommsimInputError(f"--grid {item!r}: {name} takes numbers") from None
    return grid


def points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    names = list(grid)
    return [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]


def point_id(point: dict[str, Any], base: dict[str, Any]) -> str:
    blob = json.dumps({"point": point, "base": base}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def point_ids(base: Scenario, grid: dict[str, list[Any]]) -> list[str]:
    """The ``point_id`` of every point of ``grid`` over ``base``, as its table rows carry them."""
    return [point_id(p, _base_key(base)) for p in points(grid)]


def failed_points(path: str | Path, base: Scenario, grid: dict[str, list[Any]]) -> int:
    """How many points of ``grid`` have an error row in the table at ``path`` (read as
    text: a pandas read could take an all-digit point_id for a number)."""
    ids = set(point_ids(base, grid))
    with Path(path).open(newline="") as f:
        return sum(1 for r in csv.DictReader(f) if r.get("point_id") in ids and r.get("error"))


def _base_key(base: Scenario) -> dict[str, Any]:
    return {k: v for k, v in base.__dict__.items() if k not in ("warnings", "host_costs")}


def scenario_for(base: Scenario, point: dict[str, Any]) -> Scenario:
    changes: dict[str, Any] = {}
    knobs = list(base.knobs)
    ds: dict[str, Any] | None = None
    fsdp: dict[str, Any] | None = None
    for name, v in point.items():
        if name.startswith("knob."):
            knobs.append(f"{name[5:]}={v}")
        elif name.startswith("fsdp."):
            if fsdp is None:
                fsdp = base_fsdp_config(base)
            fsdp[name[5:]] = v
        elif name.startswith("ds."):
            if ds is None:
                ds = base_ds_config(base)
            key = name[3:]
            if key in _TOP_LEVEL_DS:
                ds[key] = v
            else:
                ds.setdefault("zero_optimization", {})[key] = v
        else:
            changes[name] = v
    if ds is not None:
        if "stage" in changes:
            ds.setdefault("zero_optimization", {})["stage"] = changes.pop("stage")
        changes["ds_config"] = ds
    if fsdp is not None:
        changes["fsdp_config"] = fsdp
    return base.with_(knobs=tuple(knobs), **changes)


def base_fsdp_config(base: Scenario) -> dict[str, Any]:
    """The scenario's FSDP2 settings as a JSON object (the seed scenario's when none)."""
    if base.fsdp_config is None:
        from commsim.api import default_fsdp_config

        return default_fsdp_config()
    if isinstance(base.fsdp_config, dict):
        return json.loads(json.dumps(base.fsdp_config))
    from commsim.util.files import read_json

    obj = read_json(base.fsdp_config, CommsimInputError)
    if not isinstance(obj, dict):
        raise CommsimInputError(f"{base.fsdp_config}: an FSDP2 config is one JSON object")
    return obj


def base_ds_config(base: Scenario) -> dict[str, Any]:
    if base.ds_config is None:
        from commsim.api import default_ds_config

        return default_ds_config(base.stage)
    if isinstance(base.ds_config, dict):
        return json.loads(json.dumps(base.ds_config))
    from commsim.util.files import read_json

    obj = read_json(base.ds_config, CommsimInputError)
    if not isinstance(obj, dict):
        raise CommsimInputError(f"{base.ds_config}: a DeepSpeed config is one JSON object")
    return obj


def run_point(args: tuple[Scenario, dict[str, Any], str]) -> dict[str, Any]:
    """One grid point predicted, as a table row (its settings, metrics, or its error)."""
    base, point, pid = args
    row: dict[str, Any] = {"point_id": pid, **point}
    t = time.perf_counter()
    try:
        m = predict(scenario_for(base, point)).metrics
        row.update({k: getattr(m, k) for k in METRICS})
        row.update({f"stall_{k}_s": v for k, v in m.stalls_s.items()})
        row["oom"] = m.oom or ""
        row["error"] = ""
    except CommsimInputError as e:
        row["error"] = str(e)
    row["wall_s"] = round(time.perf_counter() - t, 3)
    return row


def _done_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    with path.open(newline="") as f:
        return {r["point_id"] for r in csv.DictReader(f) if r.get("point_id")}


def sweep(base: Scenario, grid: dict[str, list[Any]], jobs: int = 2, output: str | Path | None = None,
          progress: Callable[[int, int], None] | None = None):
    """Predict every grid point; returns a pandas DataFrame (also appended to ``output``)."""
    import pandas as pd

    pts = points(grid)
    todo = [(base, p, point_id(p, _base_key(base))) for p in pts]
    out = Path(output) if output else None
    done = _done_ids(out) if out else set()
    todo = [t for t in todo if t[2] not in done]
    rows: list[dict[str, Any]] = []
    header: list[str] | None = None
    if out and out.exists():
        with out.open(newline="") as f:
            header = next(csv.reader(f), None)
    total, finished = len(todo), 0
    if progress:
        progress(0, total)
    ctx = mp.get_context("spawn")
    with ctx.Pool(max(1, jobs)) as pool:
        for row in pool.imap_unordered(run_point, todo):
            rows.append(row)
            if out:
                header = _append(out, row, header)
            finished += 1
            if progress:
                progress(finished, total)
    if out:
        return pd.read_csv(out)
    return pd.DataFrame(rows)


def _append(path: Path, row: dict[str, Any], header: list[str] | None) -> list[str]:
    if header is None:
        header = list(row)
        with path.open("w", newline="") as f:
            csv.writer(f).writerow(header)
    extra = [k for k in row if k not in header]
    if extra:  # a column the first rows lacked: rewrite with the wider header
        import pandas as pd

        df = pd.read_csv(path)
        header = header + extra
        df = df.reindex(columns=header)
        df.to_csv(path, index=False)
    with path.open("a", newline="") as f:
        csv.writer(f).writerow([row.get(k, "") for k in header])
    return header


def text_progress(stream=sys.stderr) -> Callable[[int, int], None]:
    """A one-line progress bar with rate and time left."""
    t0 = time.perf_counter()

    def show(done: int, total: int) -> None:
        width = 30
        frac = done / total if total else 1.0
        bar = "#" * int(width * frac) + "-" * (width - int(width * frac))
        el = time.perf_counter() - t0
        eta = el / done * (total - done) if done else 0.0
        stream.write(f"\rsweep [{bar}] {done}/{total} points, {el:.0f} s elapsed, ~{eta:.0f} s left ")
        if done == total:
            stream.write("\n")
        stream.flush()

    return show
