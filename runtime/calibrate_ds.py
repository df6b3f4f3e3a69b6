"""Measure DeepSpeed's own host (Python) costs on this machine, for schedules of it.

Runs real DeepSpeed (DS_ACCELERATOR=cpu on CPUs) on the tiny model, whose kernels and
collectives take little time, with ZeRO-2 (per-parameter gradient hooks, no module
hooks) and ZeRO-3 (module hooks too), and compares each measured step with commsim's
prediction of the same step with those host costs set to zero: the difference, divided
by the number of hooks the schedule has, is the cost of one hook. ZeRO-2 gives the
gradient-hook cost; ZeRO-3, with that known, the module-hook cost. The validation rows
use other, larger models, so nothing here is fitted to them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from commsim.api import Scenario, build_schedule, predict
from commsim.ir import ops as O
from commsim.strategies.knobs import HostCosts

ROOT = Path(__file__).resolve().parent.parent


def _measure(nproc: int, cfg: Path, steps: int = 6) -> float:
    with tempfile.TemporaryDirectory() as d:
        timings = Path(d, "t.json")
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                   TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions")))
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                              str(nproc), "-m", "runtime.examples.ds_train", "--model", "tiny", "--seq", "16",
                              "--ds-config", str(cfg), "--steps", str(steps)] + ["--timings", str(timings)],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
        if out.returncode != 0:
            raise RuntimeError(f"DeepSpeed calibration run failed:\n{out.stderr[-3000:]}")
        times = json.loads(timings.read_text())["step_times_s"][2:]
    return statistics.median(times)


def _hooks(schedule) -> tuple[int, int]:
    step = schedule.program_of(0).step
    module = sum(1 for op in step if isinstance(op, O.HostWork) and op.kind is O.HostKind.MODULE_HOOK)
    grad = sum(1 for op in step if isinstance(op, O.HostWork) and op.kind is O.HostKind.GRAD_HOOK)
    return module, grad


def measure_host_costs(nproc: int, profile: str, log=print) -> dict:
    zero = replace(HostCosts(), module_hook_ns=0, grad_hook_ns=0)
    fits = {}
    with tempfile.TemporaryDirectory() as d:
        for stage in (2, 3):
            cfg = Path(d, f"ds{stage}.json")
            cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}))
            measured = _measure(nproc, cfg)
            sc = Scenario(model="tiny", nodes=1, gpus_per_node=nproc, ds_config=str(cfg), seq=16, hw_profile=profile,
                          host_costs=zero)
            predicted = predict(sc).metrics.step_time_s
            # count hooks in the same schedule with non-zero hook costs (zero-cost host
            # work is not emitted at all)
            fits[stage] = (measured, predicted, _hooks(build_schedule(replace(sc, host_costs=HostCosts()))[0]))
            log(f"DeepSpeed ZeRO-{stage} on tiny: measured {measured * 1e3:.1f} ms, without hooks predicted "
                f"{predicted * 1e3:.1f} ms")
    m2, p2, (_, g2) = fits[2]
    grad_ns = max(0.0, (m2 - p2) / max(g2, 1) * 1e9)
    m3, p3, (h3, g3) = fits[3]
    module_ns = max(0.0, ((m3 - p3) * 1e9 - grad_ns * g3) / max(h3, 1))
    log(f"DeepSpeed host costs: {module_ns / 1e3:.0f} us per module hook, {grad_ns / 1e3:.0f} us per gradient hook")
    return {"module_hook_ns": int(module_ns), "grad_hook_ns": int(grad_ns),
            "source": "measured by commsim calibrate --deepspeed-host-costs (DeepSpeed ZeRO-2/3, tiny model)"}
