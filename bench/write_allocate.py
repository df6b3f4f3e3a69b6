"""Write-allocate on this machine's CPU: in-place against out-of-place memory-bound ops.

    python bench/write_allocate.py              # one process, 128 MB fp32 tensors
    python bench/write_allocate.py --procs 2    # two at once, as two gloo ranks share memory

Each op runs back to back for --seconds on one thread; its rate is the bytes it counts
(read + written, as a schedule's ``Compute`` op states them) per second. Beside it, the
rate ``commsim.hardware.write_allocate`` predicts from the copy's alone: a fresh write
is read for ownership first, so an op moves its counted bytes plus its out-of-place
writes, and the copy (the calibration's kernel) moves 3 bytes for every 2 it counts.
Figures, not a fit: nothing here sets a constant (the 1.5 is the copy's own accounting).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

N = 32 << 20  # fp32 elements: 128 MB per tensor, well past the last-level cache

# (name, counted bytes per element, bytes written in place per element, fresh writes)
OPS = (("copy_ (calibration's kernel)", 8, 0), ("mul_ in place", 8, 4), ("torch.mul out=", 8, 0),
       ("add_ in place", 12, 4), ("torch.add out=", 12, 0), ("lerp_ in place", 12, 4),
       ("addcdiv_ in place", 16, 4), ("torch.div out=", 8, 0), ("torch.sqrt out=", 8, 0))


def _fns(torch):
    x, y, z, w = torch.randn(N), torch.randn(N), torch.empty(N), torch.rand(N) + 0.5
    return (lambda: z.copy_(x), lambda: x.mul_(0.99999), lambda: torch.mul(x, 0.9999, out=z),
            lambda: x.add_(y), lambda: torch.add(x, y, out=z), lambda: x.lerp_(y, 0.1),
            lambda: x.addcdiv_(y, w, value=-1e-6), lambda: torch.div(w, 1.1, out=z), lambda: torch.sqrt(w, out=z))


def _run(start: float, seconds: float, out) -> None:
    import torch

    torch.set_num_threads(1)
    rates = []
    for i, f in enumerate(_fns(torch)):
        while time.time() < start + i * (seconds + 1):  # every process runs the same op at once
            time.sleep(0.001)
        f()
        k, t = 0, time.perf_counter()
        while time.perf_counter() - t < seconds:
            f()
            k += 1
        rates.append(OPS[i][1] * N * k / (time.perf_counter() - t))
    out.put(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=1, help="processes running each op at once (default 1)")
    ap.add_argument("--seconds", type=float, default=2.0, help="time per op (default 2)")
    args = ap.parse_args()
    q: mp.Queue = mp.Queue()
    start = time.time() + 3
    procs = [mp.Process(target=_run, args=(start, args.seconds, q)) for _ in range(args.procs)]
    for p in procs:
        p.start()
    results = [q.get() for _ in procs]
    for p in procs:
        p.join()
    copy = sum(r[0] for r in results) / len(results)
    print(f"{'op':<30}{'GB/s counted':>14}{'predicted':>11}  (mean of {args.procs} process(es))")
    for i, (name, counted, in_place) in enumerate(OPS):
        written = 4
        moved = counted + written - in_place
        predicted = copy * 1.5 * counted / moved
        rate = sum(r[i] for r in results) / len(results)
        print(f"{name:<30}{rate / 1e9:>14.2f}{predicted / 1e9:>11.2f}")


if __name__ == "__main__":
    main()
