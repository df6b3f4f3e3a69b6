"""PyTorch FSDP1's host time per hook call, timed on this machine's CPU for
``HostCosts.fsdp1_hook_ns`` (commsim/strategies/fsdp1.py charges it at every hook).

FSDP1 (``FullyShardedDataParallel``) runs Python at the root's pre-forward (lazy-init
checks, stream waits, input casts), each unit's pre-forward (``_unshard``: the rate
limiter, ``FlatParamHandle.unshard``, ``_use_unsharded_views`` building one view per
original parameter; registering the post-backward hook on the flat parameter's
AccumulateGrad), post-forward (reshard, the pre-backward hooks on the outputs),
pre-backward and post-backward (``_reduce_grad``'s bookkeeping around its kernels and
collective), and the root's final callback; each with ``record_function`` scopes. As
for FSDP2 (runtime/fsdp2_host_costs.py, whose arithmetic this module shares), none of
that is one routine, so it is measured by difference: the tiny RoBERTa of
runtime/torch_models.py with ``FullyShardedDataParallel`` around every layer and the
root, wrapped as runtime/examples/fsdp_train.py ``--fsdp1`` wraps it (torch's defaults:
FULL_SHARD, ``limit_all_gathers``, BACKWARD_PRE, flat parameters), on torch's fake
process group (collectives are no-ops) at 2 ranks, forward + backward in thread CPU
time, against the same model without FSDP1 run right after each FSDP1 step::

    per hook call = (min FSDP1 step - min plain step
                     - FSDP1's ops the schedule prices itself x one op's dispatch
                     - its collective calls x one call on the fake group) / hook calls

The ops the schedule prices itself are the kernels fsdp1.py lowers (``PRICED_OPS``: the
flat gradient's ``cat``, the pad, the pre- and post-divide, the casts) and the sharded
gradient's allocation; the views, storage resizes and ``record_function`` entries and
exits are host work of the hooks and stay in the figure. The hook calls are the 29
fsdp1.py charges for the 7-unit model: a pre-forward, post-forward, pre-backward and
post-backward a unit (the root's pre-forward is its root pre-forward) and the final
callback.

    python -m runtime.fsdp1_host_costs -o run.json        # one process (--world 2, --steps 30)
    python -m runtime.fsdp1_host_costs --derive STORED_DIR FSDP1_RUN.json ... DS_RUN.json ...

``--derive`` turns runs of this machine into the default, as for FSDP2 (the stored
DeepSpeed figures' machine: ``ds_host_derive.machine_ratio`` from DeepSpeed 0.19.8 runs
timed the same minutes).
"""

from __future__ import annotations

import datetime
import platform
import sys

from runtime.fsdp2_host_costs import (STEPS, WORLD, cli, collective_ns, dispatch_ns, hook_figure, measure_processes,
                                      per_hook_ns, time_steps)

# FSDP1's ops that fsdp1.py lowers to kernels (the flat gradient's cat, the pad to the
# padded size, the pre-/post-divide, the mixed-precision casts) or allocations (the
# reduce-scatter's output shard), so the schedule already charges their dispatch
PRICED_OPS = ("aten.cat.default", "aten.constant_pad_nd.default", "aten.div_.Tensor", "aten._to_copy.default",
              "aten.copy_.default", "aten.empty_like.default", "aten.empty.memory_format")


def wrap(torch, model):
    """``FullyShardedDataParallel`` around each layer, then the root, on the CPU (as
    runtime/examples/fsdp_train.py ``--fsdp1`` wraps it, without checkpointing);
    returns the model and its units."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    kw = dict(device_id=torch.device("cpu"), use_orig_params=False)
    layers = model.roberta.encoder.layer
    for i in range(len(layers)):
        layers[i] = FSDP(layers[i], **kw)
    root = FSDP(model, **kw)
    return root, len(layers) + 1


def measure(steps: int = STEPS, world: int = WORLD) -> dict:
    """One process's figure (it initialises the fake process group: run it alone)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.ds_host_setup import model_config
    from runtime.ds_host_timing import cpu_name
    from runtime.torch_models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        plain = build_model(model_config())
        sharded, n_units = wrap(torch, build_model(model_config()))
        t_sharded, t_plain, extra = time_steps(torch, sharded, plain, steps)
        op_ns, coll_ns = dispatch_ns(torch), collective_ns(torch, dist)
    finally:
        dist.destroy_process_group()
    fig = hook_figure(t_sharded, t_plain, extra, op_ns, coll_ns, n_units, PRICED_OPS)
    return {
        "framework": "fsdp1", **fig, "units": n_units, "sharded_ns": min(t_sharded), "plain_ns": min(t_plain),
        "op_ns": round(op_ns), "collective_ns": round(coll_ns),
        "extra_ops": {k: v for k, v in sorted(extra.items()) if v},
        "sharded_steps_ns": t_sharded, "plain_steps_ns": t_plain, "world": world, "steps": steps,
        "machine": {"cpu": cpu_name(), "python": platform.python_version(), "torch": torch.__version__},
        "date": datetime.date.today().isoformat(),
    }


def measure_for_profile(processes: int = 3, log=print) -> dict:
    """``host_costs`` fields for a profile (``commsim calibrate --fsdp1-host-costs``)."""
    import torch

    docs = measure_processes(processes, log=log, framework="fsdp1")
    ns = per_hook_ns(docs)
    log(f"FSDP1 (torch {torch.__version__}): {ns / 1e3:.0f} us per hook call")
    return {"fsdp1_hook_ns": ns,
            "source": f"torch {torch.__version__}'s FSDP1 hooks timed by commsim calibrate --fsdp1-host-costs "
                      f"(runtime/fsdp1_host_costs.py: the fastest step of {processes} processes less the fastest "
                      "plain step)"}


def main(argv: list[str] | None = None) -> int:
    return cli(argv, measure, "FSDP1", __doc__, "at 1 rank FSDP1 shards nothing and skips its collectives")


if __name__ == "__main__":
    sys.exit(main())
