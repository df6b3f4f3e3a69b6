"""How many steps a simulation runs before the step it measures, and from what state.

The caching allocator starts a simulation empty; a real job measured in steady state has
run steps before. Each rank issues warm-up steps, then the measured one. How many
(``SimConfig.warmup_steps``):

* a number: exactly that many;
* None (the default), on GPUs: until the allocator settles. A step that still adds a
  segment (a cudaMalloc, or a flush that frees and allocates again) was not steady
  state: it becomes a warm-up step and the next one is measured, for at most
  ``SETTLE_MAX_STEPS`` warm-up steps (the result then says the pool had not settled);
* None on CPU platforms: one, as ``commsim execute`` and the local runs warm up.

Per-rank mode with ranks of one program warms up once, symmetrically and without noise,
and starts every rank from a copy of that rank (identical programs reach the same
allocator state); how many steps comes from a symmetric probe, since every rank must
run as many or its collectives would meet another step's. Ranks of programs of their own
(not rank-symmetric) warm up themselves, one step when the count is not given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from commsim.sim.engine import Simulator
    from commsim.sim.rank import RankSim
    from commsim.sim.records import SimResult

# The most warm-up steps while the allocator has not settled: every step before the
# measured one is one more step's simulation. Two keep a prediction within 1.5x the cost
# of a one-step warm-up (bench/sim_speed.py: a third took the 1024-GPU symmetric step to
# 1.96x).
SETTLE_MAX_STEPS = 2


@dataclass(frozen=True)
class WarmupPlan:
    warmup: int  # steps each simulated rank issues before its first candidate measured step
    settle_max: int  # > 0: re-measure a step that added a segment, up to this step
    warm: "RankSim | None"  # the warmed-up rank every rank starts from (None: each warms up itself)
    warmed: int  # warm-up steps ``warm`` had run


def plan_warmup(sim: "Simulator", warm_from: "RankSim | None") -> "WarmupPlan | SimResult":
    """``sim``'s warm-up (module docstring); a SimResult when the warm-up itself runs out
    of memory. ``warm_from``: a warmed-up rank of an earlier run of the same schedule."""
    warmup, settle_max = sim.config.warmup_steps, 0
    if warmup is None:
        warmup, settle_max = (1, 0) if sim.cost.platform.inline_kernels else (1, SETTLE_MAX_STEPS)
        if sim.mode == "per-rank" and not sim.symmetric_ok:
            settle_max = 0  # one: the measured step's own check says whether it settled
    single = len(sim.schedule.programs) == 1
    if sim.mode != "per-rank" or not warmup:
        return WarmupPlan(warmup, settle_max, None, 0)
    if warm_from is not None and single:
        return WarmupPlan(0, 0, warm_from, warm_from.warmup_run + 1)
    if not (single or settle_max):
        return WarmupPlan(warmup, 0, None, 0)
    steps = warmup
    if settle_max:  # rank 0's program: how many steps its allocator takes to settle
        _, probe = sim.symmetric_run(None)
        if probe.oom is not None:
            return probe
        steps = probe.warmup_steps
    if not single:
        return WarmupPlan(steps, 0, None, 0)
    pre, pre_result = sim.symmetric_run(steps - 1)
    if pre_result.oom is not None:
        return pre_result
    return WarmupPlan(0, 0, pre.sims[0], steps)
