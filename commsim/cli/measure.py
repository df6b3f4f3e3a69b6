"""Subcommands that measure real runs (need torch): ``execute`` a schedule, ``calibrate``
this machine, ``record`` a training command's collectives, and ``compare`` a prediction
with a measurement (or a recording with a schedule)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from commsim.cli.common import need_torch, positive_int
from commsim.ir.errors import CommsimInputError
from commsim.ir.load import load_schedule_any


def cmd_execute(args: argparse.Namespace) -> int:
    need_torch("execute")
    from runtime.executor import env_rank
    from runtime.launch import ExecConfig, launch_local, worker

    if args.steps < 1 or args.warmup < 0:
        raise CommsimInputError("--steps must be >= 1 and --warmup >= 0")
    schedule = load_schedule_any(args.schedule)
    from commsim.ir.validate import check_valid

    check_valid(schedule, args.schedule)
    cfg = ExecConfig(args.schedule, args.output, args.backend, args.steps, args.warmup, args.check_data,
                     args.timeout)
    env = env_rank()
    if env is not None:  # under torchrun / srun: this process is one rank
        rank, world, local = env
        if world != schedule.world_size:
            raise CommsimInputError(f"{args.schedule}: the schedule has {schedule.world_size} ranks, the launcher "
                                    f"started {world}")
        worker(cfg, rank, world, local, "env://")
        if rank != 0:
            return 0
        from commsim.ir.trace import Trace

        trace = Trace.load(args.output)
    else:
        nproc = args.nproc_per_node or schedule.world_size
        trace = launch_local(cfg, nproc)
    steps = trace.meta.get("step_times_ns", [])
    if steps:
        mean = sum(steps) / len(steps)
        spread = (max(steps) - min(steps)) / 2
        print(f"{args.output}: {len(steps)} measured step(s) after {args.warmup} warm-up: "
              f"{mean / 1e6:.2f} ms +- {spread / 1e6:.2f} ms ({', '.join(f'{s / 1e6:.2f}' for s in steps)})")
    return 0


def _gemm_shapes(paths: list[str]) -> tuple[tuple[str, int, int, int, int], ...]:
    """(dtype, m, n, k, batch) of every GEMM / attention matmul in these schedules."""
    from commsim.ir import ops as O

    out: dict[tuple, None] = {}
    for path in paths:
        schedule = load_schedule_any(path)
        dtype = str(schedule.meta.knob("precision") or "fp32")
        if dtype not in ("fp32", "bf16", "fp16"):
            raise CommsimInputError(f"--schedule {path}: precision {dtype!r} in its meta; allowed: fp32, bf16, fp16")
        for program in schedule.programs:
            for op in program.step:
                if isinstance(op, O.Compute) and op.gemm is not None:
                    out[(dtype, op.gemm.m, op.gemm.n, op.gemm.k, op.gemm.batch)] = None
    return tuple(out)


def cmd_calibrate(args: argparse.Namespace) -> int:
    need_torch("calibrate")
    from runtime.launch import calibrate_local

    from runtime.executor import env_rank

    shapes = _gemm_shapes(args.schedule or [])
    found = env_rank()
    if found is not None:  # one rank of a job someone else launched (torchrun, srun)
        if args.deepspeed_host_costs:
            raise CommsimInputError("--deepspeed-host-costs: run it without torchrun (it launches its own ranks)")
        from runtime.launch import calibrate_env

        calibrate_env(args.backend, args.output, quick=args.quick, shapes=shapes)
        if found[0] == 0:
            print(f"{args.output}: hardware profile of {found[1]} {args.backend} ranks (from the environment)")
        return 0
    nproc = args.nproc_per_node
    calibrate_local(nproc, args.backend, args.output, quick=args.quick, shapes=shapes)
    if args.deepspeed_host_costs:
        from commsim.util.files import atomic_write_text
        from runtime.calibrate_ds import measure_host_costs

        costs = measure_host_costs(nproc, args.output, log=lambda m: print(f"calibrate: {m}", flush=True))
        profile = json.loads(Path(args.output).read_text())
        profile["host_costs"] = costs
        atomic_write_text(args.output, json.dumps(profile, indent=1))
    print(f"{args.output}: hardware profile of {nproc} {args.backend} ranks "
          f"(use: commsim predict --hw-profile {args.output})")
    return 0


# ---------------------------------------------------------------- record / compare


_SITECUSTOMIZE = """# written by commsim record: wrap torch.distributed.ProcessGroup before the framework loads
import runtime.record as _commsim_record
_commsim_record.install_from_env()
"""


def cmd_record(args: argparse.Namespace) -> int:
    import os
    import subprocess
    import tempfile

    from commsim.ir.trace import Trace

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise CommsimInputError("commsim record: give the command to run after --, e.g. "
                                "commsim record -o rec -- torchrun --nproc-per-node 2 train.py")
    out = Path(args.output)
    if out.exists() and any(out.glob("rank*.json")):
        raise CommsimInputError(f"-o {out}: already holds recorded traces; choose an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="commsim-record-") as hook_dir:
        Path(hook_dir, "sitecustomize.py").write_text(_SITECUSTOMIZE)
        env = dict(os.environ)
        # the repository root (so `runtime` imports even when commsim is not installed)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([hook_dir, root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["COMMSIM_RECORD_DIR"] = str(out.resolve())
        try:
            rc = subprocess.run(cmd, env=env).returncode
        except FileNotFoundError:
            raise CommsimInputError(f"commsim record: command not found: {cmd[0]}") from None
    files = sorted(out.glob("rank*.json"))
    for f in files:
        t = Trace.load(f)
        kinds: dict[str, int] = {}
        for r in t.records:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        steps = 1 + max((r.step for r in t.records), default=0)
        desc = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
        print(f"{f}: {len(t.records)} calls over {steps} step(s): {desc}")
    if not files:
        print(f"commsim record: the command sent no collectives (nothing written to {out})", file=sys.stderr)
    if rc != 0:
        print(f"commsim record: the command exited with status {rc}", file=sys.stderr)
    return rc


def _compare_traces(args: argparse.Namespace) -> int:
    from commsim.ir.trace import Trace
    from commsim.report.compare import compare

    pred, meas = Trace.load(args.first), Trace.load(args.second)
    if pred.meta.schedule_hash and meas.meta.schedule_hash and pred.meta.schedule_hash != meas.meta.schedule_hash:
        print("commsim: warning: the two traces come from different schedules (schedule hashes differ)",
              file=sys.stderr)
    try:
        c = compare(pred, meas, args.rank)
    except ValueError as e:
        raise CommsimInputError(f"commsim compare: {e}") from None
    if args.json:
        print(json.dumps(c.to_json(), indent=1))
        return 0
    print(f"step time: predicted {c.predicted_step_ns / 1e6:.2f} ms, measured {c.measured_step_ns / 1e6:.2f} ms "
          f"(+- {c.measured_step_spread_ns / 1e6:.2f}): error {c.step_time_error_frac:+.1%}")
    print(f"{'busy per stream':<22}{'predicted ms':>14}{'measured ms':>14}")
    for s in sorted(set(c.predicted.busy_by_stream) | set(c.measured.busy_by_stream)):
        print(f"  {s:<20}{c.predicted.busy_by_stream.get(s, 0) / 1e6:>14.2f}{c.measured.busy_by_stream.get(s, 0) / 1e6:>14.2f}")
    print(f"{'busy per phase':<22}")
    for s in sorted(set(c.predicted.busy_by_phase) | set(c.measured.busy_by_phase)):
        print(f"  {s:<20}{c.predicted.busy_by_phase.get(s, 0) / 1e6:>14.2f}{c.measured.busy_by_phase.get(s, 0) / 1e6:>14.2f}")
    print(f"  {'communication':<20}{c.predicted.comm_ns / 1e6:>14.2f}{c.measured.comm_ns / 1e6:>14.2f}")
    print(f"  {'exposed comm.':<20}{c.predicted.exposed_comm_ns / 1e6:>14.2f}{c.measured.exposed_comm_ns / 1e6:>14.2f}")
    pc = c.percentiles()
    if pc:
        print(f"per-op duration error over {len(c.op_errors)} ops: p10 {pc['p10']:+.0%}, median {pc['p50']:+.0%}, "
              f"p90 {pc['p90']:+.0%}")
    print("largest discrepancies:")
    for _, p, m, r in c.worst(8):
        print(f"  {p / 1e3:>10.1f} us predicted {m / 1e3:>10.1f} us measured  op {r.op_id} {r.kind} "
              f"{r.size_bytes or ''} \"{r.label}\"")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    if not args.collectives:
        return _compare_traces(args)
    from commsim.report.collectives import align, load_recorded, recorded_sequence, schedule_sequence

    recorded = recorded_sequence(load_recorded(args.first, args.rank))
    schedule = load_schedule_any(args.second)
    expected = schedule_sequence(schedule, args.rank)
    a = align(expected, recorded)
    if args.json:
        print(json.dumps({"match": a.ok, "expected": a.expected, "matches": [list(m) for m in a.matches],
                          "best_start": a.best_start, "best_length": a.best_length,
                          "mismatch": a.mismatch}))
        return 0 if a.ok else 1
    if a.ok:
        where = ", ".join(f"call {i} (step {s})" for i, s in a.matches)
        print(f"match: the schedule's {a.expected} collectives per step occur in the recording at {where}")
        return 0
    exp, rec = a.mismatch or (None, None)
    print(f"no match: the longest agreement is {a.best_length} of {a.expected} collectives from recorded call "
          f"{a.best_start}; then the schedule has {exp} and the recording {rec}")
    return 1


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
                   help="also measure real DeepSpeed's hook costs on this machine (runs it; needs deepspeed)")
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
                       description="PREDICTED MEASURED: step-time error, busy time per stream and phase, exposed "
                       "communication, per-op duration errors and the largest discrepancies (--json: one object "
                       "with step_time_error_frac = (predicted - measured) / measured). "
                       "--collectives RECORDED SCHEDULE: does the schedule's per-step collective sequence (kind, "
                       "order, bytes) occur in the recorded run? Exit 0 if it does, 1 if not.")
    p.add_argument("first", help="predicted trace (or, with --collectives, a recorded trace / record folder)")
    p.add_argument("second", help="measured trace (or, with --collectives, a schedule file)")
    p.add_argument("--collectives", action="store_true", help="compare collective sequences")
    p.add_argument("--rank", type=int, default=0, help="which rank to compare (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_compare)
