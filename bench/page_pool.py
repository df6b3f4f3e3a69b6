"""How much freed memory this machine's guest keeps unreported, and so serves fast.

    python bench/page_pool.py                 # 2 GiB, retouched 0.5 s and 4 s after its free
    python bench/page_pool.py --mib 1024 --gap 0.5 --gap 4 --gap 8

On a VM whose balloon takes reported free memory (``runtime.page_reporting``), a page the
host dropped costs a hypervisor fault when it is next written (2.5-4 ns a byte more here),
a page the guest freed and kept does not. Which freed pages a guest keeps is its
kernel's policy, not upstream Linux's alone: this project's Firecracker guests expose
``max_waiting_mib`` among the page-reporting parameters. The probe measures the policy
rather than assuming it: it maps and writes a block in 64 MiB pieces (one byte a page,
each piece's ns a byte), unmaps it, waits, and writes a block of the same size again,
counting the passes and the MiB they reported meanwhile. It prints each touch's pieces
and how many MiB came fast before the first reported piece (``slow_pieces``' rule).

It maps gigabytes and lets the guest report them: run it on an otherwise idle machine,
never beside a grid run (the pages it takes and gives back are the ranks' too).
"""

from __future__ import annotations

import argparse
import mmap
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from machine_load import reported_kib_now  # noqa: E402
from runtime.page_reporting import balloon_reports, reporting_passes, slow_pieces  # noqa: E402

PARAMS = Path("/sys/module/page_reporting/parameters")
PIECE_BYTES = 64 << 20
PAGE_BYTES = 4096


def counters() -> tuple[int, int] | None:
    """(passes, reported KiB) where the kernel counts them, else None."""
    passes, kib = reporting_passes(), reported_kib_now()
    return None if passes is None or kib is None else (passes, kib)


def touch(nbytes: int) -> tuple[mmap.mmap, list[float]]:
    """A fresh anonymous mapping of ``nbytes``, a byte written in every page; the ns a
    byte of each 64 MiB piece (wall time: the hypervisor's part is not the guest's CPU)."""
    m = mmap.mmap(-1, nbytes)
    rates = []
    for start in range(0, nbytes, PIECE_BYTES):
        end = min(nbytes, start + PIECE_BYTES)
        t = time.perf_counter()
        for off in range(start, end, PAGE_BYTES):
            m[off] = 1
        rates.append((time.perf_counter() - t) / (end - start) * 1e9)
    return m, rates


def fast_prefix_mib(slow: list[bool]) -> int:
    """MiB written before the first reported piece."""
    first = slow.index(True) if True in slow else len(slow)
    return first * PIECE_BYTES >> 20


def waited(seconds: float) -> str:
    before = counters()
    time.sleep(seconds)
    after = counters()
    if before is None or after is None:
        return "passes not counted by this kernel"
    return f"{after[0] - before[0]} passes reported {(after[1] - before[1]) >> 10} MiB"


def line(label: str, rates: list[float], slow: list[bool]) -> str:
    return (f"{label}: {fast_prefix_mib(slow)} MiB fast before the first reported piece, "
            f"{sum(slow) * PIECE_BYTES >> 20} MiB reported of {len(rates) * PIECE_BYTES >> 20} "
            f"[{' '.join(f'{r:.1f}' for r in rates)} ns/B]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=2048, help="block size in MiB, a multiple of 64 (default 2048)")
    ap.add_argument("--gap", type=float, action="append",
                    help="seconds between the free and the next touch (repeatable; default 0.5 and 4)")
    args = ap.parse_args()
    if args.mib <= 0 or args.mib % 64:
        ap.error(f"--mib {args.mib}: a positive multiple of 64 is allowed")
    gaps = args.gap or [0.5, 4.0]
    if any(g < 0 for g in gaps):
        ap.error("--gap: seconds of 0 or more are allowed")
    if not balloon_reports():
        print("this machine's kernel reports no free memory to a host: every freed page comes back fast")
        return
    params = {p.name: p.read_text().strip() for p in sorted(PARAMS.iterdir()) if p.is_file()}
    print("page_reporting parameters: " + ", ".join(f"{k} {v}" for k, v in params.items()))
    print(f"idle 2 s: {waited(2.0)}")
    nbytes = args.mib << 20
    m, rates = touch(nbytes)
    touches = [("first touch", rates)]
    for gap in gaps:
        m.close()
        meanwhile = waited(gap)
        m, rates = touch(nbytes)
        touches.append((f"freed, {gap:g} s ({meanwhile}), touched again", rates))
    m.close()
    # fast and reported pieces told apart over every touch at once: a touch that met
    # only reported pages has no fast piece of its own to compare with
    slow = slow_pieces([r for _, rs in touches for r in rs])
    at = 0
    for label, rs in touches:
        print(line(label, rs, slow[at:at + len(rs)]))
        at += len(rs)
    print(f"freed, 6 s: {waited(6.0)}")


if __name__ == "__main__":
    main()
