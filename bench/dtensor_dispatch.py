"""What a DTensor op costs the host over a plain tensor op: the figure behind
``HostCosts.dtensor_op_ns`` (commsim/strategies/knobs.py).

FSDP2's parameters are DTensors. On CPUs torch's AdamW runs single-tensor (foreach is
off for CPU tensors: torch/optim/optimizer.py ``_default_to_fused_or_foreach``), so each
parameter's step is eight DTensor ops (``_single_tensor_adam``: the weight decay, lerp,
mul + addcmul, sqrt, the bias-correction division, add eps, addcdiv), each dispatched
through DTensor's sharding propagation before the local kernel runs. This script times
that step on parameters small enough that the kernels cost next to nothing, as
DTensors sharded over a fake two-rank process group and as plain tensors of the same
local size, and reports the difference per op:

    python bench/dtensor_dispatch.py [--params 64] [--elements 64] [--repeats 7]

Each figure is the thread's CPU time, the minimum over repeats of a mean over steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

ADAM_OPS = 8  # DTensor ops per parameter in _single_tensor_adam (AdamW, no amsgrad)


def _step_ns(torch, params: list, repeats: int, steps: int = 50) -> float:
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    for p in params:
        p.grad = torch.zeros_like(p)
    for _ in range(5):
        opt.step()
    runs = []
    for _ in range(repeats):
        t0 = time.thread_time_ns()
        for _ in range(steps):
            opt.step()
        runs.append((time.thread_time_ns() - t0) / steps)
    return min(runs)


def measure(n_params: int, elements: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dt = [torch.nn.Parameter(distribute_tensor(torch.randn(2 * elements), mesh, [Shard(0)]))
              for _ in range(n_params)]
    plain = [torch.nn.Parameter(torch.randn(elements)) for _ in range(n_params)]
    dt_ns = [_step_ns(torch, dt, repeats) for _ in range(3)]
    plain_ns = [_step_ns(torch, plain, repeats) for _ in range(3)]
    d, p = statistics.median(dt_ns), statistics.median(plain_ns)
    return {"dtensor_step_ns_per_param": round(d / n_params), "plain_step_ns_per_param": round(p / n_params),
            "dtensor_op_ns": round((d - p) / n_params / ADAM_OPS), "torch": torch.__version__,
            "params": n_params, "elements": elements}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=64)
    ap.add_argument("--elements", type=int, default=64, help="local elements per parameter")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    r = measure(args.params, args.elements, args.repeats)
    print(f"single-tensor AdamW per parameter: DTensor {r['dtensor_step_ns_per_param'] / 1e3:.1f} us, "
          f"plain {r['plain_step_ns_per_param'] / 1e3:.1f} us (torch {r['torch']}, {r['params']} parameters of "
          f"{r['elements']} local elements)")
    print(f"dtensor_op_ns = {r['dtensor_op_ns']}  (per DTensor op, over a plain tensor op)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
