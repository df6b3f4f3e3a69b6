"""What the local validation reads from a row's run and how it reports it: the measured
step and phases (the executor's trace, or a framework's timings less its warm-up steps),
the fresh host pages a framework's run faulted beside those its prediction wrote, each
row's lines and the closing lines. Shared by bench/validate_local.py (which runs the
rows) and bench/repredict_local.py (which predicts a kept folder's runs again)."""

from __future__ import annotations

import json
import resource
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from validate_local import Row

    from commsim.api import Prediction

# Steady state only. The executor's first measured step after a single warm-up step is
# slower than the next ones (first-touch page faults of freshly allocated buffers), so
# two warm-up steps. Real DeepSpeed records its module trace in steps 0-1 and allocates
# the optimizer state lazily in its first step(); its step times settle from step 3 on.
EXECUTOR_WARMUP = 2
DEEPSPEED_WARMUP = 3
# FSDP2 initialises lazily in its first forward and AdamW its state in the first step()
FSDP2_WARMUP = 2
# Measured steps a run. A row's step is the median of its measured steps, and on this
# VM a framework's steps spread 1.2-1.6 s within one run (DS small z3; in some runs two
# modes 0.4 s apart): resampling a 20-step run's steps, the median of 5 wanders by
# 5.1% (one standard deviation), of 12 by 3.1%, of 16 by 2.6% (traces/README.md,
# "How many steps a run"). Twelve keep that sampling error well below the grid's 5%
# bar for a few seconds a run.
MEASURED_STEPS = 12
# the work folder's list of the rows it measured, in the order of its numbered files
MANIFEST = "rows.json"


def framework_warmup(row: "Row") -> int:
    """Steps a framework row's run times before its measured ones."""
    return DEEPSPEED_WARMUP if row.runner == "deepspeed" else FSDP2_WARMUP


def median_step_s(trace: Path) -> float:
    """The median measured step of an executor trace, in seconds."""
    return statistics.median(json.loads(trace.read_text())["meta"]["extra"]["step_times_ns"]) / 1e9


def stored_step_s(row: "Row", out: Path) -> float:
    """The median measured step of a row's run from what the run wrote: the executor's
    trace, or the framework's timings less its warm-up steps."""
    if row.runner == "deepspeed" or row.fsdp is not None:
        return statistics.median(json.loads(out.read_text())["step_times_s"][framework_warmup(row):])
    return median_step_s(out)


# ds_train's and fsdp_train's phase names (its timer's boundaries: forward, backward, engine.step)
_DS_PHASES = {"forward": "forward", "backward": "backward", "step": "optimizer"}


def measured_phases(row: "Row", out: Path, pred_trace) -> tuple[dict[str, float], dict[str, float],
                                                              dict[str, float]]:
    """(predicted, measured) wall time of each phase of the step, and of communication
    where the run recorded its collectives, in seconds (measured: the median over the
    measured steps), and the per-op error percentiles (executor runs), with the GEMMs'
    time a step predicted and measured (``gemm_pred_s``, ``gemm_meas_s``): an error the
    GEMMs share is the machine's speed during the run against its calibrations'; and the
    communication's split into the collectives' own time and the ranks' waits for their
    peers (``own_pred_s``, ``own_meas_s``, ``wait_pred_s``, ``wait_meas_s``: compare's
    ``comm_split``). A noisy prediction's phases, ops and communication are medians over
    its seeded steps (the trace's ``step_samples``: ``report.compare``), as the measured
    ones are over the run's steps; without samples, the one predicted step's."""
    from commsim.ir.trace import Trace
    from commsim.report.compare import compare, phase_times, sampled_phase_times

    samples = pred_trace.meta.get("step_samples")
    if samples:
        predicted = {p: ns / 1e9 for p, ns in sampled_phase_times(samples, 0).items()}
    else:
        pred_records = [r for r in pred_trace.records if r.rank == 0 and r.step == 0]
        predicted = {p: ns / 1e9 for p, ns in phase_times(pred_records).items()}
    if row.runner == "deepspeed" or row.fsdp is not None:
        warmup = framework_warmup(row)
        obj = json.loads(out.read_text())["phase_times_s"]
        measured = {_DS_PHASES[k]: statistics.median(v[warmup:]) for k, v in obj.items()}
        return predicted, measured, {}
    c = compare(pred_trace, Trace.load(out))
    predicted["communication"] = c.predicted_comm_ns / 1e9
    measured = {p: ns / 1e9 for p, ns in c.measured_phase_ns.items()}
    ops = c.percentiles()
    gemm = c.busy_by_kind().get("gemm")
    if ops and gemm and gemm[1]:
        ops["gemm_pred_s"], ops["gemm_meas_s"] = gemm[0] / 1e9, gemm[1] / 1e9
    if ops and c.measured_comm_split_ns[0]:
        (ops["own_pred_s"], ops["wait_pred_s"]), (ops["own_meas_s"], ops["wait_meas_s"]) = (
            (x / 1e9 for x in c.predicted_comm_split_ns), (x / 1e9 for x in c.measured_comm_split_ns))
    return predicted, measured, ops



