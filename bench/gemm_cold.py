"""GEMMs with hot and with cold operands: how much a step's GEMMs lose to reading their
operands from memory, and what calibrate's GEMM timing (``ColdOperands``) measures.

For each shape (the small model's: its projections, its feed-forward matmuls and the
batched attention matmuls), the mean time per call of a batch of back-to-back calls on
the same operands (hot: they stay in the caches) and on operand sets cycled over rings
larger than twice the last-level cache (cold: each call reads from memory), with
``--ranks N`` processes running the same loop at once (2: two ranks sharing the
machine, as calibrate times them). Prints the cold / hot ratio per shape.

    python bench/gemm_cold.py [--ranks 2] [--dtype fp32]

The figures behind runtime/kernels.py's ColdOperands comment are in traces/README.md
("GEMMs with cold operands").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [(1, 512, 512, 512), (1, 512, 512, 2048), (1, 512, 2048, 512), (32, 128, 64, 128), (32, 128, 128, 64)]
MIN_S = 0.5  # each timed batch runs at least this long


def worker(rank: int, dtype_name: str, barrier, out) -> None:
    import torch

    from runtime.kernels import MIN_RING_BYTES, ColdOperands, last_level_cache_bytes
    from runtime.timing import HostTimer, per_call

    def mean_s(fn) -> float:  # calibrate's own timing: a warm-up call, then one batch of >= MIN_S
        return per_call(HostTimer(), fn, MIN_S, lambda x: x)

    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    cpu = torch.device("cpu")
    cold = ColdOperands(cpu, dtype, max(MIN_RING_BYTES, 2 * last_level_cache_bytes(cpu)))
    rows = []
    for key in SHAPES:
        batch, m, k, n = key
        a = torch.randn(batch, m, k).to(dtype)
        b = torch.randn(batch, k, n).to(dtype)
        c = torch.empty(batch, m, n, dtype=dtype)
        barrier.wait()
        hot = mean_s(lambda: torch.bmm(a, b, out=c))

        def cold_call() -> None:
            x, y, z = cold.next(key)
            torch.bmm(x, y, out=z)

        barrier.wait()
        cold_s = mean_s(cold_call)
        rows.append((key, hot, cold_s))
    out.put((rank, rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="processes timing at once (default 2)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()
    if args.ranks < 1:
        ap.error(f"--ranks {args.ranks}: must be at least 1")
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(args.ranks), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.dtype, barrier, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    print(f"{'shape (batch, m, k, n)':<26}{'hot ms':>10}{'cold ms':>10}{'cold/hot':>10}   ({args.ranks} process(es), "
          f"{args.dtype}, mean of the processes)")
    for i, key in enumerate(SHAPES):
        hot = sum(results[r][i][1] for r in results) / len(results)
        cold = sum(results[r][i][2] for r in results) / len(results)
        print(f"{str(key):<26}{hot * 1e3:>10.3f}{cold * 1e3:>10.3f}{cold / hot:>10.3f}")


if __name__ == "__main__":
    main()
