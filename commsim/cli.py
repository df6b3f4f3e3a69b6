"""The ``commsim`` command line: thin wrappers over the library, one subcommand each.

Bad input (a missing file, an invalid schedule, a flag out of range) ends with exit
status 2 and one line on stderr naming the file, field or flag and what is allowed;
outputs are written atomically, so nothing is half-written.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable, Sequence

from commsim import __version__
from commsim.ir.errors import CommsimInputError
from commsim.ir.load import load_schedule_any

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (and still exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CommsimInputError(f"{self.prog}: {message} (see '{self.prog} --help')")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


# ---------------------------------------------------------------- validate / show


def cmd_validate(args: argparse.Namespace) -> int:
    from commsim.ir.validate import validate

    schedule = load_schedule_any(args.file)
    findings = validate(schedule)
    if findings:
        shown = findings if args.all else findings[:1]
        for f in shown:
            print(f"{args.file}: {f.line()}", file=sys.stderr)
        if not args.all and len(findings) > 1:
            print(f"{args.file}: ... and {len(findings) - 1} more (--all lists them)", file=sys.stderr)
        return EXIT_BAD_INPUT
    n_ops = sum(len(schedule.program_of(r).step) for r in range(schedule.world_size))
    print(
        f"{args.file}: valid: {schedule.world_size} ranks, {len(schedule.programs)} distinct program(s), "
        f"{n_ops} step ops in all"
    )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from commsim.ir.text import schedule_to_text
    from commsim.util.files import atomic_write_text

    text = schedule_to_text(load_schedule_any(args.file))
    if args.output:
        atomic_write_text(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


# ---------------------------------------------------------------- models


def cmd_models(args: argparse.Namespace) -> int:
    from commsim.models import MODEL_PRESETS, describe, resolve_model

    if not args.model:
        rows = []
        for name, cfg in MODEL_PRESETS.items():
            d = describe(cfg, 1, min(cfg.max_positions, 128))
            rows.append((name, cfg.family, cfg.layers, cfg.hidden, cfg.heads, cfg.ffn, cfg.vocab, d.num_params))
        if args.json:
            keys = ("name", "family", "layers", "hidden", "heads", "ffn", "vocab", "params")
            print(json.dumps([dict(zip(keys, r)) for r in rows], indent=1))
            return 0
        print(f"{'model':<15}{'family':<9}{'layers':>7}{'hidden':>8}{'heads':>6}{'ffn':>7}{'vocab':>7}{'params':>17}")
        for r in rows:
            print(f"{r[0]:<15}{r[1]:<9}{r[2]:>7}{r[3]:>8}{r[4]:>6}{r[5]:>7}{r[6]:>7}{r[7]:>17,}")
        return 0
    cfg = resolve_model(args.model)
    d = describe(cfg, args.micro_batch, args.seq)
    info = {
        "model": d.name,
        "family": cfg.family,
        "micro_batch": d.micro_batch,
        "seq_len": d.seq_len,
        "params": d.param_breakdown(),
        "flops_per_micro_batch": {
            "forward": d.forward_flops(),
            "backward": d.backward_flops(),
            "recompute": d.recompute_flops(),
        },
        "submodules": len(d.modules),
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{d.name} ({cfg.family}): {d.num_params:,} parameters, {len(d.modules)} submodules")
    for k, v in info["params"].items():
        if k != "total":
            print(f"  {k:<15}{v:>17,}")
    f = info["flops_per_micro_batch"]
    print(f"flops per micro-batch of {d.micro_batch} x {d.seq_len} tokens:")
    for k in ("forward", "backward", "recompute"):
        print(f"  {k:<15}{f[k] / 1e12:>14.3f} TFLOP")
    return 0


# ---------------------------------------------------------------- schedule


def cmd_schedule(args: argparse.Namespace) -> int:
    from commsim.ir.serialize import save_schedule
    from commsim.ir.text import schedule_to_text
    from commsim.strategies.summary import format_summary
    from commsim.util.files import atomic_write_text

    from commsim.api import Scenario, build_schedule

    sc = Scenario(model=args.model, cluster=args.cluster, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                  stage=args.stage, preset=args.preset, knobs=tuple(args.knob or ()), ds_config=args.ds_config,
                  micro_batch=args.micro_batch, seq=args.seq, checkpointing=not args.no_checkpointing,
                  checkpoint_style=args.checkpoint_style)
    schedule = build_schedule(sc)[0]
    for w in sc.warnings:
        print(f"commsim: warning: {w}", file=sys.stderr)
    if args.output:
        if args.output.endswith(".txt"):
            atomic_write_text(args.output, schedule_to_text(schedule))
        else:
            save_schedule(schedule, args.output)
    if args.summary or not args.output:
        print(format_summary(schedule))
    return 0


def add_scenario_flags(p: argparse.ArgumentParser) -> None:
    """Flags that describe a model, a world and a DeepSpeed config (schedule, predict)."""
    p.add_argument("--model", default="roberta-10b",
                   help="model preset, path to a Hugging Face config.json, or module:function returning a "
                   "torch.nn.Module (walked on the meta device; needs torch) (default roberta-10b)")
    p.add_argument("--nodes", type=_positive_int, default=8, help="number of nodes (default 8)")
    p.add_argument("--gpus-per-node", type=_positive_int, help="GPUs per node (default: the cluster's, 8)")
    p.add_argument("--cluster", default="p4d",
                   help="node preset: p4d (default), p5, dgx-a100, dgx-h100, p3dn, azure-ndm-a100")
    p.add_argument("--ds-config", metavar="FILE",
                   help="DeepSpeed config JSON (default: ZeRO-3, bf16, DeepSpeed's defaults)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default 3, or the config's)")
    p.add_argument("--preset", default="optimized", help="knob preset: optimized (default) or baseline")
    p.add_argument("--knob", action="append", metavar="NAME=VALUE",
                   help="override one knob, e.g. --knob coalesced_collectives=false (repeatable); knobs: "
                   "fine_grained_sync, precomputed_fetch, coalesced_collectives, flat_collectives, "
                   "defragment_persistent, fused_grad_norm, debug_string_ops, max_outstanding_coalesced")
    p.add_argument("--micro-batch", type=_positive_int,
                   help="sequences per GPU per micro-step (default: the config's, else 16)")
    p.add_argument("--seq", type=_positive_int, default=512, help="sequence length (default 512)")
    p.add_argument("--no-checkpointing", action="store_true",
                   help="disable layer-wise activation checkpointing (on by default)")
    p.add_argument("--checkpoint-style", choices=("reentrant", "non_reentrant"), default="reentrant",
                   help="torch.utils.checkpoint flavour: reentrant (Hugging Face's default) recomputes a layer "
                   "before its backward hooks; non_reentrant after the first one")


def add_hardware_flags(p: argparse.ArgumentParser, simulation: bool = True) -> None:
    """The fabric and measured profile (predict, sweep, tune), and the simulation mode flags."""
    p.add_argument("--net", choices=("efa", "ib"), help="inter-node fabric: efa or ib (default: the cluster's own)")
    p.add_argument("--hw-profile", metavar="FILE", help="measured hardware profile (from commsim calibrate)")
    if not simulation:  # symmetric simulation, as the search compares configs, not noise
        p.set_defaults(mode="auto", seed=0, jitter=None)
        return
    p.add_argument("--mode", choices=("auto", "symmetric", "per-rank"), default="auto",
                   help="symmetric: simulate one rank for identical ranks (fast); per-rank: every rank, with "
                   "jitter, stragglers, per-rank allocator flushes and, from a profile that measured it, each rank's "
                   "speed drift (the median of 9 seeded steps) (default auto: symmetric when ranks are identical and "
                   "the profile measured no drift)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-rank jitter RNG (default 0)")
    p.add_argument("--jitter", type=float,
                   help="relative std-dev of compute kernel times per rank (default 0.01 per-rank, 0 symmetric)")


# ---------------------------------------------------------------- predict


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def cmd_predict(args: argparse.Namespace) -> int:
    from commsim.api import predict_scenario

    pred = predict_scenario(args)
    m = pred.metrics
    if args.trace:
        pred.trace().save_chrome_trace(args.trace) if args.trace.endswith(".chrome.json") else pred.trace().save(args.trace)
    if args.plot:
        from commsim.report.plots import timeline_png

        timeline_png(pred.result, args.plot, title=pred.title)
    if args.plot_memory:
        from commsim.report.plots import memory, save_png

        save_png(memory(pred.result, title=pred.title, hbm_bytes=pred.hbm_bytes), args.plot_memory)
    if args.json:
        out = m.to_json()
        out["scenario"] = pred.scenario
        print(json.dumps(out, indent=1, default=str))
        return 0 if m.oom is None else 1
    print(pred.title)
    mode = ("symmetric: one rank simulated for identical ranks" if m.mode == "symmetric"
            else f"per-rank: {len(pred.result.ranks)} ranks simulated, jitter {m.jitter:.1%}")
    if pred.result.cpu_sharing:
        mode += f"; {pred.result.cpu_sharing}"
    if m.step_time_samples_s:
        n = len(m.step_time_samples_s)
        lo, hi = min(m.step_time_samples_s), max(m.step_time_samples_s)
        print(f"mode: {mode}; seeds {args.seed}-{args.seed + n - 1}, the median one shown (seed {m.seed})")
        print(f"rank speed drift: sd {m.rank_noise[0]:.1%}, correlation {m.rank_noise[1] * 1e3:.0f} ms (profile); "
              f"the {n} steps took {lo:.3f}-{hi:.3f} s")
    else:
        print(f"mode: {mode}; seed {m.seed}")
    if m.oom:
        print(f"OUT OF MEMORY: {m.oom}")
        return 1
    print(f"{'step time':<22}{m.step_time_s:>10.3f} s")
    print(f"{'tokens/s':<22}{m.tokens_per_s:>10,.0f}")
    print(f"{'model TFLOPS/GPU':<22}{m.model_tflops_per_gpu:>10.1f}     hardware TFLOPS/GPU {m.hardware_tflops_per_gpu:.1f}")
    print(f"{'compute busy':<22}{m.compute_busy_frac:>10.1%}")
    print(f"{'communication':<22}{m.comm_time_s:>10.3f} s   exposed {m.exposed_comm_s:.3f} s, overlap {m.overlap_frac:.1%}")
    print("compute-stream idle by cause:")
    for cause, v in sorted(m.stalls_s.items(), key=lambda kv: -kv[1]):
        if v >= 0.0005:  # below the table's resolution
            print(f"  {cause:<20}{v:>10.3f} s")
    print(f"{'memory':<22}peak allocated {_fmt_bytes(m.peak_allocated_bytes)}, reserved "
          f"{_fmt_bytes(m.peak_reserved_bytes)} of {_fmt_bytes(pred.hbm_bytes)}; allocator retries "
          f"{m.alloc_retries}, cache flushes {m.alloc_flushes}")
    if m.cost_usd_per_step == m.cost_usd_per_step and m.cost_usd_per_step > 0:
        per_tokens = (f"${m.cost_usd_per_million_tokens:.2f} per million tokens"
                      if math.isfinite(m.cost_usd_per_million_tokens) else "no tokens (the schedule names no model)")
        print(f"{'cost':<22}${m.cost_usd_per_step:.3f} per step, {per_tokens}")
    return 0


# ---------------------------------------------------------------- sweep


def cmd_sweep(args: argparse.Namespace) -> int:
    from commsim.api import scenario_from_args
    from commsim.sweep import parse_grid, sweep, text_progress

    if not args.grid:
        raise CommsimInputError("commsim sweep: give at least one --grid NAME=V1,V2,...")
    grid = parse_grid(args.grid)
    base = scenario_from_args(args)
    n = 1
    for v in grid.values():
        n *= len(v)
    print(f"sweep: {n} points over {', '.join(grid)} -> {args.output}", file=sys.stderr)
    df = sweep(base, grid, jobs=args.jobs, output=args.output, progress=None if args.quiet else text_progress())
    errors = int((df["error"].fillna("") != "").sum()) if "error" in df else 0
    print(f"{args.output}: {len(df)} rows ({errors} with errors)")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from commsim.api import scenario_from_args
    from commsim.tune import tune
    from commsim.util.files import atomic_write_text

    dims = [d for d in (args.search or "").split(",") if d] or None
    base = scenario_from_args(args)
    show = None if args.quiet or args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    result = tune(base, dims, jobs=args.jobs, max_rounds=args.rounds, progress=show)
    if not result.best.fits:
        raise CommsimInputError("commsim tune: no configuration searched fits in memory; try more nodes, "
                                "--search train_micro_batch_size_per_gpu,checkpointing, or a larger GPU")
    atomic_write_text(args.output, json.dumps(result.ds_config, indent=2) + "\n")
    if args.json:
        print(json.dumps({"output": args.output, **result.to_json()}, indent=1, default=str))
        return 0
    print(f"{args.output}: written")
    print(result.explain())
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    import pandas as pd

    from commsim.report.plots import save_png, scaling, stall_bars

    try:
        df = pd.read_csv(args.table)
    except (OSError, ValueError) as e:
        raise CommsimInputError(f"{args.table}: cannot read as a CSV table: {e}") from None

    def columns(flag: str, raw: str | None) -> list[str]:
        cols = [c for c in (raw or "").split(",") if c]
        for c in cols:
            if c not in df.columns:
                raise CommsimInputError(f"{flag} {c}: not a column of {args.table}; columns: {', '.join(df.columns)}")
        return cols

    if args.kind == "scaling":
        columns("--x", args.x)
        columns("--y", args.y)
        fig = scaling(df, args.x, args.y, columns("--hue", args.hue), args.title)
    else:
        if "step_time_s" not in df.columns:
            raise CommsimInputError(f"{args.table}: no step_time_s column (is it a commsim sweep table?)")
        fig = stall_bars(df, columns("--label", args.label), args.title)
    save_png(fig, args.output)
    print(f"{args.output}: {args.kind} plot of {len(df)} rows")
    return 0


# ---------------------------------------------------------------- execute


def _need_torch(what: str):
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise CommsimInputError(f"commsim {what} needs torch: pip install 'commsim[runtime]'")


def cmd_execute(args: argparse.Namespace) -> int:
    _need_torch("execute")
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
        dtype = schedule.meta.precision or "fp32"
        if dtype not in ("fp32", "bf16", "fp16"):
            raise CommsimInputError(f"--schedule {path}: precision {dtype!r} in its meta; allowed: fp32, bf16, fp16")
        for program in schedule.programs:
            for op in program.step:
                if isinstance(op, O.Compute) and op.gemm is not None:
                    out[(dtype, op.gemm.m, op.gemm.n, op.gemm.k, op.gemm.batch)] = None
    return tuple(out)


def cmd_calibrate(args: argparse.Namespace) -> int:
    _need_torch("calibrate")
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
        root = str(Path(__file__).resolve().parent.parent)
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


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="commsim",
        description="Predict, and check on real hardware, how communication overlaps compute "
        "in sharded data-parallel training (DeepSpeed ZeRO, FSDP).",
    )
    parser.add_argument("--version", action="version", version=f"commsim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("validate", help="check that a schedule would run (deps, buffers, matching collectives)",
                       description="Check a schedule file (JSON or text form): dependencies exist and are acyclic, "
                       "buffers are allocated before use and freed once, and every group's collectives appear in "
                       "the same order with the same sizes on all its members. Exit 2 and one line if not.")
    p.add_argument("file", help="schedule file (.json, or the text form)")
    p.add_argument("--all", action="store_true", help="list every problem, not only the first")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("show", help="print a schedule in the one-line-per-op text form",
                       description="Print a schedule as text, one line per op: for diffs and golden files.")
    p.add_argument("file", help="schedule file")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("models", help="list model presets, or show one model's parameters and flops",
                       description="Without MODEL: the presets. With MODEL (a preset or a Hugging Face "
                       "config.json): parameter counts by category and flops per micro-batch.")
    p.add_argument("model", nargs="?", help="preset name or path to a config.json")
    p.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--seq", type=_positive_int, default=512, help="sequence length in tokens (default 512)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("schedule", help="lower a model + DeepSpeed config into a schedule file",
                       description="Generate one training step per rank as DeepSpeed would run it "
                       "(ZeRO stages 0-3, checked against real DeepSpeed runs), with the 2022 ZeRO-3 "
                       "optimisations as knobs.")
    add_scenario_flags(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write the schedule (.json, or .txt for the text form)")
    p.add_argument("--summary", action="store_true", help="print ops, collectives and bytes per phase and stream")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser("predict", help="simulate a training step and report step time, overlap and stalls",
                       description="Simulate one steady-state training step (after a warm-up step) and report "
                       "step time, throughput, overlap, stalls of the compute stream by cause, memory and cost. "
                       "Defaults: the seed scenario, roberta-10b on 8 p4d nodes, ZeRO-3 optimized, micro-batch 16, "
                       "sequence 512, bf16, layer-wise checkpointing.")
    add_scenario_flags(p)
    add_hardware_flags(p)
    p.add_argument("--schedule", metavar="FILE", help="simulate this schedule file instead of generating one")
    p.add_argument("--trace", metavar="FILE",
                   help="write the predicted trace (commsim JSON; a name ending .chrome.json writes Chrome/Perfetto)")
    p.add_argument("--plot", metavar="PNG", help="write a timeline plot of the step")
    p.add_argument("--plot-memory", metavar="PNG",
                   help="write allocated / reserved memory over the step, allocator flushes marked")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_predict)
    p = sub.add_parser("sweep", help="predict a grid of scenarios in parallel into a table (resumable)",
                       description="Predict every combination of the --grid axes (on top of the other flags, which "
                       "set the base scenario), in parallel, appending one CSV row per point as it finishes; a "
                       "rerun with the same -o skips the points already there.")
    add_scenario_flags(p)
    add_hardware_flags(p)
    p.add_argument("--grid", action="append", metavar="NAME=V1,V2",
                   help="an axis: a predict setting (stage, net, nodes, model, preset, micro_batch, ...), "
                   "knob.NAME or ds.KEY (repeatable)")
    p.add_argument("--jobs", type=_positive_int, default=2, help="parallel workers (default 2)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", default="sweep.csv", help="results CSV (default sweep.csv)")
    p.set_defaults(func=cmd_sweep, schedule=None)

    p = sub.add_parser("tune", help="search DeepSpeed config knobs for the best predicted throughput that fits",
                       description="Coordinate descent over DeepSpeed keys (bucket sizes, prefetch, max live "
                       "parameters, reuse distance, persistence threshold, hpZ group size, micro-batch) and "
                       "activation checkpointing, each point a full prediction; writes the winning ds_config.json "
                       "and explains, change by change, why it wins.")
    add_scenario_flags(p)
    add_hardware_flags(p, simulation=False)
    p.add_argument("--search", help="comma-separated dimensions to search (default: all that apply): "
                   "reduce_bucket_size, stage3_prefetch_bucket_size, stage3_max_live_parameters, "
                   "stage3_max_reuse_distance, stage3_param_persistence_threshold, zero_hpz_partition_size, "
                   "train_micro_batch_size_per_gpu, checkpointing")
    p.add_argument("--rounds", type=_positive_int, default=3, help="at most this many rounds (default 3)")
    p.add_argument("--jobs", type=_positive_int, default=2, help="parallel workers (default 2)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-o", "--output", default="ds_config.tuned.json", help="the config to write "
                   "(default ds_config.tuned.json)")
    p.set_defaults(func=cmd_tune, schedule=None)

    p = sub.add_parser("plot", help="plot a sweep table: scaling curves or stall bars",
                       description="scaling: a metric against a column, one line per --hue group; stalls: "
                       "each row's step time split into compute and compute-stream stalls by cause.")
    p.add_argument("kind", choices=("scaling", "stalls"), help="what to draw")
    p.add_argument("table", help="a commsim sweep CSV")
    p.add_argument("--x", default="nodes", help="scaling: the x column (default nodes)")
    p.add_argument("--y", default="model_tflops_per_gpu", help="scaling: the y column (default model_tflops_per_gpu)")
    p.add_argument("--hue", help="scaling: comma-separated columns, one line per combination")
    p.add_argument("--label", help="stalls: comma-separated columns naming each bar")
    p.add_argument("--title", default="", help="plot title")
    p.add_argument("-o", "--output", required=True, metavar="PNG", help="the PNG to write")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("execute", help="run a schedule for real through torch.distributed and measure it",
                       description="Run SCHEDULE on every rank (gloo on CPUs, NCCL with CUDA streams on GPUs): real "
                       "buffers, kernels and collectives, per-op timestamps, written as a measured trace by rank 0. "
                       "Under torchrun / srun it uses that environment; alone it starts the ranks itself. Needs torch.")
    p.add_argument("schedule", help="schedule file")
    p.add_argument("--nproc-per-node", type=_positive_int, help="local ranks to start (default: the schedule's size)")
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
    p.add_argument("--nproc-per-node", type=_positive_int, default=2, help="local ranks (default 2)")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return EXIT_BAD_INPUT
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except CommsimInputError as e:
        print(f"commsim: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("commsim: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        if type(e).__name__ != "ExecutionFailed":
            raise
        print(f"commsim: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