# the simulator's phases as a framework's timer sees them (recompute runs in backward)
_SIM_PHASES = {"fwd": "forward", "bwd": "backward", "recompute": "backward", "optimizer": "optimizer"}


def fresh_pages(row: "Row", out: Path, prediction: "Prediction") -> dict[str, tuple[float, float]]:
    """A framework's run: each phase's fresh host pages a step, in MiB, as (predicted,
    measured): what the simulated heap handed its allocations fresh (rank 0) beside the
    minor page faults the run counted (the median over its measured steps). Empty for
    the executor's rows and for runs that did not count faults."""
    if row.runner != "deepspeed" and row.fsdp is None:
        return {}
    faults = json.loads(out.read_text()).get("phase_minor_faults")
    if not faults:
        return {}
    warmup = framework_warmup(row)
    page = resource.getpagesize()
    measured = {_DS_PHASES[k]: statistics.median(v[warmup:]) * page / 2**20 for k, v in faults.items() if v[warmup:]}
    predicted = _mib_by_phase(prediction.result.ranks[0].fresh_page_bytes)
    return {p: (predicted.get(p, 0.0), measured[p]) for p in measured}


def _mib_by_phase(nbytes_by_phase: dict[str, int]) -> dict[str, float]:
    """The simulator's bytes by phase, in MiB by the phases a run's timer sees."""
    out: dict[str, float] = {}
    for phase, nbytes in nbytes_by_phase.items():
        name = _SIM_PHASES.get(phase, phase)
        out[name] = out.get(name, 0.0) + nbytes / 2**20
    return out


def reported_pages(row: "Row", out: Path, prediction: "Prediction", profile: Path) -> dict[str, tuple[float, float]]:
    """The executor's run on a VM that reports free memory (the profile measured it):
    each phase's large blocks on reported pages a step, in MiB, as (predicted, measured):
    what the simulator priced as reported (rank 0) beside the bytes the run's large
    allocations took at the slow rate, each allocation's share of them from its rate
    between the profile's first touch and first touch plus the reported pages' extra
    (rank 0, the mean over its measured steps). Empty elsewhere."""
    from commsim.hardware.profile import GLIBC_MMAP_THRESHOLD_MAX_BYTES
    from commsim.ir.trace import Trace

    alloc = json.loads(profile.read_text()).get("alloc", {})
    extra = alloc.get("reported_page_extra_ns_per_byte", 0.0)
    if row.runner == "deepspeed" or row.fsdp is not None or extra <= 0:
        return {}
    fast = alloc.get("first_touch_ns_per_byte", 0.0)
    measured: dict[str, float] = {}
    steps = set()
    for r in Trace.load(out).records:
        if r.rank != 0 or r.step < EXECUTOR_WARMUP:
            continue
        steps.add(r.step)
        if r.kind == "alloc" and r.size_bytes >= GLIBC_MMAP_THRESHOLD_MAX_BYTES:
            share = min(1.0, max(0.0, ((r.end_ns - r.start_ns) / r.size_bytes - fast) / extra))
            name = _SIM_PHASES.get(r.phase, r.phase)
            measured[name] = measured.get(name, 0.0) + share * r.size_bytes / 2**20
    predicted = _mib_by_phase(prediction.result.ranks[0].reported_page_bytes)
    n = max(1, len(steps))
    return {p: (predicted.get(p, 0.0), measured.get(p, 0.0) / n) for p in sorted(set(predicted) | set(measured))}


