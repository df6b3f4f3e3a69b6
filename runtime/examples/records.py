"""A training script's own records, as real jobs keep them: a torch.profiler trace of
every step and a dump of torch.distributed's Flight Recorder.

    --torch-profile-dir DIR   torch.profiler (CPU activities, input shapes) over every
                              step but the first (the profiler's warm-up), each step closed
                              by ``prof.step()``, so the trace holds ProfilerStep#N
                              annotations (N from 1); each rank's Chrome trace is written
                              into DIR by ``tensorboard_trace_handler``
    --flight-recorder PREFIX  keep the Flight Recorder on (TORCH_FR_BUFFER_SIZE, set before
                              the process group starts) and dump it at the end to
                              PREFIX<rank> (torch's own naming, as TORCH_FR_DUMP_TEMP_FILE):
                              the pickle ``_dump_fr_trace`` returns (with stack traces)
    --flight-recorder-json PREFIX  the same, as the JSON ``_dump_fr_trace_json`` returns
                              (without stacks); both may be given

gloo has no watchdog that would dump on a timeout as NCCL's does, so the script dumps
itself; ``commsim compare`` reads either form (commsim.ingest).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any, Iterator

FR_BUFFER_ENTRIES = "20000"  # entries kept per rank: a tiny model's few steps fit many times


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--torch-profile-dir", metavar="DIR",
                    help="torch.profiler over every step; each rank's Chrome trace written into DIR")
    ap.add_argument("--flight-recorder", metavar="PREFIX",
                    help="dump torch.distributed's Flight Recorder at the end to PREFIX<rank> (pickle)")
    ap.add_argument("--flight-recorder-json", metavar="PREFIX",
                    help="dump torch.distributed's Flight Recorder at the end to PREFIX<rank> (JSON)")


def before_init(args: argparse.Namespace) -> None:
    """Call before the process group starts: the recorder's buffer is sized then."""
    if args.flight_recorder or args.flight_recorder_json:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FR_BUFFER_ENTRIES)


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def profiling(args: argparse.Namespace, steps: int) -> Iterator[Any]:
    """A profiler of ``steps`` training steps whose ``step()`` the loop calls after each
    of them (a stand-in that does nothing without --torch-profile-dir)."""
    if not args.torch_profile_dir:
        yield _NoProfiler()
        return
    import torch

    # the first step warms the profiler up (torch's advice); at least one is recorded
    schedule = torch.profiler.schedule(wait=0, warmup=1 if steps > 1 else 0, active=max(1, steps - 1), repeat=1)
    # (shapes: a collective's bytes are read from its tensors' shapes)
    handler = torch.profiler.tensorboard_trace_handler(args.torch_profile_dir)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                schedule=schedule, on_trace_ready=handler) as prof:
        yield prof


def dump_flight_recorder(args: argparse.Namespace, rank: int) -> None:
    """Write this rank's Flight Recorder dump(s) (after the last collective it records)."""
    if not (args.flight_recorder or args.flight_recorder_json):
        return
    import torch

    c10d = torch._C._distributed_c10d
    for prefix, dump in ((args.flight_recorder, c10d._dump_fr_trace),
                         (args.flight_recorder_json, c10d._dump_fr_trace_json)):
        if prefix:
            os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
            with open(f"{prefix}{rank}", "wb") as f:
                f.write(dump())
