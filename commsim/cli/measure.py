"""Subcommands that measure real runs (need torch): ``execute`` a schedule, ``calibrate``
this machine, ``record`` a training command's collectives, and ``compare`` a prediction
with a measurement (or a recording with a schedule). ``compare`` and ``calibrate
--from-comms-log`` read real runs' own records (``commsim.ingest``) and need no torch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from commsim.cli.common import check_output_folder, check_outputs, need_torch, positive_int
from commsim.cli.export_cmd import check_kineto_folder
from commsim.ir.errors import CommsimInputError
from commsim.ir.load import load_schedule_any


def cmd_execute(args: argparse.Namespace) -> int:
    need_torch("execute")
    check_outputs(("-o", args.output))
    check_kineto_folder(args.kineto)
    from runtime.launch import ExecConfig, execute

    if args.steps < 1 or args.warmup < 0:
        raise CommsimInputError("--steps must be >= 1 and --warmup >= 0")
    cfg = ExecConfig(args.schedule, args.output, args.backend, args.steps, args.warmup, args.check_data,
                     args.timeout)
    trace = execute(cfg, args.nproc_per_node)
    if args.kineto and trace is not None:  # the process that wrote the trace (rank 0 under torchrun)
        from commsim.report.kineto import write_kineto

        write_kineto(trace, args.kineto)
    steps = trace.meta.get("step_times_ns", []) if trace is not None else []
    if steps:
        mean = sum(steps) / len(steps)
        spread = (max(steps) - min(steps)) / 2
        print(f"{args.output}: {len(steps)} measured step(s) after {args.warmup} warm-up: "
              f"{mean / 1e6:.2f} ms +- {spread / 1e6:.2f} ms ({', '.join(f'{s / 1e6:.2f}' for s in steps)})")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.from_comms_log:
        return _calibrate_from_comms_log(args)
    if args.hw_profile or args.ranks:
        raise CommsimInputError(f"{'--hw-profile' if args.hw_profile else '--ranks'} goes with --from-comms-log")
    need_torch("calibrate")
    check_outputs(("-o", args.output))
    from runtime.launch import calibrate

    done = calibrate(args.output, args.backend, args.nproc_per_node, quick=args.quick,
                     schedules=tuple(args.schedule or ()), deepspeed_host_costs=args.deepspeed_host_costs,
                     fsdp2_host_costs=args.fsdp2_host_costs, fsdp1_host_costs=args.fsdp1_host_costs,
                     log=lambda m: print(f"calibrate: {m}", flush=True))
    if done.from_env:
        if done.wrote:
            print(f"{args.output}: hardware profile of {done.ranks} {args.backend} ranks (from the environment)")
        return 0
    print(f"{args.output}: hardware profile of {done.ranks} {args.backend} ranks "
          f"(use: commsim predict --hw-profile {args.output})")
    return 0


def _calibrate_from_comms_log(args: argparse.Namespace) -> int:
    """A base profile with the collective fits DeepSpeed's comms log measured (no torch)."""
    check_outputs(("-o", args.output))
    log_path = args.from_comms_log
    if not args.hw_profile:
        raise CommsimInputError("--from-comms-log needs --hw-profile BASE: the log times collectives only; compute, "
                                "memory and contention come from BASE (a commsim calibrate profile)")
    if args.schedule or args.deepspeed_host_costs or args.fsdp2_host_costs or args.fsdp1_host_costs:
        raise CommsimInputError("--from-comms-log reads a log and measures nothing: leave out --schedule, "
                                "--deepspeed-host-costs, --fsdp2-host-costs and --fsdp1-host-costs")
    from commsim.hardware.profile import INTER_NODE, INTRA_NODE
    from commsim.hardware.profile_doc import profile_from_dict
    from commsim.ingest.comms_logger import (calibration_points, merged_profile, parse_raw, parse_text,
                                             ranks_from_bandwidths)
    from commsim.ingest.detect import Format, detect
    from commsim.util.files import atomic_write_text, read_json

    found = detect(log_path)
    if found.format is not Format.COMMS_LOG or len(found.records) != 1:
        raise CommsimInputError(f"--from-comms-log {log_path}: a {found.format.value}"
                                f"{'' if len(found.records) == 1 else ' folder'}, not one file of DeepSpeed "
                                "comms-logger output")
    content = found.records[0].content
    log = parse_text(content, log_path) if isinstance(content, str) else parse_raw(content, log_path)
    base_doc = read_json(args.hw_profile, CommsimInputError)
    base = profile_from_dict(base_doc, args.hw_profile)
    ranks = args.ranks or ranks_from_bandwidths(log)
    if not ranks:
        raise CommsimInputError(f"--from-comms-log {log_path}: the log does not say how many ranks the job had; "
                                "give --ranks N")
    if ranks < 2:
        raise CommsimInputError(f"--ranks {ranks}: a collective needs at least 2 ranks")
    placement = INTRA_NODE if ranks <= base.ranks_per_node else INTER_NODE
    points, skipped = calibration_points(log, ranks)
    if not points:
        raise CommsimInputError(f"--from-comms-log {log_path}: no all-reduce, all-gather, reduce-scatter or broadcast "
                                f"among the logged ops ({', '.join(sorted(skipped)) or 'none'})")
    doc = merged_profile(base_doc, points, ranks, placement, Path(log_path).name)
    profile_from_dict(doc, args.output)  # what predict will read
    atomic_write_text(args.output, json.dumps(doc, indent=1))
    where = "inside a node" if placement == INTRA_NODE else "across nodes"
    how = ("running sums per op name, differenced into per-op times" if log.cumulative else "per-op times") + \
        (", exact sizes" if log.exact_sizes else ", sizes as printed (rounded to 2 decimals)")
    print(f"{args.output}: {args.hw_profile} with collective fits over {ranks} ranks {where} from {log_path} "
          f"({len(log.ops)} logged ops: {how}; median time per size)")
    for kind, kp in sorted(points.items()):
        fit = kp.fit()
        sizes = f"{len(kp.points)} sizes ({kp.points[0][0]:.0f}-{kp.points[-1][0]:.0f} B)" if len(kp.points) > 1 \
            else f"one size ({kp.points[0][0]:.0f} B: its whole time priced as bandwidth)"
        print(f"  {kind}: {kp.ops} ops at {sizes}: {fit.latency_ns / 1e3:.0f} us + {fit.bytes_per_s / 1e9:.3f} GB/s")
    if skipped:
        print(f"  left out: {', '.join(f'{n} ({c})' for n, c in sorted(skipped.items()))}")
    print("note: DeepSpeed times each op synchronised, alone on its timer, so the log carries no overlap "
          f"information: compute/communication contention stays as {args.hw_profile} measured it")
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    need_torch("record")
    check_output_folder("-o", args.output)
    from commsim.ir.trace import Trace
    from commsim.report.collectives import describe_recording
    from runtime.record_launch import run_recorded

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    out = Path(args.output)
    rc = run_recorded(cmd, out)
    files = sorted(out.glob("rank*.json"))
    for f in files:
        print(f"{f}: {describe_recording(Trace.load(f))}")
    if not files:
        print(f"commsim record: the command sent no collectives (nothing written to {out})", file=sys.stderr)
    if rc != 0:
        print(f"commsim record: the command exited with status {rc}", file=sys.stderr)
    return rc


