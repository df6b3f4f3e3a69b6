"""Sweep points run as Ray tasks, in batches, on a local Ray instance or a Ray cluster.

One task predicts a batch of points (``commsim.sweep.grid.run_batch``) and returns their
rows; the driver takes batches as they finish, so rows reach the table batch by batch.

Batch size. A point of a small model predicts in 15-80 ms (tiny, small-gpt2, here); a
Ray task costs about 1 ms to submit, run and return on a local instance (measured: 200
one-point tasks in 0.22 s on 2 CPUs), more where it crosses a network. One task per point
would spend a few percent of the CPUs on Ray; a batch amortises that. Too few batches
balance badly: points differ in cost several-fold (nodes, stage, per-rank mode), and the
last batch to finish runs while the other CPUs idle. So a sweep makes ``BATCHES_PER_CPU``
(4) batches per CPU of the cluster, which bounds that idle tail by about a quarter of a
CPU's share, and at most ``MAX_POINTS_PER_BATCH`` (64) points a batch, so that on a large
grid the progress bar moves and an interrupted sweep loses at most one batch per CPU.
Points are dealt to batches round-robin, which spreads each axis's costly values over
all batches.

Connection. Ray instance already connected in this process: used as is and left so.
``address`` given (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``): connected to, and
disconnected afterwards. Else ``RAY_ADDRESS`` when set (as ``ray.init`` reads it). Else a
local instance of ``jobs`` CPUs is started and shut down afterwards. A ``HOST:PORT``
nothing listens on is an error at once (Ray would retry it for minutes). Ray's driver-side
logging is kept to errors and the workers' output is not forwarded, so the command's
stdout and its progress bar carry only commsim's lines.

Workers import commsim. A local instance's workers run this interpreter with this
process's environment (and working directory on their path), so they import the same
commsim. A cluster's workers need commsim and its dependencies (simpy, pandas,
matplotlib) in their Python: installed in the cluster's image, or provided by a Ray
``runtime_env``, e.g. ``{"py_modules": ["/path/to/commsim"], "pip": ["simpy", "pandas",
"matplotlib"]}``, which goes to ``ray.init`` unchanged.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from typing import Any, Iterator

from commsim.api import Scenario
from commsim.ir.errors import CommsimInputError
from commsim.sweep.grid import run_batch

BATCHES_PER_CPU = 4
MAX_POINTS_PER_BATCH = 64
CONNECT_TIMEOUT_S = 10.0


def batch_count(n_points: int, cpus: int) -> int:
    """How many batches ``n_points`` points make on a cluster of ``cpus`` CPUs."""
    if n_points <= 0:
        return 0
    want = max(BATCHES_PER_CPU * max(1, cpus), math.ceil(n_points / MAX_POINTS_PER_BATCH))
    return min(n_points, want)


def make_batches(items: list[Any], n_batches: int) -> list[list[Any]]:
    """``items`` dealt round-robin into ``n_batches`` batches (sizes differ by at most one)."""
    return [items[i::n_batches] for i in range(n_batches)] if n_batches else []


def require_ray():
    """The ``ray`` module, or the error naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise CommsimInputError("--backend ray: Ray is not installed; pip install 'commsim[ray]'") from None
    return ray


def _check_reachable(address: str, where: str) -> None:
    """Fail fast on a HOST:PORT nothing listens on (Ray itself retries it for minutes)."""
    host, colon, port = address.rpartition(":")
    if "://" in address or not colon or not port.isdigit():
        return  # auto, local, a Ray Client address or a malformed one: Ray's own checks say
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise CommsimInputError(f"--backend ray: cannot reach Ray ({where}): {e}") from None


def _connect(ray, jobs: int, address: str | None, runtime_env: dict[str, Any] | None) -> bool:
    """Connect this process to Ray (see the module docstring); True when the caller must
    disconnect (or shut down the instance it started) afterwards."""
    if ray.is_initialized():
        return False
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False, "runtime_env": runtime_env}
    env = os.environ.get("RAY_ADDRESS") or None
    target = env if env and address in (None, "auto") else address  # as ray.init resolves it
    where = f"RAY_ADDRESS={env}" if env and target == env else f"--address {address}"
    if target is not None:
        _check_reachable(target, where)
    try:
        if target is None:
            # "local": a new instance even when a `ray start` cluster runs on this machine
            ray.init(address="local", num_cpus=jobs, include_dashboard=False, **quiet)
        else:
            ray.init(address=address, **quiet)
    except (ConnectionError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CommsimInputError(f"--backend ray: cannot start or reach Ray ({where}): {first}") from None
    return True


def ray_rows(base: Scenario, todo: list[tuple[dict[str, Any], str]], jobs: int, address: str | None = None,
             runtime_env: dict[str, Any] | None = None) -> Iterator[list[dict[str, Any]]]:
    """The rows of ``todo``'s points (each ``(point, point_id)`` over ``base``), one list per
    finished batch, in the order the batches finish; first an empty list, once Ray is up
    and the batches are submitted."""
    ray = require_ray()
    owned = _connect(ray, jobs, address, runtime_env)
    pending: list[Any] = []
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        task = ray.remote(num_cpus=1)(run_batch)
        base_ref = ray.put(base)  # stored once, not pickled into every task
        pending = [task.remote(base_ref, b) for b in make_batches(todo, batch_count(len(todo), cpus))]
        yield []
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            yield ray.get(ready[0])
    finally:
        for ref in pending:  # interrupted: the batches not taken are not wanted
            ray.cancel(ref)
        if owned:
            ray.shutdown()
