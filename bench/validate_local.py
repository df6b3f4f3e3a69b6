"""Local validation: predictions with a calibrated profile against real runs on this machine.

    python bench/validate_local.py                 # the full grid (about two and a half hours on 2 cores)
    python bench/validate_local.py --quick         # 8 rows, shorter runs, one run each
    python bench/validate_local.py --traces traces # also keep the measured traces (and their schedules and profiles) there

Steps, for every row of the grid: ``commsim calibrate`` with the row's ranks (timing,
besides its generic benchmarks, the exact GEMM shapes of the row: ``--schedule``), right
before the row runs; generate the schedule, predict it with that profile, run it for
real with ``commsim execute``, calibrate again right after it, predict with the mean
of the two profiles and compare step times. Calibrating around each row keeps
calibration and measurement in the same machine state: a VM's speed drifts over a grid
(its vCPUs share physical cores with other tenants), and one calibration can fall into
a slow minute the run itself does not see; the mean of before and after halves that.
``--before-only`` skips the second. ``--calibrate-once`` calibrates once per rank count
and link instead (faster).

Each row runs twice (``--repeats``), every run between calibrations of its own
(calibrate, run, calibrate, run, calibrate): the row's error compares the mean
prediction with the mean measurement, and every run's own error is printed beside it.
Two pairs average the part of a machine's noise that changes within minutes; the part
that changes over tens of minutes stays, unless ``--interleave`` runs every row once and
then every row again, each run between two calibrations of its own (one more a row), so
a row's two runs lie a whole pass apart. Rows marked ``deepspeed`` run real DeepSpeed
(DS_ACCELERATOR=cpu, gloo) on the same model and config instead of our executor,
timing its steps; their prediction uses host costs that calibrate measured from
DeepSpeed itself (on a different, tiny model). Rows with FSDP2 settings (``fsdp``) run
real PyTorch FSDP2 (runtime/examples/fsdp_train.py, gloo) with those settings instead,
timing its steps, and are predicted with ``--strategy fsdp2`` and FSDP2's hook costs
timed once at the start, as ``calibrate --fsdp2-host-costs`` times them; an ``fsdp1`` row
runs and predicts FSDP1 (``FullyShardedDataParallel``) the same way. Rows marked
``slow-link`` / ``fast-link`` run the two ranks in separate network namespaces joined by
a veth pair rate-limited with tc (root only), each calibrated over that link.

Each row also reports the error of each phase of the step as wall time (forward,
backward with recompute, the optimizer step; boundaries as a training script's timer
sees them: ``commsim.report.compare.phase_times``) and of the total communication time
(executor rows), and the per-op median and p90 error; executor rows also split the
communication into the collectives' own time and the ranks' waits for their peers
(``commsim.report.compare.comm_split``); a framework's rows also report
each phase's fresh host pages a step, the simulated heap's against the minor page
faults the run counted; and what else the machine ran beside each run and calibration
(``bench/machine_load.py``: the share of CPU time other processes used, the share the
hypervisor stole and, in a VM that reports freed memory to its host, the MiB reported
meanwhile), so a row measured on a busy machine is not read as a model error. In such
a VM every run and calibration first waits until the guest's passes report no more than
an idle guest's few MiB (``machine_load.settle``; ``--no-settle`` starts at once): the
gigabytes a calibration or a run frees would otherwise be reported during the next
one (traces/README.md, "The guest's unreported memory").
Measured figures are the median over the measured steps everywhere; a per-rank
prediction's step, each of its phases, ops and communication are medians over its seeded steps. Ends with two lines:
``median |error| = X%  max |error| = Y%  rows = N`` (step time) and
``phases: median |error| = X%  max |error| = Y%  rows = N``. The history of
grid runs, and what each showed, is in traces/README.md.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is imported

from commsim.api import build_schedule, predict  # noqa: E402
from commsim.hardware.profile_doc import mean_profile  # noqa: E402
from commsim.ir.errors import CommsimInputError  # noqa: E402
from commsim.ir.serialize import save_schedule  # noqa: E402
from runtime.calibrate_ds import FIELDS as DS_FIELDS, merge_host_costs  # noqa: E402
from runtime.fsdp1_host_costs import measure_for_profile as measure_fsdp1_hooks  # noqa: E402
from runtime.fsdp2_host_costs import measure_for_profile as measure_fsdp2_hooks  # noqa: E402

from linked_namespaces import LinkedNamespaces  # noqa: E402
from local_grid import GRID, LINK_RATE, Row, row_config, row_key, scenario  # noqa: E402
from local_runs import commsim, fsdp2_args, measure_deepspeed, measure_executor, measure_fsdp2  # noqa: E402
from machine_load import between, load_line, settle, snapshot  # noqa: E402
from local_report import (EXECUTOR_WARMUP, MANIFEST, MEASURED_STEPS,  # noqa: E402
                          fresh_pages, measured_phases, median_step_s, report_row, report_totals, reported_pages,
                          stored_step_s)


@dataclass
class RowState:
    """One row's files and what its runs so far gave (mutable: filled run by run)."""
    i: int
    row: Row
    cfg_path: Path
    first: Path | None = None  # the calibration before the first run
    after: Path | None = None  # the calibration after the latest run
    sc: object = None
    schedule: object = None
    sched_path: Path | None = None
    preds: list = field(default_factory=list)
    meass: list = field(default_factory=list)
    phase_runs: dict = field(default_factory=dict)  # phase -> (predicted, measured) per run
    page_runs: dict = field(default_factory=dict)  # a framework's fresh pages, the same way
    reported_runs: dict = field(default_factory=dict)  # the executor's reported pages (a VM)
    op_pcts: list = field(default_factory=list)
    run_loads: list = field(default_factory=list)  # the machine beside each run
    cal_loads: list = field(default_factory=list)  # the machine beside each calibration
    settles: list = field(default_factory=list)  # waits for the guest's page reporting


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="8 rows (no 4-rank, DeepSpeed or FSDP2 rows), 2 measured steps")
    ap.add_argument("--traces", help="copy each row's measured trace into this folder")
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--only", help="comma-separated runners to keep: executor, deepspeed, fsdp2, fsdp1, slow-link, "
                    "fast-link")
    ap.add_argument("--row", action="append", default=[], metavar="NAME",
                    help="keep only the row of this name (repeatable), e.g. --row 'small z2'")
    ap.add_argument("--calibrate-once", action="store_true",
                    help="one calibration per rank count and link before the rows, not one per row")
    ap.add_argument("--no-settle", action="store_true",
                    help="start each run and calibration at once, without waiting for the guest's page "
                         "reporting to settle (machine_load.settle; a VM whose balloon takes freed memory)")
    ap.add_argument("--before-only", action="store_true",
                    help="calibrate each row only before it runs (default: before and after, and predict with the "
                         "mean of the two, so one slow minute of the machine counts half)")
    ap.add_argument("--repeats", type=int, metavar="N",
                    help="run each row N times, each run between two calibrations of its own (calibrate, run, "
                         "calibrate, run, ..., calibrate), and compare the means (default 2; 1 with --quick)")
    ap.add_argument("--interleave", action="store_true",
                    help="run every row once, then every row again (each run between calibrations of its own: "
                         "calibrate, run, calibrate), so a row's runs lie a whole pass apart; a row's error then "
                         "does not rest on one stretch of the machine's state (one calibration more a row)")
    args = ap.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: must be at least 1")
    rows = [r for r in GRID if not (args.quick and (r.ranks > 2 or r.runner == "deepspeed" or r.fsdp is not None))]
    if args.skip_deepspeed:
        rows = [r for r in rows if r.runner != "deepspeed"]
    if args.only:
        rows = [r for r in rows if r.runner in args.only.split(",")]
    if args.row:
        unknown = sorted(set(args.row) - {r.name for r in GRID})
        if unknown:
            ap.error(f"--row {unknown[0]!r}: not a row of the grid; rows: {', '.join(r.name for r in GRID)}")
        rows = [r for r in rows if r.name in args.row]
    if os.geteuid() != 0 and any(r.runner in LINK_RATE for r in rows):
        print("not root: the slow-link / fast-link rows (network namespaces) are skipped", flush=True)
        rows = [r for r in rows if r.runner not in LINK_RATE]
    steps = 2 if args.quick else MEASURED_STEPS
    work = Path(tempfile.mkdtemp(prefix="commsim-validate-"))
    # which row each numbered file belongs to, for bench/repredict_local.py
    (work / MANIFEST).write_text(json.dumps({"rows": [r.name for r in rows], "repeats": args.repeats,
                                             "calibrate_once": args.calibrate_once,
                                             "before_only": args.before_only, "interleave": args.interleave}, indent=1))
    profiles: dict = {}
    t0 = time.time()
    # Each row's GEMM shapes, so calibration times the very kernels the rows will run
    # (calibrate --schedule); host costs do not change shapes, so no profile is needed yet.
    shape_files: dict = {}
    row_shapes: list[list[str]] = []
    for i, row in enumerate(rows):
        sc = scenario(row, row_config(row))
        path = work / f"shapes{i}.json"
        save_schedule(build_schedule(sc)[0], path)
        shape_files.setdefault(row_key(row), []).extend(["--schedule", str(path)])
        row_shapes.append(["--schedule", str(path)])
    links: dict[str, LinkedNamespaces] = {}
    for kind in sorted({r.runner for r in rows if r.runner in LINK_RATE}):
        links[kind] = LinkedNamespaces(kind.split("-")[0], LINK_RATE[kind]).__enter__()
        atexit.register(links[kind].__exit__, None, None, None)  # namespaces go even if a row fails

    def calibrate(key, out: Path, shapes: list[str]) -> None:
        """key: a rank count (loopback ranks) or a link runner (ranks in namespaces)."""
        if key in LINK_RATE:
            links[key].run_ranks(["calibrate", "-o", str(out), *shapes])
        else:
            commsim("calibrate", "--nproc-per-node", str(key), "-o", str(out), *shapes)

    host_costs = None
    if any(r.runner == "deepspeed" for r in rows):
        # DeepSpeed's own per-hook Python costs: measured once (they run DeepSpeed itself)
        print("measuring DeepSpeed's host costs ...", flush=True)
        base = work / "profile-deepspeed.json"
        commsim("calibrate", "--nproc-per-node", "2", "--deepspeed-host-costs", "-o", str(base))
        measured = json.loads(base.read_text())["host_costs"]
        host_costs = {k: v for k, v in measured.items() if k in DS_FIELDS}  # each row keeps its own launches
        host_costs["source"] = "DeepSpeed's routines timed by commsim calibrate --deepspeed-host-costs"
    fsdp2_costs = fsdp1_costs = None
    if any(r.fsdp is not None and not r.fsdp1 for r in rows):
        # FSDP2's per-hook Python: measured once, as calibrate --fsdp2-host-costs does
        print("measuring FSDP2's host costs ...", flush=True)
        fsdp2_costs = measure_fsdp2_hooks(log=lambda m: None)
    if any(r.fsdp1 for r in rows):
        print("measuring FSDP1's host costs ...", flush=True)
        fsdp1_costs = measure_fsdp1_hooks(log=lambda m: None)
    if args.calibrate_once:
        for key in sorted({row_key(r) for r in rows}, key=str):
            profiles[key] = work / f"profile-{key}.json"
            print(f"calibrating {key} ...", flush=True)
            calibrate(key, profiles[key], shape_files.get(key, []))
    results = []
    print(f"{'row':<34}{'ranks':>6}{'predicted s':>13}{'measured s':>12}{'error':>9}"
          + ("   (each run)" if args.repeats > 1 else ""), flush=True)
    def with_host_costs(row: Row, profile: Path) -> None:
        costs = (host_costs if row.runner == "deepspeed" else fsdp1_costs if row.fsdp1
                 else fsdp2_costs if row.fsdp is not None else None)
        if costs:
            obj = json.loads(profile.read_text())
            obj["host_costs"] = merge_host_costs(obj.get("host_costs"), costs)
            profile.write_text(json.dumps(obj, indent=1))

    def measure(row: Row, cfg_path: Path, sched_path: Path, out: Path) -> float:
        if row.runner == "deepspeed":
            return measure_deepspeed(row, cfg_path, out, steps)
        if row.fsdp is not None and row.runner in LINK_RATE:
            links[row.runner].run_ranks(fsdp2_args(row, cfg_path, out, steps), module="runtime.examples.fsdp_train")
            return stored_step_s(row, out)
        if row.fsdp is not None:
            return measure_fsdp2(row, cfg_path, out, steps)
        if row.runner in LINK_RATE:
            links[row.runner].run_ranks(["execute", str(sched_path), "--steps", str(steps),
                                         "--warmup", str(EXECUTOR_WARMUP), "-o", str(out)])
            return median_step_s(out)
        return measure_executor(row, sched_path, out, steps)

    def settled(state: RowState, what: str) -> None:
        """Let the guest report what the last run or calibration freed above what it keeps
        (machine_load.settle) before the next one measures."""
        if not args.no_settle:
            waited, mib = settle()
            if waited:
                state.settles.append(f"{what} {waited:.0f} s/{mib:.0f} MiB")

    def calibrated(state: RowState, name: str) -> Path:
        path = work / f"profile{state.i}{name}.json"
        settled(state, "calibration")
        before = snapshot()
        calibrate(row_key(state.row), path, row_shapes[state.i])
        state.cal_loads.append(between(before, snapshot()))
        with_host_costs(state.row, path)
        return path

    def start_row(i: int, row: Row) -> RowState:
        """The row's config, first calibration and schedule."""
        cfg_path = work / f"{'fsdp' if row.fsdp is not None else 'ds'}{i}.json"
        cfg_path.write_text(json.dumps(row_config(row)))
        state = RowState(i, row, cfg_path)
        if args.calibrate_once:  # a copy: a DeepSpeed row's host costs must not reach the next row
            first = work / f"profile{i}.json"
            shutil.copy(profiles[row_key(row)], first)
            with_host_costs(row, first)
        else:
            first = calibrated(state, "")
        state.first = first
        # the executor's rows replay the schedule as a GPU runs it; DeepSpeed's and FSDP2's
        # are the frameworks' own runs (their async_op=False collectives block the host)
        runner = "framework" if row.runner == "deepspeed" or row.fsdp is not None else "executor"
        state.sc = scenario(row, str(cfg_path), hw_profile=str(first), runner=runner)
        state.schedule = build_schedule(state.sc)[0]
        state.sched_path = work / f"sched{i}.json"
        save_schedule(state.schedule, state.sched_path)
        return state

    def run_once(state: RowState, k: int) -> None:
        """Run ``k`` of the row between the calibrations around it, predicted from their mean."""
        row, i = state.row, state.i
        tag = "" if k == 0 else f".{k + 1}"
        # the machine's state right before the run: the first calibration; then, in a row's
        # own sitting, the calibration after the previous run, and interleaved, a new one
        if args.calibrate_once or k == 0:
            before = state.first
        elif args.interleave:
            before = calibrated(state, f".before{tag}")
        else:
            before = state.after
        out = work / f"measured{i}{tag}.json"
        settled(state, "run")
        load_before = snapshot()
        state.meass.append(measure(row, state.cfg_path, state.sched_path, out))
        state.run_loads.append(between(load_before, snapshot()))
        after = None
        if not args.calibrate_once and (not args.before_only or (not args.interleave and k + 1 < args.repeats)):
            after = state.after = calibrated(state, f".after{tag}")
        profile = before
        if after is not None and not args.before_only:
            # the machine's state around the run: the mean of a calibration before and after
            try:
                mean = mean_profile(json.loads(before.read_text()), json.loads(after.read_text()))
            except CommsimInputError as e:  # a calibration that measured other sizes: keep the first
                print(f"  ({row.name}: before/after profiles not averaged: {e})", flush=True)
            else:
                profile = work / f"profile{i}.mean{tag}.json"
                profile.write_text(json.dumps(mean, indent=1))
        # the executor's rows pay its own per-op costs; DeepSpeed's and FSDP2's do not
        prediction = predict(replace(state.sc, hw_profile=str(profile)))
        state.preds.append(prediction.metrics.step_time_s)
        ph_pred, ph_meas, ops = measured_phases(row, out, prediction.trace())
        for p, v in ph_meas.items():
            state.phase_runs.setdefault(p, []).append((ph_pred[p], v))
        for p, v in fresh_pages(row, out, prediction).items():
            state.page_runs.setdefault(p, []).append(v)
        for p, v in reported_pages(row, out, prediction, profile).items():
            state.reported_runs.setdefault(p, []).append(v)
        state.op_pcts.append(ops)
        if args.interleave and k + 1 < args.repeats:
            m, pr = state.meass[-1], state.preds[-1]
            print(f"  pass {k + 1}/{args.repeats}: {row.name}: predicted {pr:.3f} s, measured {m:.3f} s, "
                  f"{(pr - m) / m:+.1%}", flush=True)
        if k == 0 and row.runner != "deepspeed" and row.fsdp is None and args.traces:
            dest = Path(args.traces)
            dest.mkdir(parents=True, exist_ok=True)
            from commsim.ir.trace import Trace

            stem = row.name.replace(" ", "_")
            Trace.load(out).save(dest / f"{stem}.json.gz")
            shutil.copy(profile, dest / f"{stem}.profile.json")
            save_schedule(state.schedule, dest / f"{stem}.schedule.json.gz")  # what the trace measured

    single_errs: list[float] = []
    phase_errs: list[float] = []  # signed error of every phase (and communication) of every row
    phase_rows: list[str] = []  # the rows that reported phases

    def finish_row(state: RowState) -> None:
        row_err, run_errs, ph_err = report_row(state.row, state.preds, state.meass, state.phase_runs, state.op_pcts,
                                               args.repeats, state.page_runs, state.reported_runs)
        line = load_line(state.run_loads, state.cal_loads)
        if line and state.settles:
            line += ("\n    waited for the guest's page reporting before each (seconds/MiB reported): "
                     + ", ".join(state.settles))
        if line:
            print(line, flush=True)
            (work / f"load{state.i}.txt").write_text(line.strip() + "\n")  # for bench/repredict_local.py
        results.append((state.row, statistics.fmean(state.preds), statistics.fmean(state.meass), row_err))
        single_errs.extend(run_errs)
        phase_errs.extend(ph_err.values())
        if ph_err:
            phase_rows.append(state.row.name)

    if args.interleave:
        # every row once, then every row again in the same order: a row's runs lie a whole
        # pass apart, so a slow quarter of an hour of the machine falls on one of them only
        states: list[RowState] = []
        for k in range(args.repeats):
            for i, row in enumerate(rows):
                if k == 0:
                    states.append(start_row(i, row))
                run_once(states[i], k)
                if k + 1 == args.repeats:
                    finish_row(states[i])
    else:
        for i, row in enumerate(rows):
            state = start_row(i, row)
            for k in range(args.repeats):
                run_once(state, k)
            finish_row(state)
    print(f"(took {time.time() - t0:.0f} s; work files in {work})")
    report_totals([e for *_, e in results], single_errs, phase_errs, len(phase_rows), args.repeats)


if __name__ == "__main__":
    main()
