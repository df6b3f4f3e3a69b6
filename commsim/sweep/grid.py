"""A sweep's grid: axes parsed from ``NAME=V1,V2,...``, their points, each point's
stable id and scenario, and one point (or a batch of points) predicted as table rows.

A grid axis is ``NAME=V1,V2,...`` where NAME is a ``Scenario`` field (``model``,
``cluster``, ``nodes``, ``gpus_per_node``, ``net``, ``stage``, ``preset``,
``micro_batch``, ``seq``, ``checkpointing``, ``mode``, ``seed``, ...), a knob
(``knob.coalesced_collectives``), a DeepSpeed config key (``ds.reduce_bucket_size``
for ``zero_optimization`` keys, ``ds.train_micro_batch_size_per_gpu`` and the other
top-level keys by their names) or, with ``strategy`` fsdp2, an FSDP2 setting
(``fsdp.reshard_after_forward``, ``fsdp.hsdp_replicas``, ...; ``null`` for None). Each
point becomes one row: its parameters, a stable
``point_id`` (a hash of the point and the base scenario: the resume key), and the
prediction's metrics (or its error).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from dataclasses import fields
from typing import Any, Iterable, Sequence

from commsim.api import Scenario, predict
from commsim.ir.errors import CommsimInputError

_SCENARIO = {f.name: f for f in fields(Scenario)} if hasattr(Scenario, "__dataclass_fields__") else {}
_INT = {"nodes", "gpus_per_node", "stage", "micro_batch", "seq", "seed"}
_FLOAT = {"jitter", "host_jitter", "host_scale"}
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


def keyed_points(base: Scenario, grid: dict[str, list[Any]]) -> list[tuple[dict[str, Any], str]]:
    """Every point of ``grid`` over ``base`` with its ``point_id``, in grid order."""
    key = _base_key(base)
    return [(p, point_id(p, key)) for p in points(grid)]


def point_ids(base: Scenario, grid: dict[str, list[Any]]) -> list[str]:
    """The ``point_id`` of every point of ``grid`` over ``base``, as its table rows carry them."""
    return [pid for _, pid in keyed_points(base, grid)]


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


def _config_object(value: str | dict | None, default, what: str) -> dict[str, Any]:
    """A config given as a dict (copied), a JSON file's path, or None (``default()``)."""
    if value is None:
        return default()
    if isinstance(value, dict):
        return json.loads(json.dumps(value))
    from commsim.util.files import read_json

    obj = read_json(value, CommsimInputError)
    if not isinstance(obj, dict):
        raise CommsimInputError(f"{value}: {what} is one JSON object")
    return obj


def base_fsdp_config(base: Scenario) -> dict[str, Any]:
    """The scenario's FSDP2 settings as a JSON object (the seed scenario's when none)."""
    from commsim.scenario_defaults import default_fsdp_config, default_half

    return _config_object(base.fsdp_config, lambda: default_fsdp_config(default_half(base)), "an FSDP config")


def base_ds_config(base: Scenario) -> dict[str, Any]:
    """The scenario's DeepSpeed config as a JSON object (the stage's default when none)."""
    from commsim.scenario_defaults import default_ds_config, default_half

    return _config_object(base.ds_config, lambda: default_ds_config(base.stage, default_half(base)),
                          "a DeepSpeed config")


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


def run_batch(base: Scenario, batch: Sequence[tuple[dict[str, Any], str]]) -> list[dict[str, Any]]:
    """Several grid points (each with its ``point_id``) predicted one after another, as rows
    in the same order: the unit of work a remote worker runs (see ``ray_backend``)."""
    return [run_point((base, point, pid)) for point, pid in batch]
