"""What a DTensor op costs the host over a plain tensor op (``HostCosts.dtensor_op_ns``),
timed on this machine's CPU.

FSDP2's parameters are DTensors. On CPUs torch's AdamW runs single-tensor (foreach is
off for CPU tensors: torch/optim/optimizer.py ``_default_to_fused_or_foreach``), so each
parameter's step is eight DTensor ops (``_single_tensor_adam``: the weight decay, lerp,
mul + addcmul, sqrt, the bias-correction division, add eps, addcdiv), each dispatched
through DTensor's sharding propagation before the local kernel runs. ``measure`` times
that step on parameters small enough that the kernels cost next to nothing, as DTensors
sharded over the (fake) process group that is already initialised and as plain tensors
of the same local size, in alternating rounds, and reports the difference per op.

Each round's figure is the thread's CPU time of a mean over steps; the rounds' median is
the op's typical cost on this machine (what ``commsim calibrate --fsdp2-host-costs``
records, as it records kernels at their typical speed), their minimum the fastest.
``bench/dtensor_dispatch.py`` prints both on its own fake group.
"""

from __future__ import annotations

import statistics
import time
import warnings

ADAM_OPS = 8  # DTensor ops per parameter in _single_tensor_adam (AdamW, no amsgrad)
STEPS = 20  # optimizer steps a round's mean is taken over (64 parameters x 8 ops: 10,240 DTensor ops)


def _step_ns(opt, steps: int) -> float:
    """The mean thread CPU time of one ``opt.step()`` over ``steps``."""
    t0 = time.thread_time_ns()
    for _ in range(steps):
        opt.step()
    return (time.thread_time_ns() - t0) / steps


def measure(n_params: int = 64, elements: int = 64, rounds: int = 5, steps: int = STEPS) -> dict:
    """One process's figures. Needs an initialised process group of at least 2 ranks
    (torch's fake backend will do): the parameters are sharded over all of them."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    assert dist.is_initialized() and dist.get_world_size() >= 2, "needs a process group of 2 ranks or more"
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dt = [torch.nn.Parameter(distribute_tensor(torch.randn(world * elements), mesh, [Shard(0)]))
              for _ in range(n_params)]
    plain = [torch.nn.Parameter(torch.randn(elements)) for _ in range(n_params)]
    opts = []
    for params in (dt, plain):
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        for p in params:
            p.grad = torch.zeros_like(p)
        for _ in range(5):  # the optimizer's state is made on its first step
            opt.step()
        opts.append(opt)
    dt_ns, plain_ns = [], []
    for _ in range(rounds):  # alternating, so both see the same minutes of this machine
        dt_ns.append(_step_ns(opts[0], steps))
        plain_ns.append(_step_ns(opts[1], steps))
    per_op = [(d - p) / n_params / ADAM_OPS for d, p in zip(dt_ns, plain_ns)]
    return {"dtensor_op_ns": max(0, round(statistics.median(per_op))),
            "fastest_dtensor_op_ns": max(0, round(min(per_op))),
            "dtensor_step_ns_per_param": round(statistics.median(dt_ns) / n_params),
            "plain_step_ns_per_param": round(statistics.median(plain_ns) / n_params),
            "params": n_params, "elements": elements, "rounds": rounds, "torch": torch.__version__}
