"""PyTorch FSDP2's host time per hook call, timed on this machine's CPU for
``HostCosts.fsdp2_hook_ns`` (commsim/strategies/fsdp2.py charges it at every hook).

FSDP2 (``fully_shard``) runs Python at four hooks of each unit a step (pre/post forward,
pre/post backward; a recompute adds two) and in the root's final callback: state
checks, ``unshard`` / ``wait_for_unshard`` / ``reshard`` of its ``FSDPParamGroup``,
swapping each parameter between its sharded DTensor and its unsharded tensor, the
``record_function`` scopes around them, and the views and ``as_strided`` calls that
do the swap. None of that is one routine, so it is measured by difference, as
runtime/ds_host_plumbing.py measures DeepSpeed's plumbing: the tiny RoBERTa of
runtime/torch_models.py (``ds_host_setup.model_config``) with ``fully_shard`` on every
layer and the root, on torch's fake process group (collectives are no-ops; at 1 rank
FSDP2 skips its all-gather path, _fsdp_param_group.py), forward + backward in thread
CPU time, against the same model without FSDP2 run right after each FSDP2 step::

    per hook call = (min FSDP2 step - min plain step
                     - FSDP2's ops the schedule prices itself x one op's dispatch
                     - its collective calls x one call on the fake group) / hook calls

The ops the schedule prices itself are those it lowers to kernels or allocations
(``fsdp.all_gather_copy_in``, ``fsdp.split_with_sizes_copy``, ``fsdp.chunk_cat``,
``aten.empty``: fsdp2_comm.py's copy-in, copy-out, chunk-cat and buffers) and the c10d
collectives (priced as collective launches); FSDP2's other ops (views, ``as_strided``,
``record_function`` entries and exits) are host work of its hooks and stay in the figure.

    python -m runtime.fsdp2_host_costs -o run.json        # one process (--world 2, --steps 30)
    python -m runtime.fsdp2_host_costs --derive STORED_DIR FSDP2_RUN.json ... DS_RUN.json ...

Each process also times a DTensor op's dispatch over a plain op's
(``runtime.dtensor_dispatch``: FSDP2's optimizer steps DTensors), for
``HostCosts.dtensor_op_ns``.

``--derive`` turns runs of this machine into the default (the stored DeepSpeed figures'
machine: ``ds_host_derive.machine_ratio`` from DeepSpeed 0.19.8 runs timed the same
minutes).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS, WORLD, WARMUP = 30, 2, 3
# FSDP2's ops that fsdp2_comm.py lowers to kernels (copy-in, copy-out, chunk-cat) or
# allocations, so the schedule already charges their dispatch
PRICED_OPS = ("fsdp.all_gather_copy_in.default", "fsdp.split_with_sizes_copy.default", "fsdp.chunk_cat.default",
              "aten.empty.memory_format")
# hook calls a step, as fsdp2.py charges them: pre/post forward and pre/post backward of
# each unit (no recompute here), and the root's final callback (which runs the root's
# post-backward itself)
HOOKS_PER_UNIT, HOOKS_PER_STEP = 4, 1


def measure(steps: int = STEPS, world: int = WORLD) -> dict:
    """One process's figure (it initialises the fake process group: run it alone)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.ds_host_setup import model_config
    from runtime.dtensor_dispatch import measure as dtensor_measure
    from runtime.torch_models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        plain, sharded = build_model(model_config()), build_model(model_config())
        units = [m for n, m in sharded.named_modules() if n.rsplit(".", 1)[-1].isdigit() and ".layer." in n]
        assert units, "no transformer layers found to wrap"
        for m in units:
            fully_shard(m)
        fully_shard(sharded)
        n_units = len(units) + 1
        t_sharded, t_plain, extra = time_steps(torch, sharded, plain, steps)
        op_ns, coll_ns = dispatch_ns(torch), collective_ns(torch, dist)
        dtensor = dtensor_measure()  # FSDP2's optimizer: its parameters are DTensors
    finally:
        dist.destroy_process_group()
    fig = hook_figure(t_sharded, t_plain, extra, op_ns, coll_ns, n_units)
    return {
        **fig, "units": n_units, "sharded_ns": min(t_sharded), "plain_ns": min(t_plain), "op_ns": round(op_ns),
        "collective_ns": round(coll_ns), "dtensor_op_ns": dtensor["dtensor_op_ns"],
        "extra_ops": {k: v for k, v in sorted(extra.items()) if v},
        "sharded_steps_ns": t_sharded, "plain_steps_ns": t_plain, "world": world, "steps": steps,
        "machine": {"cpu": _cpu_name(), "python": platform.python_version(), "torch": torch.__version__},
        "date": datetime.date.today().isoformat(),
    }


