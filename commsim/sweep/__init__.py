"""Sweeps: predict every point of a grid, in parallel, resumably, as a tidy table.

``grid`` parses the axes and turns points into scenarios and rows, ``table`` keeps the
CSV the rows are appended to as they finish (a rerun with the same output skips the
points already there), ``driver`` runs a sweep on the local process pool or on Ray, whose
batching and connection live in ``ray_backend`` (imported only for ``backend="ray"``).
"""

from commsim.sweep.driver import BACKENDS, sweep
from commsim.sweep.grid import (
    METRICS,
    base_ds_config,
    base_fsdp_config,
    keyed_points,
    parse_grid,
    point_id,
    point_ids,
    points,
    run_batch,
    run_point,
    scenario_for,
)
from commsim.sweep.table import failed_points, text_progress

__all__ = ["BACKENDS", "METRICS", "base_ds_config", "base_fsdp_config", "failed_points", "keyed_points", "parse_grid",
           "point_id", "point_ids", "points", "run_batch", "run_point", "scenario_for", "sweep", "text_progress"]
