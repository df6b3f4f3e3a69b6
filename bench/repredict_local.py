"""Predict a finished local validation again, from the profiles and measurements it kept.

    python bench/repredict_local.py /tmp/commsim-validate-XXXXXXXX                     # every row it measured
    python bench/repredict_local.py /tmp/commsim-validate-XXXXXXXX --row 'DS small z2'

``bench/validate_local.py`` keeps, in its work folder, every row's settings file
(``ds{i}.json`` / ``fsdp{i}.json``), the profile each run was predicted from (the mean of
the calibrations before and after it, ``profile{i}.mean{.k}.json``, or the calibration
before it) and what each run measured (``measured{i}{.k}.json``). This predicts those
runs again with the code as it is now and prints the same table and closing lines, so
a model change is judged against the very same measurements: the machine's noise
between two grid runs, often as large as what a change moves, stays out of the
comparison. Nothing runs but the simulator (a few seconds a run).

The rows are named by the folder's ``rows.json`` (written by validate_local); a folder
without one must hold the grid's rows from the first on (a whole grid, or one that
stopped), checked row by row against each settings file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_report import (MANIFEST, fresh_pages, measured_phases, report_row, report_totals,  # noqa: E402
                          reported_pages, stored_step_s)
from local_grid import GRID, Row, row_config, scenario  # noqa: E402

from commsim.api import predict  # noqa: E402


def folder_rows(work: Path) -> tuple[list[Row], int]:
    """The rows a work folder measured, in the order of its numbered files, and its runs per row."""
    manifest = work / MANIFEST
    if manifest.exists():
        obj = json.loads(manifest.read_text())
        by_name = {r.name: r for r in GRID}
        unknown = [n for n in obj["rows"] if n not in by_name]
        if unknown:
            sys.exit(f"{manifest}: row {unknown[0]!r} is not a row of the grid any more")
        return [by_name[n] for n in obj["rows"]], int(obj["repeats"])
    # an older folder: only the whole grid (or its first rows, where a run stopped) maps
    # to its numbers without a manifest
    rows = []
    for i, row in enumerate(GRID):
        cfg = work / f"{'fsdp' if row.fsdp is not None else 'ds'}{i}.json"
        if not cfg.exists() and rows:
            break
        if not cfg.exists() or json.loads(cfg.read_text()) != row_config(row):
            sys.exit(f"{work}: no {MANIFEST}, and {cfg.name} is not the grid's row {i} ({row.name!r}); "
                     "only a folder of the whole grid (or its first rows) can be read without one")
        rows.append(row)
    repeats = 1
    while (work / f"measured0.{repeats + 1}.json").exists():
        repeats += 1
    return rows, repeats


def run_profile(work: Path, i: int, k: int) -> Path:
    """The profile validate_local predicted run ``k`` of row ``i`` from."""
    tag = "" if k == 0 else f".{k + 1}"
    mean = work / f"profile{i}.mean{tag}.json"
    if mean.exists():
        return mean
    # --before-only or --calibrate-once: the calibration before the run (interleaved runs
    # have one of their own; otherwise it is the previous run's after)
    if k == 0:
        return work / f"profile{i}.json"
    own = work / f"profile{i}.before{tag}.json"
    if own.exists():
        return own
    before = work / f"profile{i}.after{'' if k == 1 else f'.{k}'}.json"
    return before if before.exists() else work / f"profile{i}.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", help="a work folder bench/validate_local.py left (its last line names it)")
    ap.add_argument("--row", action="append", default=[], metavar="NAME", help="only this row (repeatable)")
    ap.add_argument("--host-heap", action="store_true",
                    help="the DeepSpeed and FSDP2 rows' tensors through commsim's model of glibc's heap (predict "
                         "--host-heap); the executor's rows as they are")
    ap.add_argument("--rank-stalls", metavar="PROFILE",
                    help="predict with this profile's rank_stalls in every run's profile (for folders whose "
                         "calibrations did not measure them yet); 'none': with no stalls")
    args = ap.parse_args()
    work = Path(args.work)
    if not work.is_dir():
        ap.error(f"{work}: not a folder")
    rows, repeats = folder_rows(work)
    stalls = None
    if args.rank_stalls and args.rank_stalls != "none":
        stalls = json.loads(Path(args.rank_stalls).read_text()).get("rank_stalls")
        if stalls is None:
            ap.error(f"--rank-stalls {args.rank_stalls}: the profile has no rank_stalls")
    scratch = Path(tempfile.mkdtemp(prefix="commsim-repredict-"))

    def profile_of(i: int, k: int) -> str:
        path = run_profile(work, i, k)
        if not args.rank_stalls:
            return str(path)
        obj = json.loads(path.read_text())
        obj.pop("rank_stalls", None)
        if stalls is not None:
            obj["rank_stalls"] = stalls
        out = scratch / path.name
        out.write_text(json.dumps(obj))
        return str(out)

    unknown = sorted(set(args.row) - {r.name for r in rows})
    if unknown:
        ap.error(f"--row {unknown[0]!r}: not a row this folder measured; rows: {', '.join(r.name for r in rows)}")
    print(f"{'row':<34}{'ranks':>6}{'predicted s':>13}{'measured s':>12}{'error':>9}"
          + ("   (each run)" if repeats > 1 else ""), flush=True)
    signed, single_errs, phase_errs, phase_rows = [], [], [], 0
    for i, row in enumerate(rows):
        if args.row and row.name not in args.row:
            continue
        cfg_path = work / f"{'fsdp' if row.fsdp is not None else 'ds'}{i}.json"
        runner = "framework" if row.runner == "deepspeed" or row.fsdp is not None else "executor"
        # the heap model is of a framework's tensors: the executor's rows keep their own pricing
        sc = scenario(row, str(cfg_path), runner=runner, host_heap=args.host_heap and runner == "framework")
        preds, meass, phase_runs, op_pcts, page_runs, reported_runs = [], [], {}, [], {}, {}
        for k in range(repeats):
            out = work / f"measured{i}{'' if k == 0 else f'.{k + 1}'}.json"
            if not out.exists():
                break  # the run stopped during this row
            meass.append(stored_step_s(row, out))
            prediction = predict(replace(sc, hw_profile=profile_of(i, k)))
            preds.append(prediction.metrics.step_time_s)
            ph_pred, ph_meas, ops = measured_phases(row, out, prediction.trace())
            for p, v in ph_meas.items():
                phase_runs.setdefault(p, []).append((ph_pred[p], v))
            for p, v in fresh_pages(row, out, prediction).items():
                page_runs.setdefault(p, []).append(v)
            for p, v in reported_pages(row, out, prediction, Path(profile_of(i, k))).items():
                reported_runs.setdefault(p, []).append(v)
            op_pcts.append(ops)
        if not preds:
            continue
        err, run_errs, ph_err = report_row(row, preds, meass, phase_runs, op_pcts, repeats, page_runs, reported_runs)
        if (work / f"load{i}.txt").exists():  # what else the machine ran beside the runs (validate_local)
            print("    " + (work / f"load{i}.txt").read_text().strip(), flush=True)
        signed.append(err)
        single_errs += run_errs
        phase_errs += list(ph_err.values())
        phase_rows += 1 if ph_err else 0
    if not signed:
        sys.exit(f"{work}: no row has a measured run")
    report_totals(signed, single_errs, phase_errs, phase_rows, repeats)


if __name__ == "__main__":
    main()
