"""A step that synchronises after every collective, measured three ways on this machine.

    python bench/sync_cycle.py --ranks 4                       # calibrates first (~1 min)
    python bench/sync_cycle.py --ranks 2 --hw-profile p.json   # with a profile already made

The schedule: ``--cycles`` times (host work of 0.5 ms, an all-gather of ``--bytes``,
the host waiting for it), on every rank. It is what the ZeRO-3 baseline does 148 times
a step (a device synchronise after each per-parameter collective), without the rest.
Printed, per cycle: the simulator's prediction with the profile, ``commsim execute``'s
measurement, and the same loop written directly in torch (the collective called from
the main thread, as a framework's Python does).

Why: the rows of validate_local.py that synchronise most (the 4-rank ZeRO-3 baseline)
are the ones predicted low most often, and their ranks leave each synchronisation
apart where the simulated ones leave together. This isolates that pattern, and the
executor's own share of it (its thread hand-offs) against plain torch. Figures from the
development machine are in traces/README.md ("sync_cycle").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from commsim.ir import ops as O  # noqa: E402
from commsim.ir.schedule import Program, Schedule  # noqa: E402
from commsim.ir.serialize import save_schedule  # noqa: E402
from validate_local import commsim  # noqa: E402  (bench/ is this script's folder)

WORK_NS = 500_000

# The same cycle in plain torch, run under torch.distributed.run: argv = cycles, bytes, out.
DIRECT = r"""
import sys, time, json, torch, torch.distributed as dist
dist.init_process_group("gloo")
n, nbytes, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
w = dist.get_world_size()
shard = torch.ones(max(1, nbytes // 4 // w)); full = torch.empty(shard.numel() * w)
dist.barrier()
starts = []
for _ in range(n):
    starts.append(time.perf_counter_ns())
    t = time.perf_counter_ns() + %d
    while time.perf_counter_ns() < t:
        pass
    dist.all_gather_into_tensor(full, shard)
if dist.get_rank() == 0:
    json.dump([(b - a) / 1e6 for a, b in zip(starts, starts[1:])], open(out, "w"))
dist.destroy_process_group()
""" % WORK_NS


def schedule(ranks: int, cycles: int, nbytes: int) -> Schedule:
    ops: list = []
    i = 1
    for k in range(cycles):
        coll = O.OpId(i + 1)
        ops += [O.HostWork(O.OpId(i), f"work {k}", O.HostKind.PYTHON, WORK_NS),
                O.Collective(coll, "allgather", f"ag {k}", O.CollectiveKind.ALL_GATHER, nbytes, O.DType.FP32,
                             tuple(range(ranks))),
                O.HostSync(O.OpId(i + 2), f"wait ag {k}", O.SyncScope.OPS, deps=(coll,))]
        i += 3
    return Schedule.uniform(ranks, Program((), tuple(ops)))


def summary(name: str, cycles_ms: list[float], what: str = "cycles") -> str:
    return (f"{name:<38}median {statistics.median(cycles_ms):6.2f} ms   mean {statistics.fmean(cycles_ms):6.2f} ms   "
            f"({len(cycles_ms)} {what})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=150)
    ap.add_argument("--bytes", type=int, default=2048, help="all-gather size (default 2048, a LayerNorm weight)")
    ap.add_argument("--hw-profile", help="a profile from commsim calibrate with --ranks ranks (default: calibrate now)")
    args = ap.parse_args()
    if args.ranks < 2 or args.cycles < 2 or args.bytes < 4 * args.ranks:
        ap.error("--ranks and --cycles must be at least 2, --bytes at least 4 per rank")
    work = Path(tempfile.mkdtemp(prefix="commsim-sync-cycle-"))
    sched = work / "schedule.json"
    save_schedule(schedule(args.ranks, args.cycles, args.bytes), sched)
    prof = args.hw_profile
    if prof is None:
        prof = str(work / "profile.json")
        print(f"calibrating {args.ranks} ranks ...", flush=True)
        commsim("calibrate", "--nproc-per-node", str(args.ranks), "-o", prof)
    pred = json.loads(commsim("predict", "--schedule", str(sched), "--hw-profile", prof, "--runner", "executor", "--json"))
    per_cycle = [s * 1e3 / args.cycles for s in pred["step_time_samples_s"] or [pred["step_time_s"]]]
    measured = work / "measured.json"
    commsim("execute", str(sched), "--nproc-per-node", str(args.ranks), "--steps", "3", "--warmup", "1",
            "-o", str(measured))
    from commsim.ir.trace import Trace

    df = Trace.load(measured).to_dataframe()
    executor = []
    for _, g in df[df.kind == "host_python"].groupby(["step", "rank"]):
        starts = sorted(g.start_ns)
        executor += [(b - a) / 1e6 for a, b in zip(starts, starts[1:])]
    script, direct_out = work / "direct.py", work / "direct.json"
    script.write_text(DIRECT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(args.ranks), str(script), str(args.cycles), str(args.bytes), str(direct_out)],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"the direct torch loop failed:\n{out.stderr[-2000:]}")
    print(f"{args.ranks} ranks, {args.cycles} cycles of 0.5 ms host work + a {args.bytes}-byte all-gather + a wait")
    print(summary("simulated", per_cycle, "simulated step(s), each over its cycles"))
    print(summary("commsim execute", executor))
    print(summary("torch, called from the main thread", json.loads(direct_out.read_text())))


if __name__ == "__main__":
    main()
