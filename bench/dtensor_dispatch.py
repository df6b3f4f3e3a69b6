"""What a DTensor op costs the host over a plain tensor op, on this machine: the figure
behind ``HostCosts.dtensor_op_ns`` (commsim/strategies/knobs.py), which
``commsim calibrate --fsdp2-host-costs`` also measures into a profile.

    python bench/dtensor_dispatch.py [--params 64] [--elements 64] [--rounds 5]

The timing is ``runtime.dtensor_dispatch.measure`` (its docstring says how), here on a
fake two-rank process group of its own; it prints the rounds' median (the typical cost,
what calibrate records) and their minimum (the fastest).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=64)
    ap.add_argument("--elements", type=int, default=64, help="local elements per parameter")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of DTensor and plain steps")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.dtensor_dispatch import measure

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        r = measure(args.params, args.elements, args.rounds)
    finally:
        dist.destroy_process_group()
    print(f"single-tensor AdamW per parameter: DTensor {r['dtensor_step_ns_per_param'] / 1e3:.1f} us, "
          f"plain {r['plain_step_ns_per_param'] / 1e3:.1f} us (torch {r['torch']}, {r['params']} parameters of "
          f"{r['elements']} local elements, median of {r['rounds']} rounds)")
    print(f"dtensor_op_ns = {r['dtensor_op_ns']}  (per DTensor op over a plain tensor op; fastest round "
          f"{r['fastest_dtensor_op_ns']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
