"""What fresh memory costs a framework's step on this machine: one grid row run as it
is and with glibc told never to map or hand back memory, alternating.

    python bench/fresh_memory_ab.py --row 'DS small-llama z3 small buckets' --runs 2

A framework's CPU tensors above glibc's mmap threshold are fresh pages every time, and
glibc trims its heap's top and regrows it: each page's first write faults (in a virtual
machine that reports freed memory to its host, partly in the hypervisor). With
``GLIBC_TUNABLES`` setting ``glibc.malloc.mmap_max=0`` (no mmapped blocks: the heap
serves every size), a trim threshold of 64 GiB (the heap is never handed back) and a
1 GiB top pad (the heap grows in large steps), a step after the warm-up faults nothing.
The difference between the two runs' median steps is what the step's fresh memory
costs (faults, maps, unmaps and trims), to set beside what a prediction charges for its
fresh pages (``fresh pages`` in ``bench/validate_local.py``'s rows, priced at the
calibrated first touch). Per run it prints the median step, each phase (the framework
runner's timer) and rank 0's minor faults a phase in MiB; at the end the difference of
the medians over runs. Rows: the grid's DeepSpeed and FSDP2 rows (``bench/local_grid``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_grid import GRID, Row, row_config  # noqa: E402
from local_report import framework_warmup  # noqa: E402

# glibc's tunables (glibc manual, "Memory Allocation Tunables"): no mmapped blocks, a
# heap never trimmed, grown 1 GiB at a time
NO_FRESH_MEMORY = ("glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736:"
                   "glibc.malloc.top_pad=1073741824")


def run_summary(step_s: float, timings: dict, warmup: int) -> dict:
    """A run's median step (``step_s``, as the grid reads it) and its phases (ms) and rank
    0's faults a phase (MiB), medians over the steps after ``warmup``."""
    def med(v: list) -> float:
        return statistics.median(v[warmup:])
    page = resource.getpagesize()  # a minor fault maps one page (as bench/local_report.py counts them)
    return {"step_ms": step_s * 1e3,
            "phases_ms": {k: med(v) * 1e3 for k, v in timings["phase_times_s"].items()},
            "faults_mib": {k: med(v) * page / 2 ** 20 for k, v in timings.get("phase_minor_faults", {}).items()}}


def difference_line(normal: list[dict], no_fresh: list[dict]) -> str:
    a = statistics.median(r["step_ms"] for r in normal)
    b = statistics.median(r["step_ms"] for r in no_fresh)
    return (f"fresh memory: {a - b:+.1f} ms a step ({100 * (a - b) / a:+.1f}%): median step {a:.1f} ms as it is, "
            f"{b:.1f} ms without fresh memory ({len(normal)} + {len(no_fresh)} runs)")


def framework_row(name: str) -> Row:
    row = next((r for r in GRID if r.name == name), None)
    if row is None or row.runner not in ("deepspeed", "fsdp2"):
        rows = [r.name for r in GRID if r.runner in ("deepspeed", "fsdp2")]
        raise ValueError(f"--row {name!r}: not a DeepSpeed or FSDP2 row of the grid; rows: {', '.join(rows)}")
    return row


def run_once(row: Row, cfg: Path, out: Path, steps: int, no_fresh: bool) -> dict:
    from local_runs import measure_deepspeed, measure_fsdp2  # runs the row exactly as the grid does

    saved = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = NO_FRESH_MEMORY if no_fresh else ""
    try:
        measure = measure_deepspeed if row.runner == "deepspeed" else measure_fsdp2
        step_s = measure(row, cfg, out, steps)
    finally:
        if saved is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = saved
    return run_summary(step_s, json.loads(out.read_text()), framework_warmup(row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", required=True, help="a DeepSpeed or FSDP2 row of bench/local_grid.py")
    ap.add_argument("--runs", type=int, default=2, help="runs of each kind, alternating (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps a run, after the warm-up (default 5)")
    args = ap.parse_args()
    if args.runs < 1 or args.steps < 1:
        ap.error("--runs and --steps: at least 1")
    try:
        row = framework_row(args.row)
    except ValueError as e:
        ap.error(str(e))
    work = Path(tempfile.mkdtemp(prefix="commsim-fresh-"))
    cfg = work / "config.json"
    cfg.write_text(json.dumps(row_config(row)))
    results: dict[bool, list[dict]] = {False: [], True: []}
    for i in range(args.runs):
        for no_fresh in (False, True):
            r = run_once(row, cfg, work / f"{'nofresh' if no_fresh else 'normal'}{i}.json", args.steps, no_fresh)
            results[no_fresh].append(r)
            phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phases_ms"].items())
            faults = ", ".join(f"{k} {v:.1f}" for k, v in r["faults_mib"].items())
            print(f"{'without fresh memory' if no_fresh else 'as it is':<21} step {r['step_ms']:7.1f} ms; phases ms: "
                  f"{phases}; rank 0 faults MiB: {faults}", flush=True)
    print(difference_line(results[False], results[True]))
    print(f"(runs in {work})")


if __name__ == "__main__":
    main()
