"""Local validation: predictions with a calibrated profile against real runs on this machine.

    python bench/validate_local.py                 # the full grid (several minutes)
    python bench/validate_local.py --quick         # 8 rows, shorter runs
    python bench/validate_local.py --traces traces # also keep the measured traces there

Steps: ``commsim calibrate`` for 2 and for 4 local gloo ranks; then, for every row of
the grid, generate the schedule, predict it with the matching profile, run it for real
with ``commsim execute`` and compare step times. Rows marked ``deepspeed`` run real
DeepSpeed (DS_ACCELERATOR=cpu, gloo) on the same model and config instead of our
executor, timing its steps; their prediction uses host costs that calibrate measured
from DeepSpeed itself (on a different, tiny model). Rows marked ``slow-link`` /
``fast-link`` run the two ranks in separate network namespaces joined by a veth pair
rate-limited with tc (root only), each calibrated over that link.

Ends with one line: ``median |error| = X%  max |error| = Y%  rows = N``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from commsim.api import Scenario, build_schedule, predict  # noqa: E402
from commsim.ir.serialize import save_schedule  # noqa: E402


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    ranks: int
    zero: dict
    preset: str = "optimized"
    micro: int = 4
    seq: int = 128
    runner: str = "executor"  # executor | deepspeed | slow-link | fast-link


GRID = [
    Row("small z3 opt", "small", 2, {"stage": 3}),
    Row("small z3 baseline", "small", 2, {"stage": 3}, preset="baseline"),
    Row("small z2", "small", 2, {"stage": 2}),
    Row("small z3 small buckets", "small", 2, {"stage": 3, "reduce_bucket_size": 200000,
                                               "stage3_prefetch_bucket_size": 100000}),
    Row("small z3 nothing live", "small", 2, {"stage": 3, "stage3_param_persistence_threshold": 0,
                                              "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}),
    Row("medium z3 opt", "medium", 2, {"stage": 3}, micro=2),
    Row("medium z2", "medium", 2, {"stage": 2}, micro=2),
    Row("small z3 opt x4", "small", 4, {"stage": 3}, micro=2),
    Row("small z2 x4", "small", 4, {"stage": 2}, micro=2),
    Row("small z3 baseline x4", "small", 4, {"stage": 3}, preset="baseline", micro=2),
    Row("DS small z3", "small", 2, {"stage": 3}, micro=2, runner="deepspeed"),
    Row("DS small z2", "small", 2, {"stage": 2}, micro=2, runner="deepspeed"),
    Row("DS small z3 nothing live", "small", 2, {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                 "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0},
        micro=2, runner="deepspeed"),
]


def run(cmd: list[str], env: dict | None = None, timeout: int = 1800) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def commsim(*args: str, env: dict | None = None) -> str:
    return run([sys.executable, "-m", "commsim.cli", *args], env=env)


def ds_config(row: Row) -> dict:
    return {"train_micro_batch_size_per_gpu": row.micro, "zero_optimization": row.zero}


def measure_executor(row: Row, sched_path: Path, out: Path, steps: int) -> float:
    commsim("execute", str(sched_path), "--nproc-per-node", str(row.ranks), "--steps", str(steps), "-o", str(out))
    meta = json.loads(out.read_text())["meta"]["extra"]
    return statistics.median(meta["step_times_ns"]) / 1e9


def measure_deepspeed(row: Row, cfg_path: Path, work: Path, steps: int) -> float:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(ROOT / ".cache" / "torch_extensions"))
    timings = work / "ds_times.json"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(row.ranks),
         "-m", "runtime.examples.ds_train", "--model", row.model, "--seq", str(row.seq), "--ds-config", str(cfg_path),
         "--steps", str(steps + 2), "--timings", str(timings)], env=env)
    times = json.loads(timings.read_text())["step_times_s"][2:]  # steps 0-1: DeepSpeed records its trace
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 rows (no 4-rank or DeepSpeed rows), 2 measured steps")
    ap.add_argument("--traces", help="copy each row's measured trace into this folder")
    ap.add_argument("--skip-deepspeed", action="store_true")
    args = ap.parse_args()
    rows = [r for r in GRID if not (args.quick and (r.ranks > 2 or r.runner == "deepspeed"))]
    if args.skip_deepspeed:
        rows = [r for r in rows if r.runner != "deepspeed"]
    steps = 2 if args.quick else 3
    work = Path(tempfile.mkdtemp(prefix="commsim-validate-"))
    profiles: dict[int, Path] = {}
    t0 = time.time()
    for ranks in sorted({r.ranks for r in rows}):
        profiles[ranks] = work / f"profile{ranks}.json"
        extra = ["--deepspeed-host-costs"] if any(r.runner == "deepspeed" and r.ranks == ranks for r in rows) else []
        print(f"calibrating {ranks} ranks ...", flush=True)
        commsim("calibrate", "--nproc-per-node", str(ranks), "-o", str(profiles[ranks]), *extra)
    results = []
    print(f"{'row':<28}{'ranks':>6}{'predicted s':>13}{'measured s':>12}{'error':>9}", flush=True)
    for i, row in enumerate(rows):
        cfg_path = work / f"ds{i}.json"
        cfg_path.write_text(json.dumps(ds_config(row)))
        sc = Scenario(model=row.model, nodes=1, gpus_per_node=row.ranks, ds_config=str(cfg_path), seq=row.seq,
                      preset=row.preset, hw_profile=str(profiles[row.ranks]))
        schedule = build_schedule(sc)[0]
        sched_path = work / f"sched{i}.json"
        save_schedule(schedule, sched_path)
        pred = predict(sc).metrics.step_time_s
        if row.runner == "deepspeed":
            meas = measure_deepspeed(row, cfg_path, work, steps)
        else:
            out = work / f"measured{i}.json"
            meas = measure_executor(row, sched_path, out, steps)
            if args.traces:
                dest = Path(args.traces)
                dest.mkdir(parents=True, exist_ok=True)
                from commsim.ir.trace import Trace

                Trace.load(out).save(dest / (row.name.replace(" ", "_") + ".json.gz"))
                shutil.copy(profiles[row.ranks], dest / f"profile-{row.ranks}ranks.json")
        err = (pred - meas) / meas
        results.append((row, pred, meas, err))
        print(f"{row.name:<28}{row.ranks:>6}{pred:>13.3f}{meas:>12.3f}{err:>+9.1%}", flush=True)
    errs = [abs(e) for *_, e in results]
    print(f"(took {time.time() - t0:.0f} s; work files in {work})")
    print(f"median |error| = {statistics.median(errs):.1%}  max |error| = {max(errs):.1%}  rows = {len(errs)}")


if __name__ == "__main__":
    main()
