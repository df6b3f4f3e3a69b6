"""The ``commsim`` command line: thin wrappers over the library, one subcommand each.

Bad input (a missing file, an invalid schedule, a flag out of range) ends with exit
status 2 and one line on stderr naming the file, field or flag and what is allowed;
outputs are written atomically, so nothing is half-written.

The subcommands live by family: ``schedule_cmds`` (validate, show, models, schedule),
``predict_cmd`` (predict), ``explore`` (sweep, tune, plot), ``measure`` (execute,
calibrate, record, compare) and ``export_cmd`` (export); ``common`` holds the parser and
the shared flags.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from commsim import __version__
from commsim.cli import explore, export_cmd, measure, predict_cmd, schedule_cmds
from commsim.cli.common import EXIT_BAD_INPUT, Parser
from commsim.ir.errors import CommsimInputError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="commsim",
        description="Predict, and check on real hardware, how communication overlaps compute "
        "in sharded data-parallel training (DeepSpeed ZeRO, FSDP).",
    )
    parser.add_argument("--version", action="version", version=f"commsim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for family in (schedule_cmds, predict_cmd, explore, measure, export_cmd):
        family.register(sub)
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
