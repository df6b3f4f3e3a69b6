"""How fast the simulator is: one step of roberta-50b (ZeRO-3 optimized, the seed's
micro-batch 16 x 512, bf16, checkpointing) on 8, 64, 256 and 1024 A100s of p4d nodes,
in symmetric and per-rank modes.

One node of 8 A100-40GB cannot hold roberta-50b's ZeRO-3 state (16 bytes x 52B / 8):
that row reports OOM, which is the right prediction, after simulating until it fails.

    python bench/sim_speed.py                 # full table (per-rank mode up to --max-per-rank GPUs)
    python bench/sim_speed.py --quick         # 8 and 64 GPUs only

Wall time covers the simulation (the warm-up steps, up to SETTLE_MAX_STEPS, and the measured
step) only; generating the
schedule is reported separately. A second table times whole predictions as
`commsim predict` makes them (schedule, simulation, metrics) of the seed scenario
(roberta-10b, 8 p4d nodes, EFA) for each preset: the metrics walk every idle window of
the compute stream against the host's blocked intervals, which the baseline preset has
thousands of.
"""

from __future__ import annotations

import argparse
import gc
import time

from commsim.api import Scenario, build_schedule, predict
from commsim.hardware.costs import SpecCostModel
from commsim.hardware.specs import cluster_preset
from commsim.sim.engine import SimConfig, Simulator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="roberta-50b")
    ap.add_argument("--gpus", default="8,64,256,1024", help="comma-separated GPU counts (multiples of 8)")
    ap.add_argument("--max-per-rank", type=int, default=64,
                    help="largest GPU count simulated in per-rank mode (larger ones are skipped)")
    ap.add_argument("--quick", action="store_true", help="8 and 64 GPUs only")
    args = ap.parse_args()
    sizes = [8, 64] if args.quick else [int(x) for x in args.gpus.split(",")]
    print(f"{'GPUs':>6} {'mode':<10} {'gen s':>7} {'sim s':>8} {'ops':>11} {'ops/s':>10} {'step s':>8}", flush=True)
    for gpus in sizes:
        nodes = gpus // 8
        t = time.perf_counter()
        sched = build_schedule(Scenario(model=args.model, nodes=nodes))[0]
        gen_s = time.perf_counter() - t
        cost = SpecCostModel(cluster_preset("p4d", nodes))
        for mode in ("symmetric", "per-rank"):
            if mode == "per-rank" and gpus > args.max_per_rank:
                print(f"{gpus:>6} {mode:<10} {'':>7} {'skipped':>8}   (over --max-per-rank {args.max_per_rank})")
                continue
            sim = Simulator(sched, cost, SimConfig(mode=mode))
            gc.collect()  # the last run's millions of objects: not this one's collector work
            t = time.perf_counter()
            res = sim.run()
            sim_s = time.perf_counter() - t
            # ops simulated: symmetric, the w warm-up steps and the measured one; per-rank,
            # the symmetric probe of how many (w + 1 steps) and the warm-up every rank
            # starts from (w steps: sim.warmup), then the measured step on every rank
            n, w = len(sched.program_of(0).step), res.warmup_steps
            ops = 0 if res.step_time_ns == 0 else ((w + 1) * n if mode == "symmetric" else
                                                   (2 * w + 1) * n + len(res.ranks) * n)
            step = "OOM" if res.oom else f"{res.step_time_ns / 1e9:.3f}"
            print(f"{gpus:>6} {mode:<10} {gen_s:>7.2f} {sim_s:>8.2f} {ops:>11,} {ops / sim_s if ops else 0:>10,.0f} {step:>8}",
                  flush=True)
            del sim, res
    print(f"\n{'preset':<10} {'predict s':>9} {'step s':>8}   (roberta-10b, 8 p4d nodes, EFA: schedule + simulation + "
          "metrics)", flush=True)
    for preset in ("optimized", "baseline", "current"):
        gc.collect()
        t = time.perf_counter()
        m = predict(Scenario(model="roberta-10b", nodes=8, net="efa", preset=preset)).metrics
        print(f"{preset:<10} {time.perf_counter() - t:>9.2f} {m.step_time_s:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
