"""What a framework's allocation costs on this host: the figure behind
``HardwareProfile.host_malloc_ns`` for a framework's run (commsim/hardware/profile.py).

A framework allocates with ``torch.empty`` and the op that makes the tensor writes it
(``exp_avg_sq.sqrt()`` makes AdamW's temporary), unlike commsim's executor, which
zero-fills its blocks (calibrate's allocation table). This script times, per size, the
same op writing into a new tensor and into an existing one, in a steady state of
allocate / write / free like a training step's, the free of the written tensor, and an
empty allocation alone:

    python bench/framework_alloc.py [--repeats 15]

Below glibc's 32 MiB mmap ceiling the new tensor's heap pages are already touched; above
it each page of a fresh mapping faults on its first write, and its free unmaps every
page (munmap), which commsim does not price yet. Each figure is a median over
repeats (wall time, one thread).
"""

from __future__ import annotations

import argparse
import statistics
import time

SIZES_BYTES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 30 << 20, 34 << 20, 64 << 20)


def measure(repeats: int) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    rows = []
    for n_bytes in SIZES_BYTES:
        src = torch.rand(n_bytes // 4) + 1.0
        existing = torch.empty_like(src)
        for _ in range(3):  # warm the heap up
            t = src.sqrt()
            del t
        new, into, empty, freed = [], [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            t = src.sqrt()
            t1 = time.perf_counter_ns()
            del t
            t1b = time.perf_counter_ns()
            torch.sqrt(src, out=existing)
            t2 = time.perf_counter_ns()
            e = torch.empty_like(src)
            t3 = time.perf_counter_ns()
            del e
            new.append(t1 - t0)
            into.append(t2 - t1b)
            freed.append(t1b - t1)
            empty.append(t3 - t2)
        rows.append({"bytes": n_bytes, "new_ns": statistics.median(new), "existing_ns": statistics.median(into),
                     "empty_ns": statistics.median(empty), "freed_ns": statistics.median(freed)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    print(f"{'size':>10} {'into new':>12} {'into existing':>14} {'difference':>11} {'empty alone':>12} {'its free':>10}")
    for r in measure(args.repeats):
        d = r["new_ns"] - r["existing_ns"]
        print(f"{r['bytes'] / 2**20:>6.3f} MiB {r['new_ns'] / 1e3:>9.1f} us {r['existing_ns'] / 1e3:>11.1f} us "
              f"{d / 1e3:>8.1f} us {r['empty_ns'] / 1e3:>9.1f} us {r['freed_ns'] / 1e3:>7.1f} us")


if __name__ == "__main__":
    main()