def time_steps(torch, sharded, plain, steps: int) -> tuple[list[int], list[int], collections.Counter]:
    """Forward + backward of the wrapped and the plain model (thread CPU ns), after
    ``WARMUP`` steps of each, one plain step right after each wrapped one (the same
    minutes); and the wrapped step's ops beyond the plain step's."""
    from runtime.ds_host_setup import VOCAB
    from runtime.ds_host_timing import clock

    ids = torch.randint(0, VOCAB, (2, 16))

    def step(model) -> int:
        t0 = clock()
        model(ids, ids).backward()
        dt = clock() - t0
        for p in model.parameters():
            p.grad = None
        return dt

    for _ in range(WARMUP):
        step(plain)
        step(sharded)
    extra = op_counts(torch, step, sharded)
    extra.subtract(op_counts(torch, step, plain))
    t_sharded, t_plain = [], []
    for _ in range(steps):
        t_sharded.append(step(sharded))
        t_plain.append(step(plain))
    return t_sharded, t_plain, extra


def hook_figure(sharded_ns: list[int], plain_ns: list[int], extra_ops: dict[str, int], op_ns: float,
                coll_ns: float, units: int, priced_ops: tuple[str, ...] = PRICED_OPS) -> dict:
    """Per hook call: the steps' minima's difference less what the schedule prices itself
    (``priced_ops`` at one dispatch each, c10d collectives at one call each), over
    the hook calls the generator charges (``HOOKS_PER_UNIT`` a unit, ``HOOKS_PER_STEP``
    more: FSDP1's count is the same). ``extra_ops``: the wrapped step's ops beyond the
    plain step's."""
    colls = sum(v for k, v in extra_ops.items() if k.startswith("c10d."))
    priced = sum(extra_ops.get(k, 0) for k in priced_ops)
    hooks = HOOKS_PER_UNIT * units + HOOKS_PER_STEP
    assert units > 0, "no unit"
    total = min(sharded_ns) - min(plain_ns) - priced * op_ns - colls * coll_ns
    return {"per_hook_call_ns": max(0, round(total / hooks)), "hook_calls": hooks, "priced_ops": priced,
            "collective_calls": colls}


def op_counts(torch, step, model):
    """Each op's calls in one step of ``model``, as torch dispatches them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counts[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as c:
        step(model)
    return c.counts


def dispatch_ns(torch, calls: int = 20_000) -> float:
    """One small in-place op's dispatch (what calibrate charges a CPU kernel launch)."""
    from runtime.ds_host_timing import clock

    x = torch.ones(256)
    t0 = clock()
    for _ in range(calls):
        x.mul_(1.0)
    return (clock() - t0) / calls


def collective_ns(torch, dist, calls: int = 2_000) -> float:
    """One collective call on the fake group (its dispatch and c10d's Python)."""
    from runtime.ds_host_timing import clock

    buf = torch.ones(256)
    t0 = clock()
    for _ in range(calls):
        dist.all_reduce(buf)
    return (clock() - t0) / calls


