"""A 200-point sweep on the local process pool and on Ray: wall times, Ray's batches, and
the check that both tables hold the same rows (every value but each point's wall_s).

The grid: stage 2,3 x net efa,ib x nodes 1,2,4,8,16 x micro-batch 1,2,4,8,16 x preset
baseline,optimized of small-gpt2 (sequence 256), each point a full prediction.

    python bench/sweep_ray.py                 # --jobs 2 (pool workers and Ray CPUs), --keep DIR

Rows of the table:

* ``local pool``: ``sweep(..., jobs)``, the default backend;
* ``ray, own instance``: ``sweep(..., backend="ray")`` as the command line runs it: a local
  Ray instance of ``jobs`` CPUs started, the batches run, the instance shut down;
* ``ray, running instance``: the same on an instance started beforehand (what a cluster
  gives), Ray's start-up timed apart;
* ``ray, 1 point a task``: as above, one task per point, for the cost the batching saves.

Exit status 1 when a table differs from the local pool's.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import pandas as pd

from commsim.api import Scenario
from commsim.sweep import parse_grid, sweep
from commsim.sweep import ray_backend

AXES = ["stage=2,3", "net=efa,ib", "nodes=1,2,4,8,16", "micro_batch=1,2,4,8,16", "preset=baseline,optimized"]


def table(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, dtype=str, keep_default_na=False).sort_values("point_id").reset_index(drop=True)


def same_rows(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    return list(a.columns) == list(b.columns) and a.drop(columns="wall_s").equals(b.drop(columns="wall_s"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="pool workers and the Ray instance's CPUs (default 2)")
    ap.add_argument("--keep", help="write the tables into this folder (default: a temporary one)")
    args = ap.parse_args()
    import ray

    base = Scenario(model="small-gpt2", seq=256)
    grid = parse_grid(AXES)
    n = 1
    for v in grid.values():
        n *= len(v)
    folder = Path(args.keep or tempfile.mkdtemp(prefix="sweep_ray_"))
    folder.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[str, Path, str, float]] = []  # name, table, batches, wall s

    def run(name: str, out: Path, batches: str, **kw) -> None:
        out.unlink(missing_ok=True)
        t = time.perf_counter()
        sweep(base, grid, jobs=args.jobs, output=out, **kw)
        runs.append((name, out, batches, time.perf_counter() - t))

    run("local pool", folder / "local.csv", f"{n} (1 point a task)")
    per_cpu = ray_backend.batch_count(n, args.jobs)
    run("ray, own instance", folder / "ray_own.csv", str(per_cpu), backend="ray")
    t = time.perf_counter()
    ray.init(num_cpus=args.jobs, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    start_s = time.perf_counter() - t
    try:
        run("ray, running instance", folder / "ray.csv", str(per_cpu), backend="ray")
        batch_count = ray_backend.batch_count
        ray_backend.batch_count = lambda points, cpus: points  # one point a task
        try:
            run("ray, 1 point a task", folder / "ray_per_point.csv", f"{n} (1 point a task)", backend="ray")
        finally:
            ray_backend.batch_count = batch_count
    finally:
        ray.shutdown()

    want = table(runs[0][1])
    ok = True
    print(f"{n} points of {base.model} (seq {base.seq}), {args.jobs} workers / Ray CPUs; tables in {folder}")
    print(f"{'backend':<24} {'tasks':>20} {'wall s':>8}  same rows as the local pool")
    for name, out, batches, wall_s in runs:
        same = same_rows(table(out), want)
        ok = ok and same
        print(f"{name:<24} {batches:>20} {wall_s:>8.1f}  {'yes' if same else 'NO'}")
    print(f"(Ray's start-up before the running-instance rows: {start_s:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
