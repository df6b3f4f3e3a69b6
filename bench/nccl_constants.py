"""Read NCCL's tuning tables out of a released NCCL binary: the source of
``commsim/hardware/nccl_tuning.py``.

NCCL prices each (algorithm, protocol) with constant tables in ``src/graph/tuning.cc``
(``baseLat``, ``hwLat``, ``llMaxBws``, ``perChMaxTreeBws``, the LL128 per-channel
ceilings, ``treeCorrectionFactor``). They are initialised arrays, so a built library
holds them verbatim in its data sections. This script finds each table by a value it
starts with (an anchor that every release since 2.10 shares) and prints the whole table,
laid out by the release's algorithm and architecture counts.

The binaries come from the package registries:
- NCCL 2.10.3 (early 2022): statically linked into PyTorch 1.11.0's PyPI wheel
  (``torch/lib/libtorch_cuda.so``; ``pip download --no-deps --only-binary=:all:
  --python-version 3.10 --platform manylinux1_x86_64 torch==1.11.0``);
- NCCL 2.18.3 and 2.27.7: ``pip download --no-deps nvidia-nccl-cu12==2.18.3`` (and
  ``==2.27.7``), ``nvidia/nccl/lib/libnccl.so.2`` inside the wheel.

Usage: ``python bench/nccl_constants.py LIB [--json]``. It reads only the file; the
library's version string (``NCCL version 2.x.y``) picks the layout.
"""

from __future__ import annotations

import argparse
import json
import mmap
import re
import struct
import sys
from pathlib import Path

PROTOCOLS = ("LL", "LL128", "Simple")
# tuning.cc's algorithm order (src/include/devcomm.h NCCL_ALGO_*), by release
ALGORITHMS = {
    (2, 10): ("tree", "ring", "collnet"),
    (2, 18): ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree"),
    (2, 27): ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"),
}
ARCHS = {(2, 10): ("volta", "ampere"), (2, 18): ("volta", "ampere", "hopper"),
         (2, 27): ("volta", "ampere", "hopper", "blackwell")}
HARDWARE = ("nvlink", "pci", "net")
CORRECTION_SIZES = 23  # treeCorrectionFactor: 64 B .. 256 MiB by powers of two


class Library:
    def __init__(self, path: Path) -> None:
        self._file = path.open("rb")
        self.data = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        m = re.search(rb"NCCL version (\d+)\.(\d+)\.(\d+)", self.data)
        if not m:
            raise SystemExit(f"{path}: no 'NCCL version' string: not an NCCL build")
        self.version = tuple(int(x) for x in m.groups())
        layouts = sorted(k for k in ALGORITHMS if k <= self.version[:2])
        if not layouts:
            raise SystemExit(f"{path}: NCCL {self.version}: older than the layouts this script knows (2.10+)")
        self.layout = layouts[-1]

    def find(self, values: list[float], fmt: str) -> int:
        pattern = b"".join(struct.pack("<" + fmt, v) for v in values)
        at = self.data.find(pattern)
        if at < 0:
            raise SystemExit(f"anchor {values} ({fmt}) not found: the layout differs from what this script knows")
        return at

    def read(self, offset: int, n: int, fmt: str) -> list[float]:
        size = struct.calcsize(fmt)
        return [round(v, 4) for v in struct.unpack("<" + fmt * n, self.data[offset:offset + size * n])]


def tables(lib: Library) -> dict:
    algos, archs = ALGORITHMS[lib.layout], ARCHS[lib.layout]
    na, narch = len(algos), len(archs)
    out: dict = {"nccl_version": ".".join(map(str, lib.version))}

    # baseLat[algorithm][protocol] (float): found by its tree+ring rows' Simple column
    # pattern: ring Simple is 8.4 us in every release
    ring = [3.6, 10.0, 8.4] if lib.layout == (2, 10) else [6.6, 14.0, 8.4]
    at = lib.find(ring, "f") - 3 * 4
    base = lib.read(at, na * 3, "f")
    out["baseLat"] = {a: dict(zip(PROTOCOLS, base[3 * i:3 * i + 3])) for i, a in enumerate(algos)}

    # hwLat[hw][algorithm][protocol] (float): the NET tree row starts 5.0, 8.5
    net_tree = lib.find([5.0, 8.5], "f")
    at = net_tree - 2 * na * 3 * 4
    hw = lib.read(at, 3 * na * 3, "f")
    out["hwLat"] = {h: {a: dict(zip(PROTOCOLS, hw[(k * na + i) * 3:(k * na + i) * 3 + 3]))
                        for i, a in enumerate(algos)} for k, h in enumerate(HARDWARE)}

    # per-architecture ceilings (double), GB/s, by nodes index (1 node, 2, more)
    def rows(at: int) -> dict:
        v = lib.read(at, narch * 3, "d")
        return {a: v[3 * i:3 * i + 3] for i, a in enumerate(archs)}

    tree = lib.find([26.5, 18.5, 10.0], "d")
    out["perChMaxTreeBws"] = rows(tree)
    out["llMaxBws"] = rows(lib.find([39.0, 39.0, 20.4], "d"))
    if lib.layout == (2, 10):  # one scalar: ll128MaxBwPerCh = 20.0, beside the tree factors
        out["ll128MaxBwPerCh"] = 20.0 if lib.find([0.92, 7 / 9, 120 / 128], "d") else None
    else:  # perChMaxRingLL128Bws then perChMaxTreeLL128Bws follow perChMaxTreeBws, each
        # table padded to the compiler's 32-byte alignment of arrays
        stride = -(-narch * 3 * 8 // 32) * 32
        out["perChMaxRingLL128Bws"] = rows(tree + stride)
        out["perChMaxTreeLL128Bws"] = rows(tree + 2 * stride)

    # treeCorrectionFactor[protocol][log2(bytes/64)] (float)
    at = lib.find([1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.7, 0.7, 0.7, 0.6, 0.5], "f")
    corr = lib.read(at, 3 * CORRECTION_SIZES, "f")
    out["treeCorrectionFactor"] = {p: corr[i * CORRECTION_SIZES:(i + 1) * CORRECTION_SIZES]
                                   for i, p in enumerate(PROTOCOLS)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lib", type=Path, help="libnccl.so.2, or a library NCCL is linked into statically")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    t = tables(Library(args.lib))
    if args.json:
        print(json.dumps(t, indent=1))
        return 0
    print(f"NCCL {t.pop('nccl_version')}")
    for name, table in t.items():
        print(f"{name}:")
        if isinstance(table, dict):
            for k, v in table.items():
                print(f"  {k}: {v}")
        else:
            print(f"  {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
