"""Python's garbage collector inside a DeepSpeed ZeRO-3 step: how often each generation
runs and how long it stops the host.

    python bench/gc_pauses.py --deepspeed 0.19.8 -o gc-0.19.8.json
    python bench/gc_pauses.py --deepspeed 0.5.10 --source /tmp/dsold/deepspeed-0.5.10 --layers 12 -o gc.json

Every rank of a data-parallel job runs its own interpreter, and CPython collects
garbage when allocations outrun deallocations (generation 0 after 700 net allocations,
generation 1 after 10 of those, generation 2, a pass over every tracked object, after
10 of those once the objects promoted since the last full pass exceed a quarter of the
ones that survived it: gc.get_threshold(), CPython's gcmodule.c). A full pass stops
that rank's host for as long as the process holds objects to visit; the other ranks
wait for it at their next collective. Training loops of today avoid it by turning the
automatic collector off and collecting on every rank at the same step (torchtitan 0.3.0,
``tools/utils.py`` ``GarbageCollection``: ``gc.disable()``, then ``gc.collect(1)`` every
``gc_freq`` = 50 steps); DeepSpeed's examples and Hugging Face's Trainer of the seed era
left it on.

This runs the host-cost harness's step (``runtime.ds_host_costs``: the release's own
hooks, coordinator and gradient path on a RoBERTa-shaped model of width 16 on the CPU,
device calls as no-ops, a fake world of ``--world`` ranks) for ``--steps`` steps with a
``gc.callbacks`` timer, and reports per generation the collections per step, their pause
(median, max) and the host time they take per step, with the step's wall time, the
objects the process tracks and the objects promoted to the oldest generation per step
(from the period of full passes). Importing ``transformers`` first (``--with-transformers``)
makes the process hold what a Hugging Face training script holds. The figures are this
machine's; traces/README.md ("GC pauses") has a run.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WARMUP = 20  # steps before counting: the trace is recorded and the caches are warm


class GcTimer:
    """gc.callbacks: each collection's generation and pause, tagged with the step; and
    each generation-1 pass's survivors (the objects it promotes to the oldest
    generation), counted before it starts (outside its pause)."""

    def __init__(self) -> None:
        self.step = -1
        self.events: list[tuple[int, int, int]] = []  # (step, generation, ns)
        self.promoted: list[tuple[int, int]] = []  # (step, objects) of each generation-1 pass
        self._start = 0
        self._examined = 0

    def __call__(self, phase: str, info: dict) -> None:
        gen = info["generation"]
        if phase == "start":
            self._examined = len(gc.get_objects(0)) + len(gc.get_objects(1)) if gen == 1 else 0
            self._start = time.perf_counter_ns()
        else:
            self.events.append((self.step, gen, time.perf_counter_ns() - self._start))
            if gen == 1:
                self.promoted.append((self.step, self._examined - info["collected"]))


def summarise(events: list[tuple[int, int, int]], walls_ns: list[int], first: int, steps: int) -> dict:
    """Per generation: collections per step, median / max pause (us) and pause per step
    (us), over steps ``first`` .. ``first + steps - 1``; the step's wall-time median and
    tail (ms)."""
    per_gen: dict[int, list[int]] = {}
    for step, gen, ns in events:
        if first <= step < first + steps:
            per_gen.setdefault(gen, []).append(ns)
    gens = {f"gen{g}": {"per_step": len(ns) / steps, "median_us": statistics.median(ns) / 1e3,
                        "max_us": max(ns) / 1e3, "us_per_step": sum(ns) / steps / 1e3}
            for g, ns in sorted(per_gen.items())}
    w = sorted(walls_ns[first:first + steps])
    return {"generations": gens, "steps": steps,
            "step_ms": {"median": statistics.median(w) / 1e6, "p90": w[int(0.9 * (len(w) - 1))] / 1e6,
                        "p99": w[int(0.99 * (len(w) - 1))] / 1e6, "max": w[-1] / 1e6}}


def full_pass_period(events: list[tuple[int, int, int]], first: int) -> float | None:
    """Steps between consecutive full passes (generation 2) after ``first``, their mean."""
    steps = [s for s, g, _ in events if g == 2 and s >= first]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    return statistics.mean(gaps) if gaps else None


def measure(release, steps: int) -> dict:
    from runtime.ds_host_timing import Recorder

    rec = Recorder()
    release.build(rec)
    timer = GcTimer()
    gc.callbacks.append(timer)
    walls = []
    try:
        for i in range(WARMUP + steps):
            timer.step = i
            rec.reset()
            t = time.perf_counter_ns()
            release.step()
            walls.append(time.perf_counter_ns() - t)
    finally:
        gc.callbacks.remove(timer)
    out = summarise(timer.events, walls, WARMUP, steps)
    tracked = len(gc.get_objects())
    period = full_pass_period(timer.events, WARMUP)
    out.update({"tracked_objects": tracked, "full_pass_period_steps": period,
                # a full pass runs once the promotions since the last exceed a quarter of
                # what survived it (about every tracked object): promoted per step
                "promoted_per_step": tracked / 4 / period if period else None,
                # counted: the survivors of the generation-1 passes of the counted steps
                "promoted_per_step_counted": sum(n for st, n in timer.promoted if st >= WARMUP) / steps,
                "thresholds": list(gc.get_threshold())})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed", required=True, choices=("0.5.4", "0.5.10", "0.6.0", "0.19.8"))
    ap.add_argument("--source", help="the unpacked sdist of an older release (its root, holding deepspeed/)")
    ap.add_argument("--layers", type=int, default=6, help="encoder layers of the harness's model (default 6)")
    ap.add_argument("--steps", type=int, default=300, help=f"steps counted, after {WARMUP} (default 300)")
    ap.add_argument("--world", type=int, default=64, help="ranks of the fake process group (default 64)")
    ap.add_argument("--with-transformers", action="store_true",
                    help="import transformers first, as a Hugging Face training script does")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args(argv)
    if args.deepspeed != "0.19.8" and not args.source:
        ap.error(f"--source: DeepSpeed {args.deepspeed} is read from its unpacked sdist")
    if args.layers < 1 or args.steps < 2:
        ap.error("--layers must be >= 1 and --steps >= 2")
    if args.with_transformers:
        importlib.import_module("transformers")  # what a Hugging Face training script holds

    import runtime.ds_host_setup as setup

    setup.LAYERS = args.layers  # model_config() reads it when the release builds the model
    from runtime.ds_host_costs import CurrentRelease, OldRelease
    from runtime.ds_host_timing import cpu_name

    release = (CurrentRelease(args.world) if args.deepspeed == "0.19.8"
               else OldRelease(args.deepspeed, args.source, args.world))
    doc = {"deepspeed": args.deepspeed, "layers": args.layers, "world": args.world,
           "with_transformers": args.with_transformers, **measure(release, args.steps),
           "machine": {"cpu": cpu_name(), "python": platform.python_version(),
                       "torch": release.torch.__version__}, "date": time.strftime("%Y-%m-%d")}
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(args.out)
    g = doc["generations"]
    print(f"DeepSpeed {args.deepspeed}, {args.layers} layers: "
          + "; ".join(f"{k} {v['per_step']:.2f}/step, median {v['median_us']:.0f} us, {v['us_per_step']:.0f} us/step"
                      for k, v in g.items())
          + f"; full pass every {doc['full_pass_period_steps'] or 'no'} steps; {doc['tracked_objects']} objects tracked; "
          f"{doc['promoted_per_step_counted']:.0f} promoted a step (counted); "
          f"step {doc['step_ms']['median']:.1f} ms (p99 {doc['step_ms']['p99']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
