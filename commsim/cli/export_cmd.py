"""``commsim export``: a stored commsim trace (predicted, measured or recorded) as
PyTorch profiler (Kineto) traces, one file per rank, or as one Chrome / Perfetto trace;
and the ``--kineto DIR`` check that predict and execute share. Needs no torch."""

from __future__ import annotations

import argparse

from commsim.cli.common import check_outputs, positive_int
from commsim.ir.errors import CommsimInputError


def check_kineto_folder(path: str | None) -> None:
    """Before any work: ``--kineto DIR`` can be written (new or empty, in a writable folder)."""
    if path is None:
        return
    from commsim.report.kineto import folder_problem

    problem = folder_problem(path)
    if problem:
        raise CommsimInputError(f"--kineto {path}: {problem}")


def cmd_export(args: argparse.Namespace) -> int:
    from commsim.ir.trace import Trace

    if not (args.kineto or args.chrome):
        raise CommsimInputError("export: give --kineto DIR and/or --chrome FILE")
    check_outputs(("--chrome", args.chrome))
    check_kineto_folder(args.kineto)
    trace = Trace.load(args.trace)
    if args.kineto:
        from commsim.report.kineto import write_kineto

        files = write_kineto(trace, args.kineto, world_size=args.world_size)
        print(f"{args.kineto}: {len(files)} Kineto trace(s), {files[0].name} to {files[-1].name}" if files else
              f"{args.kineto}: the trace holds no records; nothing written")
    if args.chrome:
        trace.save_chrome_trace(args.chrome)
        print(f"{args.chrome}: Chrome trace of {len({r.rank for r in trace.records})} rank(s)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="convert a commsim trace to Kineto (HTA, TensorBoard) or Chrome (Perfetto) "
                       "traces",
                       description="Write TRACE (from predict --trace, execute or record) as PyTorch profiler "
                       "(Kineto) traces, DIR/rank<N>.pt.trace.json for every rank, which Holistic Trace Analysis, "
                       "Perfetto and TensorBoard's PyTorch profiler plugin read, and/or as one Chrome trace "
                       "(all ranks, one process each) for Perfetto.")
    p.add_argument("trace", help="commsim trace file (.json or .json.gz)")
    p.add_argument("--kineto", metavar="DIR", help="write one Kineto trace per rank into DIR (new or empty)")
    p.add_argument("--chrome", metavar="FILE", help="write one Chrome trace event file")
    p.add_argument("--world-size", type=positive_int,
                   help="ranks of a symmetric prediction (one rank simulated for all; default: the largest rank "
                   "its collectives name, plus one)")
    p.set_defaults(func=cmd_export)