def measure_processes(processes: int = 3, world: int = WORLD, steps: int = STEPS, log=print,
                      framework: str = "fsdp2") -> list[dict]:
    """``processes`` runs, each in a process of its own (the fake group is global);
    ``framework``: fsdp2 (this module) or fsdp1 (runtime/fsdp1_host_costs.py)."""
    docs = []
    what = framework.upper()
    with tempfile.TemporaryDirectory() as d:
        for k in range(processes):
            log(f"timing {what}'s hooks ({k + 1} of {processes})")
            out = Path(d, f"{framework}-{k}.json")
            env = dict(os.environ, OMP_NUM_THREADS="1")
            res = subprocess.run([sys.executable, "-m", f"runtime.{framework}_host_costs", "--world", str(world),
                                  "--steps", str(steps), "-o", str(out)],
                                 capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
            if res.returncode != 0:
                raise RuntimeError(f"timing {what}'s hooks failed:\n{res.stderr[-3000:]}")
            docs.append(json.loads(out.read_text()))
    return docs


def per_hook_ns(docs: list[dict]) -> int:
    """Over the processes as the DeepSpeed plumbing is merged (``ds_host_derive.min_over_runs``):
    the fastest FSDP2 step of any process less the fastest plain step, less what the
    schedule prices (at the processes' median dispatch and call costs), per hook call."""
    first = docs[0]
    shape = ("units", "hook_calls", "priced_ops", "collective_calls")
    assert all(tuple(d[k] for k in shape) == tuple(first[k] for k in shape) for d in docs), \
        "every process ran the same model"
    total = (min(d["sharded_ns"] for d in docs) - min(d["plain_ns"] for d in docs)
             - first["priced_ops"] * statistics.median(d["op_ns"] for d in docs)
             - first["collective_calls"] * statistics.median(d["collective_ns"] for d in docs))
    return max(0, round(total / first["hook_calls"]))


def measure_for_profile(processes: int = 3, log=print) -> dict:
    """``host_costs`` fields for a profile (``commsim calibrate --fsdp2-host-costs``):
    the hooks' figure, and a DTensor op's dispatch (``runtime.dtensor_dispatch``: its
    typical cost in each process, the processes' median)."""
    import torch

    docs = measure_processes(processes, log=log)
    ns = per_hook_ns(docs)
    dtensor = round(statistics.median(d["dtensor_op_ns"] for d in docs))
    log(f"FSDP2 (torch {torch.__version__}): {ns / 1e3:.0f} us per hook call, {dtensor / 1e3:.1f} us per DTensor op "
        "over a plain one")
    return {"fsdp2_hook_ns": ns, "dtensor_op_ns": dtensor,
            "source": f"torch {torch.__version__}'s FSDP2 hooks and DTensor ops timed by commsim calibrate "
                      f"--fsdp2-host-costs (runtime/fsdp2_host_costs.py: the fastest step of {processes} processes "
                      "less the fastest plain step; runtime/dtensor_dispatch.py: the processes' median)"}


def derive(stored_dir: str, paths: list[str]) -> dict[str, int]:
    """The default ``fsdp2_hook_ns`` / ``fsdp1_hook_ns``: this machine's figure per hook
    call (``per_hook_ns`` over its processes) times its ratio to the stored DeepSpeed
    figures' machine, from the DeepSpeed 0.19.8 runs among ``paths`` (the FSDP runs are
    the ones with ``per_hook_call_ns``; a run's ``framework`` says which, FSDP2 when
    absent); one key per framework found."""
    from runtime.ds_host_derive import CPU_SCALE, machine_ratio

    docs = [json.loads(Path(p).read_text()) for p in paths]
    ds = [d for d in docs if d.get("deepspeed") == "0.19.8"]
    stored = [json.loads(p.read_text()) for p in sorted(Path(stored_dir).glob("deepspeed-0.19.8-world*.json"))]
    runs: dict[str, list[dict]] = {}
    for d in docs:
        if "per_hook_call_ns" in d:
            runs.setdefault(d.get("framework", "fsdp2"), []).append(d)
    assert runs and ds and stored, "needs FSDP runs, DeepSpeed 0.19.8 runs and the stored 0.19.8 figures"
    ratio = machine_ratio(stored, ds)
    out: dict[str, int] = {}
    for framework, fsdp in sorted(runs.items()):
        measured = per_hook_ns(fsdp)
        out[f"{framework}_hook_ns"] = int(round(measured * CPU_SCALE * ratio, -2))
        out[f"{framework}_measured_ns"] = measured
    out["machine_ratio_x1000"] = round(ratio * 1000)
    return out


def _cpu_name() -> str:
    from runtime.ds_host_timing import cpu_name

    return cpu_name()


def cli(argv: list[str] | None, measure_fn, what: str, doc: str, world_note: str) -> int:
    """The command line of this module and runtime/fsdp1_host_costs.py: one process's run
    (``-o``), or ``--derive``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--derive":
        print(json.dumps(derive(argv[1], argv[2:]), indent=1))
        return 0
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("-o", "--out", required=True, help="the run's JSON")
    ap.add_argument("--steps", type=int, default=STEPS, help=f"measured steps of each model (default {STEPS})")
    ap.add_argument("--world", type=int, default=WORLD, help=f"ranks of the fake process group (default {WORLD})")
    args = ap.parse_args(argv)
    if args.world < 2:
        ap.error(f"--world: at least 2 ({world_note})")
    run = measure_fn(args.steps, args.world)
    print(f"{what} hooks: {run['per_hook_call_ns'] / 1e3:.1f} us per hook call", file=sys.stderr)
    Path(args.out).write_text(json.dumps(run, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(argv, measure, "FSDP2", __doc__, "at 1 rank FSDP2 skips its all-gathers")


if __name__ == "__main__":
    sys.exit(main())
