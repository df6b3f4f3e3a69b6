"""PyTorch FSDP2's host time per hook call on this machine's CPU, by difference.

    python bench/fsdp2_hook_cost.py            # --steps 30

commsim charges each FSDP2 hook (pre/post forward, pre/post backward of a unit) the
fixed cost of DeepSpeed 0.19.8's fetch hook (``HostCosts.module_hook_ns``, 26.3 us), a
stand-in: FSDP2's own hook Python has not been measured. This measures it the way
runtime/ds_host_plumbing.py measures DeepSpeed's plumbing: the tiny RoBERTa of
runtime/torch_models.py (6 layers of width 16) with ``fully_shard`` on every layer and
the root, on torch's fake process group of 2 ranks (its collectives no-ops), forward + backward (thread CPU time, the minimum over
the steps) against the same model without FSDP2, run alternately. Out of the
difference come FSDP2's own aten ops (counted with a dispatch mode, each priced at one
op's dispatch, which the schedule charges as launches of its copies) and its c10d
collective calls (counted, each priced at one call on the fake group, which the
schedule charges as collective launches); what is left, divided by the hook calls (four
per unit and step), is the hooks' Python. Prints one line; figures from the
development machine are in traces/README.md ("FSDP2's hooks").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="measured steps of each model (default 30)")
    ap.add_argument("--world", type=int, default=2, help="ranks of the fake process group (default 2)")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.utils._python_dispatch import TorchDispatchMode

    from runtime.ds_host_setup import VOCAB, model_config
    from runtime.torch_models import build_model

    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    # torch's fake process group (collectives are no-ops) at 2 ranks: at 1 rank FSDP2
    # skips its all-gather path altogether (_fsdp_param_group.py, world_size == 1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    clock = time.thread_time_ns
    plain, sharded = build_model(model_config()), build_model(model_config())
    units = [m for n, m in sharded.named_modules() if n.rsplit(".", 1)[-1].isdigit() and ".layer." in n]
    for m in units:
        fully_shard(m)
    fully_shard(sharded)
    n_units = len(units) + 1
    ids = torch.randint(0, VOCAB, (2, 16))

    def step(model) -> int:
        t0 = clock()
        model(ids, ids).backward()
        dt = clock() - t0
        for p in model.parameters():
            p.grad = None
        return dt

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    calls = {"n": 0}
    for name in ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_reduce"):
        if not hasattr(dist, name):
            continue
        orig = getattr(dist, name)

        def counted(*a, _f=orig, **k):
            calls["n"] += 1
            return _f(*a, **k)

        setattr(dist, name, counted)
    for _ in range(3):
        step(plain)
        step(sharded)
    with Count() as c:
        step(plain)
    ops_plain = c.n
    calls["n"] = 0
    with Count() as c:
        step(sharded)
    ops_sharded, n_coll = c.n, calls["n"]
    t_plain, t_sharded = [], []
    for _ in range(args.steps):
        t_plain.append(step(plain))
        t_sharded.append(step(sharded))
    x = torch.ones(256)
    t0 = clock()
    for _ in range(20000):
        x.mul_(1.0)
    op_ns = (clock() - t0) / 20000
    buf = torch.ones(256)
    t0 = clock()
    for _ in range(2000):
        dist.all_reduce(buf)
    coll_ns = (clock() - t0) / 2000
    hooks = 4 * n_units
    extra = min(t_sharded) - min(t_plain)
    per_hook = (extra - (ops_sharded - ops_plain) * op_ns - n_coll * coll_ns) / hooks
    print(f"FSDP2 hooks: {per_hook / 1e3:.1f} us per hook call ({hooks} calls: {n_units} units); step "
          f"{min(t_sharded) / 1e6:.2f} ms against {min(t_plain) / 1e6:.2f} ms plain; less {ops_sharded - ops_plain} "
          f"aten ops x {op_ns / 1e3:.2f} us and {n_coll} collective calls x {coll_ns / 1e3:.1f} us")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
