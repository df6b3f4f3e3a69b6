"""Measure DeepSpeed's own host (Python) costs on this machine, for schedules of it.

``commsim calibrate --deepspeed-host-costs`` times the installed DeepSpeed's ZeRO-3
routines themselves (runtime/ds_host_costs.py: its module hooks, fetch and release
paths, gradient hooks and bucket flushes run for real on the CPU with their device
calls replaced by no-ops) at two world sizes, and fits each routine's fixed cost and
its cost per parameter (and per rank, for the loops over ranks). The fields go into
the profile's ``host_costs`` and replace the release's defaults in predictions made
with that profile, beside the calibration's own launch costs (on CPUs: a PyTorch op's
dispatch; ``merge_host_costs``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Two world sizes fit the loops over ranks: 2 (a local run's) and 128 (beyond the
# seed's 64, so the per-rank terms are measured over a long lever). Each world is timed in
# PROCESSES processes, the worlds alternating, and each call's minimum over them kept:
# this machine's speed drifts by 10-30% between processes, more than one process's
# minimum over its steps removes, and a per-rank term is a difference between the
# worlds, so both must see the same minutes (three calibrations with the worlds one after
# the other: the per-parameter gather 14% apart; alternating: 0.6%; traces/README.md,
# "Host costs, three calibrations").
WORLDS = (2, 128)
PROCESSES = 6
# the DeepSpeed routines' fields of HostCosts (launches come from calibrate itself)
FIELDS = ("module_hook_ns", "fetch_param_ns", "gather_param_ns", "gather_param_rank_ns", "wait_param_ns",
          "wait_param_rank_ns", "release_hook_ns", "release_param_ns", "free_param_ns", "grad_hook_ns",
          "reduce_flush_ns", "reduce_flush_rank_ns", "reduce_param_ns", "reduce_param_rank_ns", "hook_plumbing_ns")


def measure_host_costs(nproc: int, profile: str, log=print) -> dict:
    """``nproc`` and ``profile`` are the calibration's; the routines run in one process
    of their own on a fake process group, so neither changes what is timed."""
    del nproc, profile
    import deepspeed

    from runtime.ds_host_costs import derive, min_over_runs

    version = deepspeed.__version__
    with tempfile.TemporaryDirectory() as d:
        runs: dict[int, list[dict]] = {world: [] for world in WORLDS}
        # the worlds alternate, so both see the same minutes of this machine
        for k in range(PROCESSES):
            for world in WORLDS:
                log(f"timing DeepSpeed {version}'s routines at {world} ranks ({k + 1} of {PROCESSES})")
                out = Path(d, f"costs-{world}-{k}.json")
                env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
                res = subprocess.run([sys.executable, "-m", "runtime.ds_host_costs", "--deepspeed", "0.19.8",
                                      "--world", str(world), "-o", str(out)],
                                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
                if res.returncode != 0:
                    raise RuntimeError(f"timing DeepSpeed's routines failed:\n{res.stderr[-3000:]}")
                runs[world].append(json.loads(out.read_text()))
        paths = []
        for world, docs in runs.items():
            merged = Path(d, f"costs-{world}.json")
            merged.write_text(json.dumps(min_over_runs(docs)))
            paths.append(str(merged))
        derived = derive(paths, exact=True)["0.19.8"]
    costs = {k: int(derived[k]) for k in FIELDS}
    log(f"DeepSpeed {version} host costs: {costs['module_hook_ns'] / 1e3:.0f} us per fetch hook, "
        f"{costs['release_hook_ns'] / 1e3:.0f} us per release hook, {costs['grad_hook_ns'] / 1e3:.0f} us per "
        f"gradient hook, {costs['hook_plumbing_ns'] / 1e3:.0f} us of hook plumbing per module hook call")
    costs["source"] = (f"DeepSpeed {version}'s routines timed by commsim calibrate --deepspeed-host-costs "
                       f"(runtime/ds_host_costs.py, worlds {'/'.join(map(str, WORLDS))}, each call's minimum "
                       f"over {PROCESSES} processes)")
    return costs


def merge_host_costs(measured: dict | None, deepspeed: dict) -> dict:
    """A profile's host costs with DeepSpeed's routines' added: the calibration's own
    (its launches, on CPUs) kept, both sources named."""
    if not measured:
        return dict(deepspeed)
    sources = "; ".join(dict.fromkeys(s for s in (measured.get("source"), deepspeed.get("source")) if s))
    return {**measured, **deepspeed, **({"source": sources} if sources else {})}


if __name__ == "__main__":
    print(json.dumps(measure_host_costs(0, ""), indent=1))
