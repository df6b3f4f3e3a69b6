"""A sweep run: the grid's points not yet in the table predicted on a backend, each row
appended to the table as its point (local) or batch (Ray) finishes.

Backends: ``local``, a pool of ``jobs`` spawned processes on this machine, one point per
task; ``ray``, batches of points as Ray tasks on a local Ray instance or a cluster (see
``commsim.sweep.ray_backend``). A point's row does not depend on the backend: the
prediction is a function of the scenario and its seed; only ``wall_s`` (the point's own
wall time) differs between runs.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any, Callable, Iterator

from commsim.api import Scenario
from commsim.ir.errors import CommsimInputError
from commsim.sweep.grid import keyed_points, run_point
from commsim.sweep.table import append_row, done_ids, read_header

BACKENDS = ("local", "ray")


def _local_rows(base: Scenario, todo: list[tuple[dict[str, Any], str]], jobs: int) -> Iterator[list[dict[str, Any]]]:
    # spawn, not fork: a forked child would inherit the parent's threads (pandas, a
    # notebook's kernel) in whatever state they were
    with mp.get_context("spawn").Pool(max(1, jobs)) as pool:
        for row in pool.imap_unordered(run_point, [(base, p, pid) for p, pid in todo]):
            yield [row]


def sweep(base: Scenario, grid: dict[str, list[Any]], jobs: int = 2, output: str | Path | None = None,
          progress: Callable[[int, int], None] | None = None, backend: str = "local",
          address: str | None = None, runtime_env: dict[str, Any] | None = None):
    """Predict every grid point; returns a pandas DataFrame (also appended to ``output``).

    With ``output``, the points whose ``point_id`` is already there are skipped.
    ``backend="ray"`` runs batches of points as Ray tasks: on the Ray instance this
    process is already connected to, else on ``address`` (``"auto"``, ``HOST:PORT``,
    ``ray://HOST:PORT``), else on ``RAY_ADDRESS``, else on a local instance of ``jobs``
    CPUs started (and shut down) here; ``runtime_env`` goes to ``ray.init``.
    """
    import pandas as pd

    if backend not in BACKENDS:
        raise CommsimInputError(f"--backend {backend!r}: allowed: {', '.join(BACKENDS)}")
    if backend == "local" and (address is not None or runtime_env is not None):
        raise CommsimInputError("--address / --ray-runtime-env: only with --backend ray")
    if backend == "ray":
        from commsim.sweep.ray_backend import ray_rows, require_ray

        require_ray()  # before the progress bar starts
    out = Path(output) if output else None
    done = done_ids(out) if out else set()
    todo = [(p, pid) for p, pid in keyed_points(base, grid) if pid not in done]
    header = read_header(out) if out else None
    rows: list[dict[str, Any]] = []
    total, finished = len(todo), 0
    if progress:
        progress(0, total)
    if todo:
        if backend == "ray":
            batches = ray_rows(base, todo, jobs, address, runtime_env)
        else:
            batches = _local_rows(base, todo, jobs)
        try:
            for batch in batches:
                if not batch and progress and finished == 0:  # the backend is up: the bar's clock starts now
                    progress(0, total)
                for row in batch:
                    rows.append(row)
                    if out:
                        header = append_row(out, row, header)
                    finished += 1
                    if progress:
                        progress(finished, total)
        finally:  # stops the pool / Ray now, not when a traceback holding the generator goes
            batches.close()
    if out:
        return pd.read_csv(out) if out.exists() else pd.DataFrame()
    return pd.DataFrame(rows)
