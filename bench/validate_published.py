"""Published GPU measurements predicted from public specs alone: today's errors.

    python bench/validate_published.py                # every item: table, skipped list, per family, checks, two summaries
    python bench/validate_published.py --only N1,G3   # some items (ids of ../shared/reference/published-runs.md)
    python bench/validate_published.py --json         # one JSON object per row, skipped number, family, checks, summary

Every quantitative item of published-runs.md that commsim can express is predicted from
the presets of ``commsim/hardware/specs.py`` as they stand (no constant is set here to
match a result; where a needed node has no preset, the script builds one from specs.py's
parts and cites the public spec it uses). Each row says what was simulated so that a
reader can check it:

* collectives: a one-op schedule (one collective over every GPU of the cluster) through
  the simulator in symmetric mode, on the software stack the source names
  (``commsim/hardware/stacks.py``: NCCL and aws-ofi-nccl releases) or else the nearest
  one, which the row's note says; time is the op's start to end; busbw converted as
  nccl-tests does (algbw = size / time; x 2(n-1)/n for all_reduce, x (n-1)/n for
  all_gather and reduce_scatter; size = the all_reduce buffer or the gathered output);
* kernels: one Compute (GEMM with its GemmShape, or a memory-bound elementwise op with
  its bytes) or Copy op through the simulator; TFLOPS = flops / time, GB/s = bytes read
  and written / time; shapes from the catalogue where it describes the layer;
* interference: a kernel on the compute stream beside an all_gather on another stream;
* end-to-end: ``commsim.api.predict`` (symmetric mode), models the catalogue lacks
  described by a Hugging Face config.json in a temporary folder.

error = (predicted - published) / published. Where the published figure is a range the
midpoint is compared; where the setup leaves something open (a micro-batch, say) the
prediction is a range over it, its midpoint compared and the row says whether the
published figure lies inside. Then each family's median and max |error| (N, I, G, M,
X, and each end-to-end item on its own: README.md's table); how many kernel and
collective rows set a constant (``published_rows.SOURCES``: a constant of
commsim/hardware was computed from that figure, so its row is marked ``[sets: ...]``
and is calibration, not a check) and the |error| of the others; and two lines:

    kernels+collectives: median |error| = X%  max |error| = Y%  items = N
    end-to-end: median |error| = X%  max |error| = Y%  items = N
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is imported

from commsim.hardware.specs import cluster_preset  # noqa: E402

from published_collectives import (busbw_gb_per_s, busbw_row, collective, i1, i2, i3, n1, n2, n3, n4, n6,  # noqa: E402
                                   n7, n8)
from published_e2e import ds, e1, e2, e2_phases, e3, e4, e5, phase_times_ms  # noqa: E402
from published_kernels import g1, g2, g3, g4, g5, m1, m2, m3, x1, x2, x3, x5, x6  # noqa: E402
from published_rows import (AG, AR, E2E, KC, RS, Row, Skipped, checks_only, checks_only_line,  # noqa: E402
                            family_summaries, mark_sources, print_families, print_table, range_row, summary,
                            summary_line, write_config)

# Read from this module by tests/test_validate_published.py and by ad-hoc scripts.
__all__ = ["AG", "AR", "E2E", "ITEMS", "KC", "KNOWN", "RS", "Row", "SKIPPED", "busbw_gb_per_s", "busbw_row",
           "cluster_preset", "collective", "ds", "e2_phases", "e5", "main", "phase_times_ms", "range_row",
           "write_config"]


# ---------------------------------------------------------------- what is not expressible

SKIPPED = [
    Skipped("N5", "p4d 1 GiB all_reduce 2/3/4 nodes 57.2/31.8/29.6 GB/s",
            "a degraded setup (3 of 4 NICs in use, NCCL 2.9.9): commsim models a correctly set-up node; the "
            "maintainers' correct figure (about 40 GB/s on 4 nodes) is N6's; its one-node 230.8 is an I1 row"),
    Skipped("N7", "1 GiB all_reduce 2 nodes 268 ms with ring",
            "commsim picks the cheapest algorithm per call, as NCCL does; there is no switch to force ring"),
    Skipped("N7", "8 / 16 machines reach 70% / 60% of on-premise InfiniBand",
            "relative to an on-premise cluster whose setup is not given"),
    Skipped("N8", "p4de 2 nodes 161-164 us, p5 2 nodes 65-75 us",
            "the same runs as N1's and N2's 8 B rows"),
    Skipped("N9", "one EFA adapter, raw RDMA write 193.7 Gb/s",
            "no point-to-point op; FabricSpec.efficiency is the NCCL collective efficiency, not the wire's"),
    Skipped("I1", "232.5 GB/s (NVIDIA/nccl issue 1048)", "message size not stated"),
    Skipped("G1", "A100 PCIe 252.9 TFLOPS", "no PCIe A100 preset; its datasheet peak is the SXM's (312) and "
            "GpuSpec has no parameter for its lower sustained clock at 300 W"),
    Skipped("G1", "GH200 828.6 TFLOPS", "no GH200 preset"),
    Skipped("G4", "Megatron v1 1.2B GPT-2 on one V100 of a DGX-2H, 62.4 TFLOPS",
            "model shape and batch not in published-runs.md; the DGX-2H's 450 W V100 has no preset"),
    Skipped("M3", "FlashAttention-2 179.5 (A100) / 327.9 (H100) TFLOPS",
            "no fused-attention kernel: the catalogue's attention is eager (HF) attention"),
    Skipped("X3", "MI250 / MI210 in the 18.9% average", "no AMD presets (the A100 and H100 stand for the average)"),
    Skipped("X5", "a 1-CTA send/recv slowed a 128-CTA GEMM", "no figure published; no point-to-point op"),
    Skipped("A1", "flush semantics (code)", "a mechanism, no number (the simulator models it)"),
    Skipped("A2", "LLaMA-7B FSDP on 16 A100: 5.3 / 7.3 / 5.0 s per iteration, 0 / 46 / 0 retries",
            "FSDP1 with and without its rate limiter is generated (--strategy fsdp1), but the sequence length, "
            "the GPUs' memory and the network are not given, and the 'other 7B model' is not named"),
    Skipped("A3", "torch.cuda.empty_cache() every step: about 80 ms a step",
            "no IR op for an explicit cache flush; the PR's model and batch are not given"),
    Skipped("A4", "fms-fsdp batch 12 / 14: 6.83 / 4.91 samples/s; T5-11B on 2 p4d: 5.81 s/batch",
            "fms-fsdp's: model, sequence length and GPU count not given in published-runs.md; T5-11B: no "
            "encoder-decoder (T5) family in the catalogue"),
]

ITEMS: dict[str, Callable[[Path], list[Row]]] = {
    "N1": lambda t: n1(), "N2": lambda t: n2(), "N3": lambda t: n3(), "N4": lambda t: n4(),
    "N6": lambda t: n6(), "N7": lambda t: n7(), "N8": lambda t: n8(),
    "I1": lambda t: i1(), "I2": lambda t: i2(), "I3": lambda t: i3(),
    "G1": lambda t: g1(), "G2": lambda t: g2(), "G3": g3, "G4": lambda t: g4(), "G5": g5,
    "M1": lambda t: m1(), "M2": m2, "M3": m3,
    "X1": x1, "X2": lambda t: x2(), "X3": lambda t: x3(), "X5": lambda t: x5(), "X6": lambda t: x6(),
    "E1": e1, "E2": e2, "E3": e3, "E4": e4, "E5": e5,
}
KNOWN = set(ITEMS) | {s.item for s in SKIPPED}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated item ids, e.g. N1,G3")
    ap.add_argument("--json", action="store_true", help="one JSON object per row, per skipped number, per summary")
    args = ap.parse_args(argv)
    wanted = list(ITEMS) + sorted({s.item for s in SKIPPED} - set(ITEMS))
    if args.only:
        wanted = [w.strip().upper() for w in args.only.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in KNOWN]
        if unknown:
            print(f"validate_published: --only {','.join(unknown)}: unknown item; known: "
                  f"{', '.join(sorted(KNOWN))}", file=sys.stderr)
            return 2
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in ITEMS:
            if item in wanted:
                rows.extend(ITEMS[item](Path(tmp)))
    mark_sources(rows, {i for i in ITEMS if i in wanted})
    skipped = [s for s in SKIPPED if s.item in wanted]
    sums = [summary(rows, KC), summary(rows, E2E)]
    checks = checks_only(rows)
    fams = family_summaries(rows)
    if args.json:
        for r in rows:
            print(json.dumps(r.to_json()))
        for s in skipped:
            print(json.dumps({"item": s.item, "what": s.what, "skipped": s.reason}))
        for f in fams:
            print(json.dumps(f))
        print(json.dumps(checks))
        for s in sums:
            print(json.dumps(s))
        return 0
    print_table(rows, skipped)
    print_families(fams)
    print(checks_only_line(checks))
    for s in sums:
        print(summary_line(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
