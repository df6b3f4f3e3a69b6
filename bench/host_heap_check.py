"""Does commsim's model of glibc's heap fault the pages a real run faults, given its allocations?

    python bench/host_heap_check.py                          # DeepSpeed ZeRO-2, small-gpt2, small buckets
    python bench/host_heap_check.py --model small --ds-config '{"zero_optimization": {"stage": 3}}'

Runs real DeepSpeed (``runtime.examples.ds_train``, 2 ranks, gloo) for a few steps,
counting each phase's minor page faults and recording the last step's every tensor
allocation and free on rank 0 (torch.profiler's memory events). Then replays that step's
allocations, in order, through ``commsim.sim.host_heap.HostHeap`` until the heap settles,
and prints, per phase, the fresh pages the model hands out beside the faults the run
counted in its last steps. This separates the heap model from the schedule: here the
allocations are the run's own; in a prediction they are the schedule's.

torch.profiler records allocations, not writes: a block is taken as written unless it
was freed too soon after its allocation for a kernel to write it (gloo's all_gather
makes and drops one full-size tensor a call); those are listed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from commsim.sim.host_heap import HostHeap  # noqa: E402

PHASES = ("forward", "backward", "step")
DEFAULT_CONFIG = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 500000, "allgather_bucket_size": 500000}}


def run_deepspeed(model: str, config: dict, steps: int, work: Path) -> tuple[Path, dict]:
    cfg = work / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, **config}))
    trace, timings = work / "trace.json", work / "timings.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(ROOT / ".cache" / "torch_extensions"))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "runtime.examples.ds_train", "--model", model, "--seq", "128", "--ds-config", str(cfg),
                          "--steps", str(steps), "--timings", str(timings), "--torch-profile", str(trace),
                          "--profile-memory"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if out.returncode != 0 and not timings.exists():
        sys.exit(f"ds_train failed:\n{out.stderr[-3000:]}")
    return trace, json.loads(timings.read_text())


def step_events(trace: Path) -> list[list]:
    """The step's host allocations and frees, [phase, address, signed bytes, written] in
    time order. A block of 4 MiB or more freed within 200 us of its allocation counts as
    never written: too soon for a kernel to have written it (20 GB/s, over what one core
    of this machine writes)."""
    ev = json.loads(trace.read_text())["traceEvents"]
    spans = {e["name"].split(".", 1)[1]: (e["ts"], e["ts"] + e["dur"]) for e in ev
             if e.get("ph") == "X" and e.get("name", "").startswith("ds_train.")}
    missing = [p for p in PHASES if p not in spans]
    if missing:
        sys.exit(f"{trace}: no ds_train.{missing[0]} range (ds_train without --profile-memory?)")
    mem = sorted((e for e in ev if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                 key=lambda e: e["ts"])
    out: list[list] = []
    born: dict[int, tuple[float, list]] = {}
    for m in mem:
        phase = next((p for p, (a, b) in spans.items() if a <= m["ts"] <= b), None)
        if phase is None:
            continue
        nbytes, addr = m["args"]["Bytes"], m["args"]["Addr"]
        event = [phase, addr, nbytes, True]
        out.append(event)
        if nbytes > 0:
            born[addr] = (m["ts"], event)
        elif addr in born:
            t0, alloc = born.pop(addr)
            if m["ts"] - t0 < 200 and -nbytes >= 4 << 20:
                alloc[3] = False
    return out


def replay(events: list[list], steps: int) -> dict[str, float]:
    """The last replay's fresh MiB per phase (the heap starts empty; it settles in a few)."""
    heap, live, n = HostHeap(), {}, 0
    fresh: dict[str, float] = {}
    for _ in range(steps):
        fresh = dict.fromkeys(PHASES, 0.0)
        for phase, addr, nbytes, written in events:
            if nbytes > 0:
                if addr in live:  # freed where the trace does not see it (another step, thread)
                    heap.free(live.pop(addr))
                n += 1
                live[addr] = str(n)
                fresh[phase] += heap.malloc(str(n), nbytes, None if written else 0) / 2**20
            elif addr in live:
                heap.free(live.pop(addr))
    return fresh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-gpt2")
    ap.add_argument("--ds-config", default=json.dumps(DEFAULT_CONFIG), help="the zero_optimization etc. as JSON")
    ap.add_argument("--steps", type=int, default=8, help="steps the run takes (the last is recorded)")
    args = ap.parse_args()
    try:
        config = json.loads(args.ds_config)
    except json.JSONDecodeError as e:
        ap.error(f"--ds-config: not JSON: {e}")
    if args.steps < 4:
        ap.error(f"--steps {args.steps}: at least 4 (the run's first steps still grow its heap)")
    work = Path(tempfile.mkdtemp(prefix="commsim-heapcheck-"))
    print(f"running DeepSpeed ({args.model}, {args.steps} steps) ...", flush=True)
    trace, timings = run_deepspeed(args.model, config, args.steps, work)
    events = step_events(trace)
    model = replay(events, 4)
    page = resource.getpagesize()
    faults = timings["phase_minor_faults"]
    print(f"{'phase':<10}{'model MiB':>10}   measured MiB, last steps")
    for p in PHASES:
        last = [f * page / 2**20 for f in faults[p][-4:]]
        print(f"{p:<10}{model[p]:>10.1f}   {', '.join(f'{x:.1f}' for x in last)} (median {statistics.median(last):.1f})")
    unwritten = [f"{b / 2**20:.1f} MiB in {p}" for p, _, b, written in events if b > 0 and not written]
    print(f"(allocations replayed: {sum(1 for _, _, b, _ in events if b > 0)}, of which freed at once and "
          f"counted unwritten: {', '.join(unwritten) or 'none'}; files in {work})")


if __name__ == "__main__":
    main()