def report_row(row: "Row", preds: list[float], meass: list[float], phase_runs: dict[str, list[tuple[float, float]]],
               op_pcts: list[dict[str, float]], repeats: int,
               page_runs: dict[str, list[tuple[float, float]]] | None = None,
               reported_runs: dict[str, list[tuple[float, float]]] | None = None,
               ) -> tuple[float, list[float], dict[str, float]]:
    """Print a row's line, its phases line, (a framework's runs) its fresh pages line and
    (the executor's, on a VM that reports free memory) its reported pages line; return
    its error (mean prediction against mean measurement), each run's own error and each
    phase's error."""
    pred, meas = statistics.fmean(preds), statistics.fmean(meass)
    err = (pred - meas) / meas
    run_errs = [(p - m) / m for p, m in zip(preds, meass)]
    each = ", ".join(f"{e:+.1%}" for e in run_errs)
    print(f"{row.name:<34}{row.ranks:>6}{pred:>13.3f}{meas:>12.3f}{err:>+9.1%}"
          + (f"   ({each})" if repeats > 1 else ""), flush=True)
    # each phase's mean prediction against its mean measurement, as for the step
    ph_err = {p: (statistics.fmean(a for a, _ in v) - statistics.fmean(b for _, b in v))
              / statistics.fmean(b for _, b in v) for p, v in phase_runs.items() if statistics.fmean(b for _, b in v)}
    ops = [o for o in op_pcts if o]
    print("    phases: " + ", ".join(f"{p} {e:+.1%}" for p, e in ph_err.items())
          + (f"; per op: median {statistics.fmean(o['p50'] for o in ops):+.0%}, "
             f"p90 {statistics.fmean(o['p90'] for o in ops):+.0%}" if ops else ""), flush=True)
    gemms = [o for o in ops if "gemm_meas_s" in o]
    if gemms:
        print("    GEMMs, ms a step (predicted / measured), each run: " + ", ".join(
            f"{o['gemm_pred_s'] * 1e3:.0f} / {o['gemm_meas_s'] * 1e3:.0f} "
            f"({(o['gemm_pred_s'] - o['gemm_meas_s']) / o['gemm_meas_s']:+.0%})" for o in gemms), flush=True)
    splits = [o for o in ops if "own_meas_s" in o]
    if splits:
        print("    communication, ms a step (predicted / measured), each run: " + ", ".join(
            f"own {o['own_pred_s'] * 1e3:.0f} / {o['own_meas_s'] * 1e3:.0f}, waits for peers "
            f"{o['wait_pred_s'] * 1e3:.0f} / {o['wait_meas_s'] * 1e3:.0f}" for o in splits), flush=True)
    for label, runs in (("fresh pages", page_runs), ("reported pages", reported_runs)):
        if runs:
            print(f"    {label}, MiB a step (predicted / measured): " + ", ".join(
                f"{p} {statistics.fmean(a for a, _ in v):.0f} / {statistics.fmean(b for _, b in v):.0f}"
                for p, v in runs.items()), flush=True)
    return err, run_errs, ph_err


def report_totals(signed: list[float], single_errs: list[float], phase_errs: list[float], phase_rows: int,
                  repeats: int) -> None:
    """The closing lines: each run on its own (with repeats), the rows, the phases."""
    if repeats > 1:
        print("each run on its own: " + error_summary(single_errs) + f"  runs = {len(single_errs)}")
    print(error_summary(signed) + f"  rows = {len(signed)}")
    if phase_errs:
        print("phases: " + error_summary(phase_errs) + f"  rows = {phase_rows}")


def error_summary(signed: list[float]) -> str:
    """Median and max |error|, and the bias: the mean signed error and how many were low."""
    mags = [abs(e) for e in signed]
    low = sum(e < 0 for e in signed)
    return (f"median |error| = {statistics.median(mags):.1%}  max |error| = {max(mags):.1%}  "
            f"mean signed error = {statistics.fmean(signed):+.1%} ({low} of {len(signed)} low)")