def _compare_with_comms_log(args: argparse.Namespace, log_record) -> int:
    """PREDICTED COMMS_LOG: each logged collective size against the prediction's."""
    from commsim.ingest.comms_compare import compare_log, format_rows, job_ranks, summary
    from commsim.ingest.comms_logger import parse_raw, parse_text
    from commsim.ingest.load import load_trace

    pred = load_trace(args.first)
    content = log_record.content
    log = parse_text(content, args.second) if isinstance(content, str) else parse_raw(content, args.second)
    rows = compare_log(pred, log, args.rank)
    if args.json:
        med, worst, n = summary(rows)
        print(json.dumps({"ranks": job_ranks(pred), "sizes": [r.to_json() for r in rows],
                          "median_abs_error_frac": med, "max_abs_error_frac": worst, "sizes_compared": n,
                          "note": "logged ops ran synchronised, alone: no overlap; predicted ones ran in the step"},
                         indent=1))
        return 0
    print(format_rows(rows, job_ranks(pred)))
    return 0


def _compare_traces(args: argparse.Namespace) -> int:
    from commsim.ingest.detect import Format, detect
    from commsim.ingest.load import align_to_prediction, as_prediction, load_trace
    from commsim.ir.trace import TraceSource
    from commsim.report.compare import compare, format_comparison

    second = detect(args.second)
    if second.format is Format.COMMS_LOG and len(second.records) == 1:
        return _compare_with_comms_log(args, second.records[0])
    pred, meas = load_trace(args.first), load_trace(args.second)
    if pred.meta.schedule_hash and meas.meta.schedule_hash and pred.meta.schedule_hash != meas.meta.schedule_hash:
        print("commsim: warning: the two traces come from different schedules (schedule hashes differ)",
              file=sys.stderr)
    if pred.meta.source is TraceSource.RECORDED:  # a real job's step stands for the prediction
        pred = as_prediction(pred, args.rank)
    alignment = None
    if meas.meta.source is TraceSource.RECORDED:  # a real job's ops: matched by their collectives
        alignment = align_to_prediction(pred, meas, args.rank)
        meas = alignment.trace
    try:
        c = compare(pred, meas, args.rank)
    except ValueError as e:
        raise CommsimInputError(f"{args.first} vs {args.second}: {e}") from None
    if args.json:
        out = c.to_json()
        if alignment is not None:
            out["recorded_steps_aligned"] = list(alignment.steps_matched)
            out["recorded_steps_differing"] = list(alignment.steps_differing)
        print(json.dumps(out, indent=1))
        return 0
    print(format_comparison(c))
    if alignment is not None:
        print(alignment.describe())
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    if not args.collectives:
        return _compare_traces(args)
    from commsim.ingest.load import load_collectives
    from commsim.report.collectives import format_match, recorded_sequence, schedule_sequence, strict_match

    if args.min_steps < 1:
        raise CommsimInputError(f"--min-steps {args.min_steps}: must be >= 1")
    trace = load_collectives(args.first, args.rank)
    steps_known = bool(trace.meta.get("steps_known", True))
    recorded = recorded_sequence(trace)
    schedule = load_schedule_any(args.second)
    if not 0 <= args.rank < schedule.world_size:
        raise CommsimInputError(f"--rank {args.rank}: {args.second} has ranks 0-{schedule.world_size - 1}")
    m = strict_match(schedule_sequence(schedule, args.rank), recorded, args.min_steps, steps_known)
    d = m.difference
    if not m.ok and d is not None and d.expected and d.recorded and trace.meta.producer.startswith(
            "torch Flight Recorder") and d.expected[0] == "reduce_scatter" and d.recorded[0] == "all_reduce" \
            and d.expected[1:] == d.recorded[1:]:
        print("commsim: note: gloo carries out a reduce-scatter as an all-reduce of the same bytes and its Flight "
              "Recorder records it so; a dump with stacks (torch's _dump_fr_trace, a pickle) shows the call",
              file=sys.stderr)
    if args.json:
        print(json.dumps(m.to_json()))
        return 0 if m.ok else 1
    print(format_match(m))
    return 0 if m.ok else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("execute", help="run a schedule for real through torch.distributed and measure it",
                       description="Run SCHEDULE on every rank (gloo on CPUs, NCCL with CUDA streams on GPUs): real "
                       "buffers, kernels and collectives, per-op timestamps, written as a measured trace by rank 0. "
                       "Under torchrun / srun it uses that environment; alone it starts the ranks itself. Needs torch.")
    p.add_argument("schedule", help="schedule file")
    p.add_argument("--nproc-per-node", type=positive_int, help="local ranks to start (default: the schedule's size)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="gloo (CPU, default) or nccl (GPU)")
    p.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps, not measured (default 1)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a collective may wait for its peers before the run fails (default 60)")
    p.add_argument("--check-data", action="store_true",
                   help="fill collectives with known values and check every result (small schedules)")
    p.add_argument("-o", "--output", default="measured.json", help="measured trace (default measured.json)")
    p.add_argument("--kineto", metavar="DIR",
                   help="also write the measured steps as PyTorch profiler (Kineto) traces, DIR/rank<N>.pt.trace.json "
                   "for every rank, for HTA, Perfetto and TensorBoard (gloo's streams as GPU streams; DIR: new or "
                   "empty)")
    p.set_defaults(func=cmd_execute)

    p = sub.add_parser("calibrate", help="measure this machine into a hardware profile for predict --hw-profile",
                       description="Micro-benchmarks with the same backend and kernels the executor uses: GEMM "
                       "throughput by size, memory-bound bandwidth, each collective kind's latency and bandwidth, "
                       "compute/communication contention, executor overheads, allocation costs. Needs torch.")
    p.add_argument("--nproc-per-node", type=positive_int, default=2, help="local ranks (default 2)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="gloo (CPU, default) or nccl (GPU)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and shorter timings (tests)")
    p.add_argument("--schedule", action="append", metavar="FILE",
                   help="also time the exact GEMM shapes of this schedule, in its precision (repeatable); "
                   "predictions of it then use them instead of a rate by flops")
    p.add_argument("--deepspeed-host-costs", action="store_true",
                   help="also measure real DeepSpeed's hook costs on this machine (runs it in 12 processes, "
                   "about two minutes; needs deepspeed)")
    p.add_argument("--fsdp2-host-costs", action="store_true",
                   help="also measure PyTorch FSDP2's host time per hook call on this machine (three processes, "
                   "about half a minute)")
    p.add_argument("--fsdp1-host-costs", action="store_true",
                   help="also measure PyTorch FSDP1's host time per hook call on this machine (three processes, "
                   "about half a minute)")
    p.add_argument("--from-comms-log", metavar="LOG",
                   help="measure nothing: take the collectives' fits from DeepSpeed's comms-logger output (its per-op "
                   "lines, or get_raw_data() saved as JSON) over BASE's; needs --hw-profile BASE, not torch")
    p.add_argument("--hw-profile", metavar="BASE",
                   help="with --from-comms-log: the profile whose other figures (compute, memory, contention) are kept")
    p.add_argument("--ranks", type=positive_int,
                   help="with --from-comms-log: the logged job's ranks (the group DeepSpeed's ops ran over); needed "
                   "where the log's bandwidth figures do not tell it")
    p.add_argument("-o", "--output", default="profile.json", help="profile file (default profile.json)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("record", help="run a real training command and record every collective it sends",
                       description="Run CMD (a DeepSpeed / FSDP script, under torchrun or not) with every "
                       "torch.distributed collective recorded (kind, bytes, dtype, group, order, timing, phase, "
                       "step); each rank writes rank<N>.json into the output folder. Needs torch.")
    p.add_argument("-o", "--output", default="recorded", help="output folder (default ./recorded)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to run")
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("compare", help="prediction vs measurement, or a recording vs a schedule (--collectives)",
                       description="Each input is read by its content: a commsim trace, a torch.profiler trace (a "
                       "file, or a folder of per-rank files), Flight Recorder dumps (a PREFIX<rank> file or a folder "
                       "of them) or a commsim record folder. PREDICTED MEASURED: step-time error, busy time per stream "
                       "and phase, exposed communication, per-op duration errors and the largest discrepancies "
                       "(--json: one object with step_time_error_frac = (predicted - measured) / measured); a real "
                       "job's trace (torch.profiler) is matched op by op through its collectives only. PREDICTED COMMS_LOG "
                       "(DeepSpeed's comms-logger lines or get_raw_data() JSON): each logged collective size's median "
                       "time beside the prediction's collectives of that kind and size (the logged ops ran "
                       "synchronised, alone: no step and no overlap to compare). "
                       "--collectives RECORDED SCHEDULE: does the recorded run end with the schedule's step, "
                       "collective for collective (kind, order, bytes, dtype, group), at least --min-steps times back "
                       "to back with nothing between, covering the recording's last --min-steps steps (a Flight "
                       "Recorder dump has no step numbers: the repetitions suffice)? Exit 0 if it does, 1 if not (the "
                       "line names the first difference).")
    p.add_argument("first", help="predicted trace (or, with --collectives, a recording: commsim record folder or "
                   "trace, torch.profiler trace, Flight Recorder dump(s))")
    p.add_argument("second", help="measured trace: commsim execute's or a torch.profiler trace, or DeepSpeed's "
                   "comms log (or, with --collectives, a schedule file)")
    p.add_argument("--collectives", action="store_true", help="compare collective sequences")
    p.add_argument("--rank", type=int, default=0, help="which rank to compare (default 0)")
    p.add_argument("--min-steps", type=int, default=2,
                   help="with --collectives: steady-state steps the schedule's step must equal (default 2)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_compare)
