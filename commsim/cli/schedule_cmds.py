"""Subcommands that make or read schedules without simulating them: ``validate``,
``show``, ``models`` and ``schedule``."""

from __future__ import annotations

import argparse
import json
import sys

from commsim.cli.common import EXIT_BAD_INPUT, add_scenario_flags, check_outputs, positive_int, warn, warn_what_ifs
from commsim.ir.load import load_schedule_any


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

    check_outputs(("-o", args.output))
    text = schedule_to_text(load_schedule_any(args.file))
    if args.output:
        atomic_write_text(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


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


def cmd_schedule(args: argparse.Namespace) -> int:
    from commsim.api import Scenario, build_schedule
    from commsim.ir.serialize import save_schedule
    from commsim.ir.text import schedule_to_text
    from commsim.strategies.summary import format_summary
    from commsim.util.files import atomic_write_text

    check_outputs(("-o", args.output))
    warn_what_ifs(args.cluster, args.gpus_per_node)
    sc = Scenario(model=args.model, strategy=args.strategy, fsdp_config=args.fsdp_config, cluster=args.cluster,
                  nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                  stage=args.stage, preset=args.preset, knobs=tuple(args.knob or ()), ds_config=args.ds_config,
                  micro_batch=args.micro_batch, seq=args.seq, checkpointing=not args.no_checkpointing,
                  checkpoint_style=args.checkpoint_style, hw_profile=args.hw_profile, runner=args.runner)
    schedule = build_schedule(sc)[0]
    for w in sc.warnings:
        warn(w)
    if args.output:
        if args.output.endswith(".txt"):
            atomic_write_text(args.output, schedule_to_text(schedule))
        else:
            save_schedule(schedule, args.output)
    if args.summary or not args.output:
        print(format_summary(schedule))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--seq", type=positive_int, default=512, help="sequence length in tokens (default 512)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("schedule", help="lower a model + DeepSpeed (or FSDP2) config into a schedule file",
                       description="Generate one training step per rank as DeepSpeed would run it "
                       "(ZeRO stages 0-3, checked against real DeepSpeed runs), with the 2022 ZeRO-3 "
                       "optimisations as knobs, or as PyTorch FSDP2 would (--strategy fsdp2, checked against real "
                       "FSDP2 runs).")
    add_scenario_flags(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write the schedule (.json, or .txt for the text form)")
    p.add_argument("--summary", action="store_true", help="print ops, collectives and bytes per phase and stream")
    p.add_argument("--hw-profile", metavar="FILE",
                   help="price the host ops (framework hooks, launches) with the host costs this profile measured "
                   "(commsim calibrate --deepspeed-host-costs); the schedule records where its host costs came from")
    p.add_argument("--runner", choices=("framework", "executor"), default="framework",
                   help="with a CPU (gloo) --hw-profile: the schedule of the framework's own run, whose async_op=False "
                   "collectives block the host (default), or one for commsim execute, which replays it as a GPU runs "
                   "it")
    p.set_defaults(func=cmd_schedule)
