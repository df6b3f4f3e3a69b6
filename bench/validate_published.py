"""Published GPU measurements predicted from public specs alone: today's errors.

    python bench/validate_published.py                # every item: table, skipped list, per family, two summary lines
    python bench/validate_published.py --only N1,G3   # some items (ids of ../shared/reference/published-runs.md)
    python bench/validate_published.py --json         # one JSON object per row, skipped number, family, summary

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
X, and each end-to-end item on its own: README.md's table), and two lines:

    kernels+collectives: median |error| = X%  max |error| = Y%  items = N
    end-to-end: median |error| = X%  max |error| = Y%  items = N
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from commsim.api import Scenario, predict  # noqa: E402
from commsim.hardware.costs import SpecCostModel  # noqa: E402
from commsim.hardware.specs import (A100_80, H200, IB_HDR_8, NODE_PRESETS, ClusterSpec,  # noqa: E402
                                    cluster_preset)
from commsim.hardware.stacks import STACKS  # noqa: E402
from commsim.ir import ops as O  # noqa: E402
from commsim.ir.schedule import Program, Schedule  # noqa: E402
from commsim.models import describe, resolve_model  # noqa: E402
from commsim.models.eager import Eager, chain  # noqa: E402
from commsim.sim.engine import SimConfig, Simulator  # noqa: E402
from commsim.sim.records import OpRecord  # noqa: E402

KiB, MiB, GiB = 2**10, 2**20, 2**30
AR, AG, RS = O.CollectiveKind.ALL_REDUCE, O.CollectiveKind.ALL_GATHER, O.CollectiveKind.REDUCE_SCATTER
KC, E2E = "kernels+collectives", "end-to-end"


# ---------------------------------------------------------------- rows


@dataclass
class Row:
    item: str  # published-runs.md id: N1, G3, ...
    what: str  # which published number
    setup: str  # what was simulated
    unit: str
    published: float  # the midpoint when the published figure is a range
    predicted: float | None  # the midpoint when predicted over a range; None: nothing fits
    group: str  # KC or E2E
    published_range: tuple[float, float] | None = None
    predicted_range: tuple[float, float] | None = None
    note: str = ""

    @property
    def error(self) -> float | None:
        if self.predicted is None:
            return None
        return (self.predicted - self.published) / self.published

    @property
    def in_range(self) -> bool | None:
        """With a predicted range: does the published figure lie inside it?"""
        if self.predicted_range is None:
            return None
        lo, hi = self.predicted_range
        return lo <= self.published <= hi

    def to_json(self) -> dict:
        out = asdict(self)
        out["error"] = self.error
        out["in_range"] = self.in_range
        return out


@dataclass(frozen=True)
class Skipped:
    item: str
    what: str
    reason: str


def range_row(item: str, what: str, setup: str, unit: str, published: float, values: list[float], group: str,
              note: str = "") -> Row:
    """A row predicted over an unpublished setting: its midpoint compared, its range shown."""
    if not values:
        return Row(item, what, setup, unit, published, None, group, note=note or "every point ran out of memory")
    lo, hi = min(values), max(values)
    return Row(item, what, setup, unit, published, (lo + hi) / 2, group, predicted_range=(lo, hi), note=note)


# ---------------------------------------------------------------- simulating one-op schedules


def run_ops(cluster: ClusterSpec, ops: list[O.Op], precision: str = "bf16") -> dict[int, OpRecord]:
    """Simulate a hand-made program run by every rank of ``cluster`` (symmetric mode);
    rank 0's record of each op, by op id."""
    cost = SpecCostModel(cluster, precision)
    schedule = Schedule.uniform(cluster.world_size, Program((), tuple(ops)))
    result = Simulator(schedule, cost, SimConfig(mode="symmetric")).run()
    assert result.oom is None, result.oom
    return {int(r.op.id): r for r in result.ranks[0].records}


def duration_ns(rec: OpRecord) -> int:
    return rec.end_ns - rec.start_ns


def bus_factor(kind: O.CollectiveKind, n: int) -> float:
    """nccl-tests' busbw / algbw (doc/PERFORMANCE.md)."""
    if kind is AR:
        return 2 * (n - 1) / n
    if kind in (AG, RS):
        return (n - 1) / n
    return 1.0


def busbw_gb_per_s(kind: O.CollectiveKind, size_bytes: int, time_ns: float, n: int) -> float:
    """nccl-tests' bus bandwidth in GB/s (1e9 B/s): algbw = size / time, times the bus factor."""
    return size_bytes / time_ns * bus_factor(kind, n)  # bytes per ns = GB/s


def collective_op(kind: O.CollectiveKind, size_bytes: int, group: tuple[int, ...], op_id: int = 1,
                  stream: str = "comm", dtype: O.DType = O.DType.FP32) -> O.Collective:
    reduce = O.ReduceOp.SUM if kind in (AR, RS) else None
    return O.Collective(O.OpId(op_id), stream, kind.value, kind, size_bytes, dtype, group, reduce)


def collective(cluster: ClusterSpec, kind: O.CollectiveKind, size_bytes: int) -> tuple[int, str]:
    """(time ns, algorithm) of one collective over every GPU of the cluster (nccl-tests'
    float sum for reductions)."""
    op = collective_op(kind, size_bytes, tuple(range(cluster.world_size)))
    algo = SpecCostModel(cluster).collective(op).algorithm
    return duration_ns(run_ops(cluster, [op])[1]), algo


def size_name(n: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def coll_setup(cluster: ClusterSpec, kind: O.CollectiveKind, size_bytes: int, algo: str, preset: str) -> str:
    c = cluster
    return (f"{preset} {c.nodes}x{c.node.gpus_per_node} {c.node.gpu.name} {c.node.fabric.name}; one {kind.value} "
            f"{size_name(size_bytes)} fp32 over {c.world_size} ranks, symmetric; chose {algo}")


def time_row(item: str, what: str, cluster: ClusterSpec, preset: str, kind: O.CollectiveKind, size_bytes: int,
             published: float, unit: str = "us", published_range: tuple[float, float] | None = None,
             note: str = "") -> Row:
    t, algo = collective(cluster, kind, size_bytes)
    scale = {"us": 1e3, "ms": 1e6}[unit]
    return Row(item, what, coll_setup(cluster, kind, size_bytes, algo, preset), unit, published, t / scale, KC,
               published_range, note=note)


def busbw_row(item: str, what: str, cluster: ClusterSpec, preset: str, kind: O.CollectiveKind, size_bytes: int,
              published: float, published_range: tuple[float, float] | None = None, note: str = "") -> Row:
    t, algo = collective(cluster, kind, size_bytes)
    return Row(item, what, coll_setup(cluster, kind, size_bytes, algo, preset), "GB/s busbw", published,
               busbw_gb_per_s(kind, size_bytes, t, cluster.world_size), KC, published_range, note=note)


def p4de(nodes: int, stack: str) -> ClusterSpec:
    # p4de.24xlarge is p4d.24xlarge with A100-SXM4-80GB: same NVSwitch and 4x100 Gb/s EFA
    # (AWS p4de instance page; aws-ofi-nccl's platform table treats both alike). Only the
    # GPU differs from the p4d preset.
    return ClusterSpec(replace(NODE_PRESETS["p4d"], name="p4de", gpu=A100_80, stack=STACKS[stack]), nodes)


def h200_node(stack: str) -> ClusterSpec:
    # No H200 preset: an 8x H200 SXM node is the dgx-h100 node with H200 GPUs (specs.py's
    # H200: 989 TFLOPS, 4.8 TB/s, 141 GB); NVLink 4 at 900 GB/s bidirectional per GPU, as
    # H100 SXM (NVIDIA H200 datasheet), so the node's NVSwitch figures are kept.
    return ClusterSpec(replace(NODE_PRESETS["dgx-h100"], name="8x H200 (script-built)", gpu=H200,
                               stack=STACKS[stack]), 1)


def hdr4_nodes(nodes: int) -> ClusterSpec:
    # A100 nodes with 4x200 Gb/s HDR (NVIDIA/nccl issue 1048): the dgx-a100 node with half
    # its NICs; HDR's line rate, efficiency and latency as in specs.py's IB_HDR_8.
    fabric = replace(IB_HDR_8, name="IB 4x200Gb/s HDR", nics_per_node=4)
    return ClusterSpec(replace(NODE_PRESETS["dgx-a100"], name="a100-hdr4 (script-built)", fabric=fabric), nodes)


# ---------------------------------------------------------------- collectives


# Software stacks (commsim/hardware/stacks.py) per item: the one the source names, else
# the nearest in time, said in the row's note.
N1_STACK_NOTE = "software not stated (a 2023-24 README): the 2023 stack (NCCL 2.18, aws-ofi-nccl 1.7)"


def n1() -> list[Row]:
    data = [(8, 164.3), (KiB, 165.0), (64 * KiB, 227.4), (MiB, 309.4), (4 * MiB, 533.9), (16 * MiB, 1191.8),
            (32 * MiB, 1540.2), (64 * MiB, 2644.6), (128 * MiB, 3912.9), (256 * MiB, 7201.7), (512 * MiB, 13552),
            (GiB, 26217), (2 * GiB, 51406)]
    cl = p4de(2, "2023")
    return [time_row("N1", f"all_reduce {size_name(s)} time", cl, "p4d (p4de)", AR, s, us, note=N1_STACK_NOTE)
            for s, us in data]


def n2() -> list[Row]:
    cl = cluster_preset("p5", 2)  # the preset's own (current) stack
    note = "stack not stated (newer than the old stack's): the 2025 stack (aws-ofi-nccl 1.16 with its tuner)"
    rows = [time_row("N2", "all_reduce 8 B time", cl, "p5", AR, 8, 69.1, note=note),
            time_row("N2", "all_reduce 64 KiB time", cl, "p5", AR, 64 * KiB, 135.1, note=note)]
    for s, bw in [(MiB, 15.95), (4 * MiB, 46.6), (16 * MiB, 105.5), (64 * MiB, 209.2), (256 * MiB, 342.8),
                  (GiB, 437.0), (4 * GiB, 465.9), (16 * GiB, 487.1)]:
        rows.append(busbw_row("N2", f"all_reduce {size_name(s)} busbw", cl, "p5", AR, s, bw, note=note))
    old = cluster_preset("p5", 2, stack="2023")
    for s, bw in [(64 * MiB, 126.3), (256 * MiB, 167.2), (GiB, 313.3), (2 * GiB, 437.8)]:
        rows.append(busbw_row("N2", f"all_reduce {size_name(s)} busbw, old stack", old, "p5", AR, s, bw,
                              note="EFA installer 1.28, aws-ofi-nccl 1.7.3, NCCL 2.18.5: the 2023 stack"))
    return rows


N3 = {2: (147.3, 305.1, 396.0, 435.1, 445.1, 477.7), 4: (95.4, 229.5, 278.4, 280.3, 347.6, 357.0),
      8: (86.7, 156.3, 272.6, 274.5, 278.2, 355.4), 16: (74.9, 129.2, 223.8, 269.2, 270.9, 356.3),
      32: (66.3, 115.8, 156.8, 220.1, 269.5, 321.1)}
N3_SIZES = (32 * MiB, 128 * MiB, 512 * MiB, GiB, 2 * GiB, 8 * GiB)
N4 = {2: (131.3, 234.5, 275.5, 322.0, 328.6), 4: (83.6, 211.7, 220.6, 288.5, 330.9),
      8: (46.3, 143.7, 261.3, 224.5, 293.7), 16: (24.9, 87.7, 220.0, 261.9, 265.2),
      32: (12.4, 45.7, 146.4, 222.4, 262.8)}
N34_NOTE = "sizes read as nccl-tests' binary units (32 MB = 32 MiB)"


def n3() -> list[Row]:
    return [busbw_row("N3", f"all_reduce {size_name(s)} {nodes} nodes busbw", cluster_preset("p5", nodes, stack="2025"),
                      "p5", AR, s, bw, note=N34_NOTE)
            for nodes, bws in N3.items() for s, bw in zip(N3_SIZES, bws)]


def n4() -> list[Row]:
    return [busbw_row("N4", f"all_gather {size_name(s)} {nodes} nodes busbw", cluster_preset("p5", nodes, stack="2025"),
                      "p5", AG, s, bw, note=N34_NOTE)
            for nodes, bws in N4.items() for s, bw in zip(N3_SIZES, bws)]


def n6() -> list[Row]:
    return [busbw_row("N6", "p4d all_reduce 4 GiB busbw", cluster_preset("p4d", 4), "p4d", AR, 4 * GiB, 42.5,
                      note="node count not published: 4 nodes (ring regime, see the two-node caution); stack not "
                           "stated: p4d's own (early-2022)")]


P3DN_NOTE = "NCCL 2.4 (2019): no stack models it; p3dn's own early-2022 stack stands in"


def n7() -> list[Row]:
    rows = [time_row("N7", "all_reduce 1 GiB 2 nodes time (tree)", cluster_preset("p3dn", 2), "p3dn", AR, GiB,
                     134.0, unit="ms", note="1 GB read as 2^30 B (268 ms ring = busbw 7.5 GB/s only then); "
                                            + P3DN_NOTE),
            busbw_row("N7", "all_reduce 2 nodes busbw (~10)", cluster_preset("p3dn", 2), "p3dn", AR, GiB, 10.0,
                      note="NVIDIA/nccl issue 235; size not stated: 1 GiB; " + P3DN_NOTE)]
    for nodes in (8, 16, 32):
        rows.append(busbw_row("N7", f"all_reduce {nodes} nodes busbw (6-8)", cluster_preset("p3dn", nodes), "p3dn",
                              AR, GiB, 7.0, published_range=(6.0, 8.0),
                              note="NVIDIA/nccl issue 235; size not stated: 1 GiB; " + P3DN_NOTE))
    return rows


def n8() -> list[Row]:
    rows = [time_row("N8", f"p3dn all_reduce 8 B {nodes} nodes time", cluster_preset("p3dn", nodes), "p3dn", AR, 8,
                     us, note=P3DN_NOTE) for nodes, us in ((2, 163.0), (4, 319.0), (8, 631.0))]
    rows.append(time_row("N8", "IB NDR all_reduce 8 B 2 nodes time", cluster_preset("dgx-h100", 2), "dgx-h100", AR,
                         8, 47.0, published_range=(46.0, 48.0),
                         note="NVIDIA/nccl issue 1244 names 2x8 GPUs on NDR: the dgx-h100 preset (8x400 Gb/s NDR); "
                              "NCCL 2.21.5: the preset's stack (its NCCL tables are 2.18's)"))
    return rows


def i1() -> list[Row]:
    cl = cluster_preset("azure-ndm-a100", 1)  # its stack: NCCL 2.18.5, as the Azure file states
    rows = [busbw_row("I1", f"1 node all_reduce {size_name(s)} busbw", cl, "azure-ndm-a100", AR, s, bw)
            for s, bw in [(KiB, 0.04), (64 * KiB, 2.70), (MiB, 36.2), (4 * MiB, 71.4), (16 * MiB, 109.2),
                          (64 * MiB, 166.6), (256 * MiB, 213.9), (GiB, 228.1), (8 * GiB, 231.6)]]
    rows.append(busbw_row("I1", "p4d 1 node all_reduce 1 GiB busbw", cluster_preset("p4d", 1), "p4d", AR, GiB,
                          230.8, note="cross-check from NVIDIA/nccl issue 527 (N5's one-node figure; NCCL 2.9.9: "
                                      "p4d's early-2022 stack)"))
    return rows


def i2() -> list[Row]:
    note = "NCCL not stated: dgx-a100's early-2022 stack"
    return [busbw_row("I2", "DGX A100 multi-node all_reduce busbw", cluster_preset("dgx-a100", 4), "dgx-a100", AR,
                      4 * GiB, 192.0, note="node count and size not published: 4 nodes, 4 GiB; " + note),
            busbw_row("I2", "4x200 HDR A100, 2 nodes all_reduce busbw", hdr4_nodes(2), "dgx-a100 with 4 of its NICs",
                      AR, 4 * GiB, 88.5, published_range=(86.0, 91.0), note="size not published: 4 GiB; " + note)]


def i3() -> list[Row]:
    h100 = cluster_preset("dgx-h100", 1, stack="2023")
    azure = "software not stated: as the same guide's A100 file (NCCL 2.18.5), the 2023 stack"
    rows = [busbw_row("I3", f"8x H100 all_reduce {size_name(s)} busbw", h100, "dgx-h100 (Azure ND H100 v5 node)", AR,
                      s, bw, note=azure)
            for s, bw in [(MiB, 43.7), (16 * MiB, 234.5), (256 * MiB, 423.4), (GiB, 466.4), (8 * GiB, 478.9)]]
    rows += [busbw_row("I3", f"8x H200 all_reduce {size_name(s)} busbw", h200_node("2025"), "dgx-h100 node with H200",
                       AR, s, bw, note="NCCL 2.30.7: the 2025 stack (NCCL 2.27), the newest modelled")
             for s, bw in [(MiB, 72.5), (16 * MiB, 242.5), (256 * MiB, 442.3), (16 * GiB, 480.7)]]
    note = "NVIDIA/nccl issue 1281: node count, size and NCCL not stated: one node, 4 GiB, the 2023 stack"
    rows += [busbw_row("I3", "8x H100 reduce_scatter busbw", h100, "dgx-h100", RS, 4 * GiB, 360.0, note=note),
             busbw_row("I3", "8x H100 all_gather busbw", h100, "dgx-h100", AG, 4 * GiB, 350.0, note=note)]
    return rows


# ---------------------------------------------------------------- kernels


def one_gpu(preset: str) -> ClusterSpec:
    return cluster_preset(preset, 1, gpus_per_node=1)


def gemm_op(g: O.GemmShape, op_id: int = 1, dtype_bytes: int = 2, label: str = "gemm") -> O.Compute:
    """A (batched) GEMM reading A and B once and writing C once."""
    b = g.batch
    return O.Compute(O.OpId(op_id), "compute", label, O.ComputeKind.GEMM, g.flops,
                     (g.m * g.k + g.k * g.n) * b * dtype_bytes, g.m * g.n * b * dtype_bytes, g)


def kernel_op(k, op_id: int = 1) -> O.Compute:
    """A catalogue Kernel as a Compute op on the compute stream."""
    return O.Compute(O.OpId(op_id), "compute", k.name, k.kind, k.flops, k.bytes_read, k.bytes_written, k.gemm)


def shape_name(g: O.GemmShape) -> str:
    s = f"{g.m}x{g.n}x{g.k}"
    return s if g.batch == 1 else f"{g.batch}x({s})"


def gemm_row(item: str, what: str, preset: str, g: O.GemmShape, published: float, precision: str = "bf16",
             note: str = "") -> Row:
    cl = one_gpu(preset)
    t = duration_ns(run_ops(cl, [gemm_op(g)], precision)[1])
    return Row(item, what, f"{preset} GPU {cl.node.gpu.name}; GEMM m x n x k = {shape_name(g)} {precision}",
               "TFLOPS", published, g.flops / t / 1e3, KC, note=note)


def kernel_time_ns(preset: str, op: O.Compute | O.Copy, precision: str = "bf16") -> int:
    return duration_ns(run_ops(one_gpu(preset), [op], precision)[1])


def g1() -> list[Row]:
    g = O.GemmShape(1024, 10240, 5120)
    note = "mamf-finder's shape reads M x N x K"
    return [gemm_row("G1", "A100 SXM max bf16 matmul", "p4d", g, 271.2, note=note),
            gemm_row("G1", "A100 SXM max bf16 matmul, older revision", "p4d", g, 267.9, note=note),
            gemm_row("G1", "H100 SXM max bf16 matmul", "dgx-h100", g, 794.5,
                     note="H100's best shape not published: the A100's shape"),
            gemm_row("G1", "H100 SXM max bf16 matmul, older revision", "dgx-h100", g, 792.1,
                     note="H100's best shape not published: the A100's shape")]


def g2() -> list[Row]:
    data = [((1024, 1024, 1024), 119.4), ((2048, 2048, 2048), 221.8), ((4096, 4096, 4096), 228.0),
            ((8192, 8192, 8192), 253.7), ((16384, 16384, 16384), 256.5), ((6144, 12288, 12288), 250.8),
            ((1024, 2145, 1024), 132.8)]
    # cuBLAS is column-major: its m x n x k is PyTorch's (row-major) n x m x k
    return [gemm_row("G2", f"cuBLASLt fp16 {m}x{n}x{k}", "azure-ndm-a100", O.GemmShape(n, m, k), tf, "fp16",
                     note="m x n x k of cuBLAS's column-major call (order assumed)" if n != m else "")
            for (m, n, k), tf in data]


def write_config(folder: Path, name: str, cfg: dict) -> str:
    path = folder / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return str(path)


def first(kernels, kind: O.ComputeKind, name: str | None = None):
    """The first kernel of ``kind`` (named ``name``) in a module's list."""
    return next(k for k in kernels if k.kind is kind and (name is None or k.name == name))


def chain_time_ns(cluster: ClusterSpec, kernels, precision: str) -> int:
    """Catalogue kernels one after the other on the compute stream: first start to last end."""
    ops = [replace(kernel_op(k, i + 1), deps=(O.OpId(i),) if i else ()) for i, k in enumerate(kernels)]
    recs = run_ops(cluster, ops, precision)
    return max(r.end_ns for r in recs.values()) - min(r.start_ns for r in recs.values())


def g3(tmp: Path) -> list[Row]:
    # One GPT layer as the catalogue's gpt2 family describes it (pre-LN, fused QKV, GELU
    # MLP of 4h, eager attention), h 4096, 16 heads, micro-batch 4, seq 2048, vocab 51200.
    h, nh, b, s, V = 4096, 16, 4, 2048, 51200
    T = b * s
    cfg = write_config(tmp, "g3-layer", {"model_type": "gpt2", "n_embd": h, "n_layer": 1, "n_head": nh,
                                         "n_inner": 4 * h, "vocab_size": V, "n_positions": s})
    md = describe(resolve_model(cfg), b, s, 2)
    mod = {m.path: m for m in md.modules}
    preset = "p4d"
    gpu = f"{preset} GPU {one_gpu(preset).node.gpu.name} (GPU not named: the original A100 SKU assumed), fp16"
    rows = []
    G = O.ComputeKind.GEMM
    for path, what, tf in [("transformer.h.0.attn.c_attn", "QKV GEMM", 241.6),
                           ("transformer.h.0.attn.c_proj", "attention out-projection", 234.9),
                           ("transformer.h.0.mlp.c_fc", "h->4h GEMM", 241.1),
                           ("transformer.h.0.mlp.c_proj", "4h->h GEMM", 252.8),
                           ("lm_head", "logits GEMM (vocab 51200)", 255.4)]:
        k = first(mod[path].fwd, G, "fwd")
        t = kernel_time_ns(preset, kernel_op(k), "fp16")
        rows.append(Row("G3", what, f"{gpu}; catalogue {path} fwd GEMM {shape_name(k.gemm)}", "TFLOPS", tf,
                        k.flops / t / 1e3, KC))
    # the attention chain's kernels, each on its own
    attn = mod["transformer.h.0.attn.attn_dropout"].fwd + mod["transformer.h.0.attn.c_proj"].fwd
    for k, what, tf in [(first(attn, G, "qk"), "attention-score bmm", 130.2),
                        (first(attn, G, "av"), "attention-over-value bmm", 219.0)]:
        t = kernel_time_ns(preset, kernel_op(k), "fp16")
        rows.append(Row("G3", what, f"{gpu}; catalogue {k.name} bmm {shape_name(k.gemm)}", "TFLOPS", tf,
                        k.flops / t / 1e3, KC))
    for k, what, ms in [(first(attn, O.ComputeKind.SOFTMAX), "unfused softmax time", 7.6),
                        (first(attn, O.ComputeKind.DROPOUT), "its dropout time", 1.2)]:
        t = kernel_time_ns(preset, kernel_op(k), "fp16")
        rows.append(Row("G3", what, f"{gpu}; catalogue {k.name} kernel over {b}x{nh}x{s}x{s} "
                        f"({(k.bytes_read + k.bytes_written) / 1e9:.2f} GB)", "ms", ms, t / 1e6, KC))
    ln = first(mod["transformer.h.0.ln_1"].fwd, O.ComputeKind.NORM)
    t = kernel_time_ns(preset, kernel_op(ln), "fp16")
    rows.append(Row("G3", "layer norm time", f"{gpu}; catalogue ln_1 fwd ({ln.bytes_read + ln.bytes_written} B)",
                    "ms", 0.1, t / 1e6, KC))
    # The whole layer: the catalogue's block-0 forward kernels one after the other on
    # the compute stream; flops counted as matmuls only (24 T h^2 + 4 T s h).
    kernels = [k for m in md.modules if m.block == 0 for k in m.fwd]
    t = chain_time_ns(one_gpu(preset), kernels, "fp16")
    flops = 24 * T * h * h + 4 * T * s * h
    rows.append(Row("G3", "whole layer (unfused attention)", f"{gpu}; catalogue gpt2 block 0 forward, {len(kernels)} "
                    "kernels in order (HF eager, PyTorch 1.10)", "TFLOPS", 92.0, flops / t / 1e3, KC,
                    note="taken as the layer's forward; matmul flops only"))
    return rows


def g4() -> list[Row]:
    note = "V100-SXM2-16GB measured; the p3dn V100-32GB has the same peak and HBM bandwidth"
    rows = [gemm_row("G4", f"V100 cuBLAS fp16 {n}^3", "p3dn", O.GemmShape(n, n, n), tf, "fp16", note=note)
            for n, tf in ((1024, 57.3), (4096, 95.7), (8192, 97.4))]
    rows.append(gemm_row("G4", "V100 bf16 (emulated) matmul", "p3dn", O.GemmShape(4096, 4096, 4096), 10.0, "bf16",
                         note="'about 10 TFLOPS', shape not stated: 4096^3"))
    return rows


def g5(tmp: Path) -> list[Row]:
    # SwiGLU MLP h 4096 (gate, act, up, down), the catalogue's llama block; tokens not
    # published: 8192 (micro-batch 2 x seq 4096). Forward kernels in order.
    rows = []
    for d_ff, tf in ((10922, 272.7), (10944, 398.4)):
        cfg = write_config(tmp, f"g5-{d_ff}", {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 1,
                                               "num_attention_heads": 32, "intermediate_size": d_ff,
                                               "vocab_size": 32000, "max_position_embeddings": 4096})
        md = describe(resolve_model(cfg), 2, 4096, 2)
        kernels = [k for m in md.modules if m.path.startswith("model.layers.0.mlp") for k in m.fwd]
        t = chain_time_ns(one_gpu("dgx-h100"), kernels, "bf16")
        flops = 3 * 2 * 8192 * 4096 * d_ff
        setup = ("dgx-h100 GPU; catalogue llama MLP forward (gate, act, up, product, down, the layer's residual "
                 "add), 8192 tokens (not published), bf16")
        rows.append(Row("G5", f"H100 SwiGLU MLP d_ff {d_ff}", setup, "TFLOPS", tf, flops / t / 1e3, KC,
                        note="matmul flops only; forward assumed"))
    return rows


def m1() -> list[Row]:
    # BabelStream's default arrays: 2^25 doubles each (array size not published).
    n = 2**25
    size = 8 * n
    rows = []
    for preset, gpu, data in (("azure-ndm-a100", "A100-80GB", (("copy", 1610), ("triad", 1700), ("dot", 1750))),
                              ("dgx-h100", "H100", (("copy", 2900), ("triad", 2970)))):
        for kernel, gbs in data:
            if kernel == "copy":
                op, moved = O.Copy(O.OpId(1), "compute", "copy", O.CopyDirection.D2D, size), 2 * size
            elif kernel == "triad":  # a = b + s * c
                op = O.Compute(O.OpId(1), "compute", "triad", O.ComputeKind.ELEMENTWISE, 2 * n, 2 * size, size)
                moved = 3 * size
            else:  # sum += a * b
                op = O.Compute(O.OpId(1), "compute", "dot", O.ComputeKind.REDUCTION, 2 * n, 2 * size, 8)
                moved = 2 * size
            t = kernel_time_ns(preset, op)
            kind = "Copy D2D" if isinstance(op, O.Copy) else f"{op.kind.value} Compute"
            rows.append(Row("M1", f"{gpu} STREAM {kernel}", f"{preset} GPU; {kind} over 2^25 fp64 "
                            f"({moved / 1e6:.0f} MB moved)", "GB/s", gbs, moved / t, KC,
                            note="array size not published: BabelStream's default"))
    return rows


def m2(tmp: Path) -> list[Row]:
    # apex issue 1037: B 32, S 512; hidden not stated: BERT-Large's 1024. The catalogue's
    # LayerNorm kernels (fwd reads and writes T x h; bwd reads 2 T x h, writes T x h), fp16.
    cfg = write_config(tmp, "m2-bert", {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 1,
                                        "num_attention_heads": 16, "intermediate_size": 4096, "vocab_size": 30522})
    md = describe(resolve_model(cfg), 32, 512, 2)
    ln = next(m for m in md.modules if m.path.endswith("attention.output.LayerNorm"))
    preset = "p4d"
    rows = []
    for k, pass_name, pubs in ((first(ln.fwd, O.ComputeKind.NORM), "forward", (("old apex", 896), ("tuned", 1258))),
                               (first(ln.bwd, O.ComputeKind.NORM), "backward", (("old apex", 572), ("tuned", 1163)))):
        t = kernel_time_ns(preset, kernel_op(k), "fp16")
        for which, gbs in pubs:
            rows.append(Row("M2", f"LayerNorm {pass_name}, {which} kernel", f"{preset} GPU A100-40GB (variant not "
                            f"named); catalogue LayerNorm {pass_name}, 32x512 tokens x 1024 (hidden assumed), fp16",
                            "GB/s", gbs, (k.bytes_read + k.bytes_written) / t, KC))
    # torch.nn.LayerNorm on 2048 x 2048 (dtype not stated: fp32, as autocast runs it),
    # the catalogue's forward kernel built with 4-byte elements
    t_el, dt = 2048 * 2048, 4
    k = first(Eager(dt).layer_norm("layernorm", 2048, 2048).fwd, O.ComputeKind.NORM)
    t = kernel_time_ns(preset, kernel_op(k), "fp32")
    rows.append(Row("M2", "torch.nn.LayerNorm 2048x2048", f"{preset} GPU A100-40GB (variant not named); LayerNorm "
                    "forward as the catalogue's, fp32 (dtype assumed)", "GB/s", 715.0, 2 * t_el * dt / t, KC))
    return rows


def m3(tmp: Path) -> list[Row]:
    # FlashAttention's benchmark (benchmarks/benchmark_flash_attention.py,
    # attention_pytorch): model dim 2048, batch 2 x seq 8192, non-causal, dropout 0,
    # forward flops 4 b s^2 h. Its kernels: q and k rearranged out of qkv (copies), the
    # scores by baddbmm (scale folded in), softmax, v rearranged (a copy), the einsum's bmm.
    rows = []
    for preset, gpu, hd, tf in (("azure-ndm-a100", "A100-80GB", 64, 46.0), ("dgx-h100", "H100", 128, 145.1)):
        nh, b, s = 2048 // hd, 2, 8192
        e = Eager(2)
        heads = (b, nh, s, hd)
        op = chain(e.copy("q", heads), e.copy("k", (b, nh, hd, s)), e.bmm("qk", b * nh, s, s, hd),
                   e.softmax("softmax", (b, nh, s, s)), e.copy("v", heads), e.bmm("av", b * nh, s, hd, s))
        t = chain_time_ns(one_gpu(preset), op.fwd, "fp16")
        flops = 4 * b * s * s * 2048
        rows.append(Row("M3", f"{gpu} unfused attention, head dim {hd}", f"{preset} GPU; eager attention kernels "
                        f"(3 copies, QK^T, softmax, AV), {nh} heads x {hd}, batch {b}, seq {s}, fp16", "TFLOPS", tf,
                        flops / t / 1e3, KC,
                        note="sets the softmax class's bandwidth (specs.SOFTMAX_BW_EFFICIENCY): a check of the mean"))
    return rows


# ---------------------------------------------------------------- interference


def beside(cluster: ClusterSpec, kernels: list[O.Compute], gather_bytes: int, lead: bool,
           precision: str = "bf16") -> tuple[float, bool]:
    """(time of ``kernels`` in order on the compute stream beside an all_gather of
    ``gather_bytes`` over the node / their time alone, whether the gather outlasted them).
    ``lead``: a 1-byte kernel runs first, so the gather is already in flight when the
    measured kernels start; else the gather and the first kernel start at the same time."""
    group = tuple(range(cluster.world_size))
    first = 2 if lead else 1
    ops: list[O.Op] = [collective_op(AG, gather_bytes, group, op_id=1, stream="allgather", dtype=O.DType.BF16)]
    if lead:
        ops.append(O.Compute(O.OpId(2), "compute", "lead", O.ComputeKind.ELEMENTWISE, 1, 1, 0))
    ops += [replace(k, id=O.OpId(first + 1 + i)) for i, k in enumerate(kernels)]
    ids = [first + 1 + i for i in range(len(kernels))]
    alone = run_ops(cluster, [replace(k, id=O.OpId(1 + i)) for i, k in enumerate(kernels)], precision)
    t_alone = sum(duration_ns(r) for r in alone.values())
    recs = run_ops(cluster, ops, precision)
    t_beside = sum(duration_ns(recs[i]) for i in ids)
    covered = recs[1].end_ns >= max(recs[i].end_ns for i in ids)
    return t_beside / t_alone, covered


def x1(tmp: Path) -> list[Row]:
    # A100-80GB node; the all_gather over its 8 GPUs (1 GiB, outlasting each kernel).
    # Shapes not published: a GPT-sized GEMM (275 GFLOP), the catalogue's eager attention
    # core of a GPT layer (h 1024, 16 heads, one sequence of 2048), an elementwise op of 32 MB.
    cl = cluster_preset("dgx-a100", 1)
    gemm = gemm_op(O.GemmShape(4096, 4096, 8192))
    cfg = write_config(tmp, "x1-gpt", {"model_type": "gpt2", "n_embd": 1024, "n_layer": 1, "n_head": 16,
                                       "vocab_size": 1000, "n_positions": 2048})
    md = describe(resolve_model(cfg), 1, 2048, 2)
    # the attention chain (QK^T to the probabilities' dropout) as one kernel's worth of work
    chain_ks = next(m for m in md.modules if m.path.endswith("attn.attn_dropout")).fwd
    att = O.Compute(O.OpId(1), "compute", "attention", O.ComputeKind.ATTENTION, sum(k.flops for k in chain_ks),
                    sum(k.bytes_read for k in chain_ks), sum(k.bytes_written for k in chain_ks),
                    first(chain_ks, O.ComputeKind.GEMM, "qk").gemm)
    elt = O.Compute(O.OpId(1), "compute", "elementwise", O.ComputeKind.ELEMENTWISE, 8 * 2**20, 16 * 2**20, 16 * 2**20)
    rows = []
    for k, what, pub in ((gemm, "GEMM 1.18 -> 2.08 ms", 2.08 / 1.18), (att, "attention 0.18 -> 0.33 ms", 0.33 / 0.18),
                         (elt, "elementwise 0.02 -> 0.05 ms", 0.05 / 0.02)):
        r, covered = beside(cl, [k], GiB, lead=False)
        r_lead, _ = beside(cl, [k], GiB, lead=True)
        rows.append(Row("X1", what, f"dgx-a100 1x8 A100-80GB; {k.label} ({shape_name(k.gemm) if k.gemm else '32 MB'}) "
                        f"and an all_gather of 1 GiB over 8 GPUs starting together", "ratio", pub, r, KC,
                        note=f"all_gather outlasts it: {covered}; with the gather already in flight: {r_lead:.3f}"))
    return rows


def layer_gemms(h: int, tokens: int) -> list[O.Compute]:
    """The four forward GEMMs of a GPT layer (QKV, out-projection, h->4h, 4h->h)."""
    shapes = [O.GemmShape(tokens, 3 * h, h), O.GemmShape(tokens, h, h), O.GemmShape(tokens, 4 * h, h),
              O.GemmShape(tokens, h, 4 * h)]
    return [gemm_op(g, i + 1) for i, g in enumerate(shapes)]


def x2() -> list[Row]:
    # H100: a GEMM of exactly one wave of 128x128 tiles (12 x 11 = 132 = the SMs); k not
    # published: 16384. The all_gather over one node's 8 GPUs, already in flight.
    cl = cluster_preset("dgx-h100", 1)
    g = O.GemmShape(12 * 128, 11 * 128, 16384)
    k = gemm_op(g)
    r, covered = beside(cl, [k], 4 * GiB, lead=True)
    t_alone = kernel_time_ns("dgx-h100", k)
    mfu_alone = g.flops / t_alone / cl.node.gpu.peak_tensor_flops_per_s * 1e9
    ag = O.Collective(O.OpId(1), "comm", "ag", O.CollectiveKind.ALL_GATHER, 4 * GiB, O.DType.BF16, tuple(range(8)))
    sms = SpecCostModel(cl).collective(ag).sms
    setup = (f"dgx-h100 1x8 H100; GEMM {shape_name(g)} bf16 (one wave) beside a 4 GiB all_gather in flight "
             f"(commsim: {sms} channels)")
    note = f"all_gather outlasts it: {covered}"
    return [Row("X2", "one-wave GEMM time beside all_gather (~2x)", setup, "ratio", 2.0, r, KC, note=note),
            Row("X2", "its MFU alone (80%)", setup, "MFU", 0.80, mfu_alone, KC),
            Row("X2", "its MFU beside the all_gather (47%)", setup, "MFU", 0.47, mfu_alone / r, KC, note=note)]


def x3() -> list[Row]:
    # The four GEMMs of a GPT layer (h 4096, 8192 tokens) on one 4-GPU node, beside an
    # all_gather of the next layer's parameters starting with them (as a prefetch does)
    # and sized to outlast them (8 GiB). A100 and H100 (the paper's MI250 / MI210: no preset).
    ratios = {}
    for preset in ("dgx-a100", "dgx-h100"):
        cl = cluster_preset(preset, 1, gpus_per_node=4)
        ratios[preset], covered = beside(cl, layer_gemms(4096, 8192), 8 * GiB, lead=False)
        assert covered, preset
    setup = ("dgx-a100 / dgx-h100 1x4; 4 GEMMs of a GPT layer (h 4096, 8192 tokens) beside an 8 GiB all_gather "
             "starting with them")
    detail = ", ".join(f"{p} {r:.3f}" for p, r in ratios.items())
    return [Row("X3", "overlapped compute slower, average 18.9%", setup, "ratio", 1.189,
                statistics.mean(ratios.values()), KC, note=f"mean of {detail}"),
            Row("X3", "overlapped compute slower, worst 40%", setup, "ratio", 1.40, max(ratios.values()), KC,
                note=f"max of {detail}")]


def x5() -> list[Row]:
    # the channels (one CTA, one SM each) of a 1 GiB all_reduce between two nodes, one GPU
    # on each: over one NIC (p3dn) and over eight (dgx-a100)
    rows = []
    for preset, nics, pub in (("p3dn", "one PCIe NIC", 2), ("dgx-a100", "8 NICs at 190 GB/s", 16)):
        cl = cluster_preset(preset, 2)
        gpn = cl.node.gpus_per_node
        ar = O.Collective(O.OpId(1), "comm", "ar", O.CollectiveKind.ALL_REDUCE, GiB, O.DType.BF16, (0, gpn),
                          reduce_op=O.ReduceOp.SUM)
        plan = SpecCostModel(cl).collective(ar)
        rows.append(Row("X5", f"SMs NCCL uses for {nics}", f"{preset} 2 nodes, one GPU each; 1 GiB all_reduce "
                        f"({plan.algorithm}): the channels of its plan", "SMs", pub, plan.sms, KC))
    return rows


def x6() -> list[Row]:
    # 8x V100 (p3dn node): sizes not in the issue. A Megatron-style pair: the 4h->h GEMM
    # of 8192 tokens at h 3072 and an all_reduce of its fp16 output (48 MiB), overlapped
    # (two streams, starting together) vs one after the other (one stream).
    cl = cluster_preset("p3dn", 1)
    group = tuple(range(8))
    g = O.GemmShape(8192, 3072, 4 * 3072)
    size = 8192 * 3072 * 2
    over = run_ops(cl, [collective_op(AR, size, group, 1, "comm", O.DType.FP16), gemm_op(g, 2)], "fp16")
    seq = run_ops(cl, [gemm_op(g, 1), collective_op(AR, size, group, 2, "compute", O.DType.FP16)], "fp16")
    t_over = max(r.end_ns for r in over.values()) - min(r.start_ns for r in over.values())
    t_seq = max(r.end_ns for r in seq.values()) - min(r.start_ns for r in seq.values())
    return [Row("X6", "overlapped/sequential GEMM+all_reduce (207/157)",
                f"p3dn 1x8 V100; GEMM {shape_name(g)} fp16 + all_reduce 48 MiB fp16 (sizes assumed)", "ratio",
                207 / 157, t_over / t_seq, KC,
                note=f"overlapped {t_over / 1e6:.2f} ms, sequential {t_seq / 1e6:.2f} ms")]


# ---------------------------------------------------------------- end to end


def ds(stage: int, micro: int, precision: str = "fp16", gas: int = 1, optimizer: str = "Lamb") -> dict:
    return {precision: {"enabled": True}, "optimizer": {"type": optimizer}, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas, "zero_optimization": {"stage": stage}}


def bert_large_config(tmp: Path) -> str:
    # BERT-Large (Devlin et al. 2019; HF bert-large-uncased config.json): the roberta-large
    # shape with BERT's vocabulary, positions and token types.
    return write_config(tmp, "bert-large", {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24,
                                            "num_attention_heads": 16, "intermediate_size": 4096,
                                            "vocab_size": 30522, "max_position_embeddings": 512,
                                            "type_vocab_size": 2})


def seqs_per_s(model: str, cluster: str, nodes: int, gpn: int | None, micro: int, seq: int,
               with_tflops: bool = False):
    """(sequences/s, OOM reason or None) predicted; with ``with_tflops`` also the model
    TFLOPS/GPU of that prediction (commsim's count of the model's flops)."""
    p = predict(Scenario(model=model, cluster=cluster, nodes=nodes, gpus_per_node=gpn, stage=0,
                         ds_config=ds(0, micro), seq=seq, checkpointing=False, mode="symmetric"))
    out = (p.metrics.tokens_per_s / seq, p.metrics.oom)
    return out + (p.metrics.model_tflops_per_gpu,) if with_tflops else out


def e1(tmp: Path) -> list[Row]:
    bert = bert_large_config(tmp)
    rows = []

    def row(what: str, cluster: str, nodes: int, gpn: int | None, micro: int, seq: int, pub: float, gpu: str,
            note: str = "") -> None:
        v, oom, tflops = seqs_per_s(bert, cluster, nodes, gpn, micro, seq, with_tflops=True)
        gpus = nodes * (gpn or 8)
        # the published rate in model TFLOPS/GPU by commsim's count of the padded model's
        # flops: beside G1's best GEMM on the GPU, what the run's kernels must have reached
        implied = "" if oom or not v else f"; the published rate is {tflops * pub / v:.0f} model TFLOPS/GPU"
        rows.append(Row("E1", what, f"{cluster} {nodes}x{gpn or 8} {gpu}; BERT-Large (bert config.json, vocab 30522), "
                        f"ZeRO-0, micro-batch {micro} x seq {seq}, fp16, fused-LAMB-as-Adam, no checkpointing "
                        f"({gpus} GPUs)", "seq/s", pub, None if oom else v, E2E,
                        note=(note or (oom or "")) + implied))

    a100 = "A100-80GB"
    for seq, micro, one, eight in ((128, 256, 580, 4591), (512, 32, 210, 1657)):
        # the mapping's effect: the catalogue's roberta-large (vocab 50265, 514 positions,
        # one token type) instead of the exact BERT-Large config
        exact, _ = seqs_per_s(bert, "dgx-a100", 1, 1, micro, seq)
        rl, _ = seqs_per_s("roberta-large", "dgx-a100", 1, 1, micro, seq)
        row(f"DGX A100 seq {seq} 1 GPU", "dgx-a100", 1, 1, micro, seq, one, a100,
            note=f"the roberta-large preset instead: {rl:.1f} seq/s ({100 * (rl - exact) / exact:+.1f}%)")
        row(f"DGX A100 seq {seq} 8 GPUs", "dgx-a100", 1, None, micro, seq, eight, a100)
    multi = {128: (256, (4553, 9191, 18119, 35774, 70555, 138294)), 512: (32, (1648, 3291, 6464, 13005, 25570, 49663))}
    for seq, (micro, pubs) in multi.items():
        for nodes, pub in zip((1, 2, 4, 8, 16, 32), pubs):
            row(f"DGX A100 seq {seq} {nodes} nodes", "dgx-a100", nodes, None, micro, seq, pub, a100,
                note="batch per GPU of the single-node runs assumed")
    note = "DGX-1 batch not in published-runs.md: 64 (seq 128) / 8 (seq 512) assumed"
    for seq, micro, one, eight in ((128, 64, 224, 1746), (512, 8, 75, 586)):
        row(f"DGX-1 V100 seq {seq} 1 GPU", "p3dn", 1, 1, micro, seq, one, "V100-32GB (DGX-1's node)", note)
        row(f"DGX-1 V100 seq {seq} 8 GPUs", "p3dn", 1, None, micro, seq, eight, "V100-32GB (DGX-1's node)", note)
    return rows


def phase_times_ms(pred) -> dict[str, float]:
    """Forward, backward (recompute and gradient reduction included) and optimizer times
    of the predicted step, as a synchronised wall-clock breakdown sees them: forward ends
    with its last op (any stream, host included), backward from there to its last op."""
    recs = [r for rr in pred.result.ranks.values() for r in rr.records]
    t0 = min(r.start_ns for r in recs)
    end = {ph: max((r.end_ns for r in recs if r.op.phase in phs), default=t0)
           for ph, phs in (("fwd", (O.Phase.FORWARD,)), ("bwd", (O.Phase.BACKWARD, O.Phase.RECOMPUTE)),
                           ("optimizer", (O.Phase.OPTIMIZER,)))}
    return {"fwd": (end["fwd"] - t0) / 1e6, "bwd": (end["bwd"] - end["fwd"]) / 1e6,
            "optimizer": (end["optimizer"] - end["bwd"]) / 1e6}


E2_MICRO, E2_SEQ = (4, 8, 16), (128, 256, 512)


def e2_phases(tmp: Path) -> tuple[dict, list, list]:
    """Forward / backward / optimizer times of the 5.1B bing_bert on one p4d node over
    the grid, for DeepSpeed 0.5.4 (``before-pr1188``: the state before PR 1188), 0.5.10
    (``baseline``: PR 1188's state, which 0.5.5 shipped), 0.6.0 (``optimized``) and
    ZeRO-2; and the grid points where all of them fit."""
    # bing_bert 5.1B (DeepSpeed PR 1188) with DeepSpeed's transformer kernel (commsim's
    # bing_bert family: one module per layer, DeepSpeed's fused kernels, attention
    # dropout and GELU recomputed in the kernel's backward), no layer-wise checkpointing.
    cfg = write_config(tmp, "bing-bert-5.1b", {"model_type": "bing_bert", "hidden_size": 2560, "num_hidden_layers": 64,
                                               "num_attention_heads": 40, "intermediate_size": 10240,
                                               "vocab_size": 32003, "max_position_embeddings": 512,
                                               "type_vocab_size": 2})
    presets = (("z3 0.5.4", 3, "before-pr1188"), ("z3 0.5.10", 3, "baseline"), ("z3 0.6.0", 3, "optimized"),
               ("z2", 2, "current"))
    points = [(micro, seq) for micro in E2_MICRO for seq in E2_SEQ]
    phases: dict[tuple[str, int, int], dict[str, float] | None] = {}
    for name, stage, preset in presets:
        for micro, seq in points:
            p = predict(Scenario(model=cfg, cluster="p4d", nodes=1, stage=stage, preset=preset,
                                 ds_config=ds(stage, micro), seq=seq, checkpointing=False, mode="symmetric"))
            phases[name, micro, seq] = None if p.metrics.oom else phase_times_ms(p)
    # The published figures come from one setup run under each version: the range is over
    # the points where every one fits (at the largest points every version runs out of
    # the A100-40GB's memory; at 16 x 256 ZeRO-2, which keeps every fp16 parameter,
    # runs out where ZeRO-3 does not).
    fit = [(m, s) for m, s in points if all(phases[name, m, s] is not None for name, _, _ in presets)]
    return phases, fit, points


def e2(tmp: Path) -> list[Row]:
    # PR 1188 was merged between DeepSpeed 0.5.4 and 0.5.5; 0.5.5-0.5.10 ship its state
    # (research note deepspeed-zero3-versions.md section 10.2), so its "after" figures are
    # the baseline's (0.5.10), its "before" figures 0.5.4's (before-pr1188).
    phases, fit, points = e2_phases(tmp)
    grid = f"micro-batch {'/'.join(map(str, E2_MICRO))} x seq {'/'.join(map(str, E2_SEQ))}"

    def setup(name: str) -> str:
        what = {"z3 0.5.4": "ZeRO-3 DeepSpeed 0.5.4 (before-pr1188)", "z3 0.5.10": "ZeRO-3 DeepSpeed 0.5.10 (baseline)",
                "z3 0.6.0": "ZeRO-3 DeepSpeed 0.6.0 (optimized)", "z2": "ZeRO-2"}[name]
        return (f"p4d 1x8 A100-40GB; 5.1B bing_bert with DeepSpeed's transformer kernel (h 2560, 64 layers, "
                f"40 heads, FFN 10240, vocab 32003), "
                f"{what}, fp16, no checkpointing; range over {grid} where every version fits")

    fit_note = (f"{len(fit)} of {len(points)} points fit under ZeRO-3: "
                + " ".join(f"{m}x{s}" for m, s in fit))
    pr = "DeepSpeed PR 1188 text"
    cm = "the PR's final commit message"
    rows = []
    for name, phase, pub, src in (("z3 0.5.10", "fwd", 270, f"{pr}, after the PR"),
                                  ("z3 0.5.10", "bwd", 670, f"{pr}, after the PR"),
                                  ("z3 0.5.10", "fwd", 200, f"{cm}, after"), ("z3 0.5.10", "bwd", 610, f"{cm}, after"),
                                  ("z3 0.5.4", "fwd", 470, f"{pr}, before the PR"),
                                  ("z3 0.5.4", "bwd", 900, f"{pr}, before the PR"),
                                  ("z3 0.5.4", "fwd", 300, f"{cm}, before"), ("z3 0.5.4", "bwd", 680, f"{cm}, before"),
                                  ("z2", "fwd", 60, pr)):
        values = [phases[name, m, s][phase] for m, s in fit]
        rows.append(range_row("E2", f"{name} {phase} ({src})", setup(name), "ms", pub, values, E2E, note=fit_note))

    def ratio_row(what: str, num: str, den: str, phase: str, pub: float, den_phase: str | None = None) -> Row:
        """num / den point by point (both versions at the same micro-batch and sequence)."""
        values = [phases[num, m, s][phase] / phases[den, m, s][den_phase or phase] for m, s in fit]
        return range_row("E2", what, setup(num) + f"; {den[3:] if den.startswith('z3') else 'ZeRO-2'} at the same "
                         "point", "x", pub, values, E2E, note=fit_note)

    rows.append(ratio_row("z3 0.5.10 fwd / z2 fwd (270 / 60, after the PR)", "z3 0.5.10", "z2", "fwd", 270 / 60))
    rows.append(ratio_row("z3 0.5.4 fwd / z2 fwd (470 / 60, before the PR: 'about 8x')", "z3 0.5.4", "z2", "fwd",
                          470 / 60))
    for phase, before, after, src in (("fwd", 470, 270, pr), ("bwd", 900, 670, pr), ("fwd", 300, 200, cm),
                                      ("bwd", 680, 610, cm)):
        rows.append(ratio_row(f"z3 {phase} before / after PR 1188 ({before} / {after}, {src})", "z3 0.5.4",
                              "z3 0.5.10", phase, before / after))
    # "about 1.1 ms saved per all-gather of one layer": bing_bert's DeepSpeed transformer
    # layer is one module, one gather a forward; the forward's saving over its 64 layers
    saved = [(phases["z3 0.5.4", m, s]["fwd"] - phases["z3 0.5.10", m, s]["fwd"]) / 64 for m, s in fit]
    rows.append(range_row("E2", "forward time PR 1188 saved per layer's all-gather", setup("z3 0.5.4")
                          + "; 0.5.10 at the same point; the forward's difference over 64 layers", "ms", 1.1, saved,
                          E2E, note=fit_note))
    return rows


def e3(tmp: Path) -> list[Row]:
    # Megatron-LM 1.7B GPT (arXiv 2104.04473 Table 1: h 2304, 24 layers, 24 heads), a gpt2
    # config.json; 32 GPUs = 4 DGX A100 nodes; global batch 512 = 16 sequences per GPU
    # per step; the micro-batch is not published: 2, 4, 8 or 16 with accumulation.
    cfg = write_config(tmp, "megatron-1.7b", {"model_type": "gpt2", "n_embd": 2304, "n_layer": 24, "n_head": 24,
                                              "n_inner": 4 * 2304, "vocab_size": 51200, "n_positions": 2048})
    values = []
    micros = (2, 4, 8, 16)
    for micro in micros:
        p = predict(Scenario(model=cfg, cluster="dgx-a100", nodes=4, stage=0, ds_config=ds(0, micro, gas=16 // micro,
                                                                                          optimizer="Adam"),
                             seq=2048, checkpointing=True, mode="symmetric"))
        if not p.metrics.oom:
            values.append(p.metrics.hardware_tflops_per_gpu)
    return [range_row("E3", "1.7B GPT TFLOPS/GPU with recompute",
                      f"dgx-a100 4x8 A100-80GB; gpt2 config.json (h 2304, 24 layers, 24 heads, vocab 51200), ZeRO-0, "
                      f"seq 2048, 16 seq/GPU/step as micro-batch {'/'.join(map(str, micros))} x accumulation, fp16, "
                      "layer-wise checkpointing; Megatron's formula with recompute", "TFLOPS", 137.0, values, E2E)]


def e4(tmp: Path) -> list[Row]:
    # A 10B GPT (shape not published: roberta-10b's, h 5120, 32 layers, 40 heads, as a gpt2
    # config.json, seq 1024 of Megatron's GPT-2) on one DGX-2: 16 V100-32GB on NVSwitch at
    # 150 GB/s one way per GPU (NVIDIA DGX-2 datasheet). No preset: the p3dn node with 16
    # GPUs per node (p3dn's V100-32GB and its 150 GB/s NVLink per GPU; its ring efficiency
    # is the hybrid cube mesh's assumption, not NVSwitch's; the fabric is unused in one node).
    cfg = write_config(tmp, "gpt-10b", {"model_type": "gpt2", "n_embd": 5120, "n_layer": 32, "n_head": 40,
                                        "n_inner": 4 * 5120, "vocab_size": 50257, "n_positions": 1024})
    values, ooms = [], 0
    micros = (4, 8, 16)
    for preset in ("baseline", "optimized"):
        for micro in micros:
            p = predict(Scenario(model=cfg, cluster="p3dn", nodes=1, gpus_per_node=16, stage=3, preset=preset,
                                 ds_config=ds(3, micro, optimizer="Adam"), seq=1024, checkpointing=True,
                                 mode="symmetric"))
            if p.metrics.oom:
                ooms += 1
            else:
                values.append(p.metrics.hardware_tflops_per_gpu)
    return [range_row("E4", "ZeRO-3 10B on a DGX-2, TFLOPS/GPU",
                      f"p3dn node with 16 GPUs (DGX-2 stand-in) V100-32GB; gpt2 config.json h 5120, 32 layers, "
                      f"40 heads (shape assumed), ZeRO-3 baseline and optimized, micro-batch "
                      f"{'/'.join(map(str, micros))} x seq 1024, fp16, layer-wise checkpointing, no offload; "
                      "Megatron's formula with recompute",
                      "TFLOPS", 63.0, values, E2E, note=f"{len(values)} of {len(values) + ooms} points fit in memory")]


def e5(tmp: Path) -> list[Row]:
    # IBM fms-fsdp (2024) on 128 A100-80GB = 16 nodes: Llama-2 shapes (34B: CodeLlama's,
    # 8 key-value heads; 70B: 8), seq 4096, bf16, SDPA flash attention (the catalogue's
    # Hugging Face Llama with attn_implementation "sdpa"; fms's own Llama module is
    # assumed to launch the same kernels). FSDP there (FSDP1) is modelled by the FSDP2
    # generator: one unit per block and the root; mixed precision bf16 for parameters
    # and gradient reduction (fms-fsdp's bf16 policy, assumed); hybrid sharding = HSDP,
    # sharded inside a node, replicated across the 16. The network is not stated: the
    # range is over DGX A100's 8x200 Gb/s InfiniBand and p4de's 4x100 Gb/s EFA, on the
    # NCCL of 2023-2024 (stack "2023").
    shapes = {"7b": (4096, 32, 32, 32, 11008), "13b": (5120, 40, 40, 40, 13824), "34b": (8192, 48, 64, 8, 22016),
              "70b": (8192, 80, 64, 8, 28672)}
    runs = [("7b", True, 2, False, 3760.0), ("13b", True, 1, False, 1700.0), ("34b", False, 8, True, 772.0),
            ("70b", False, 6, True, 380.0)]
    seq, nodes = 4096, 16
    rows = []
    for name, hybrid, micro, ckpt, published in runs:
        h, layers, heads, kv, ffn = shapes[name]
        cfg = write_config(tmp, f"llama-{name}", {"model_type": "llama", "hidden_size": h, "num_hidden_layers": layers,
                                                  "num_attention_heads": heads, "num_key_value_heads": kv,
                                                  "intermediate_size": ffn, "vocab_size": 32000,
                                                  "max_position_embeddings": seq, "attn_implementation": "sdpa"})
        fsdp = {"mp_param_dtype": "bf16", "mp_reduce_dtype": "bf16"}
        if hybrid:
            fsdp["hsdp_replicas"] = nodes
        values = []
        for net in ("ib", "efa"):
            p = predict(Scenario(model=cfg, strategy="fsdp2", fsdp_config=fsdp, cluster="dgx-a100", nodes=nodes,
                                 net=net, nccl_stack="2023", micro_batch=micro, seq=seq, checkpointing=ckpt,
                                 mode="symmetric"))
            if not p.metrics.oom:
                values.append(micro * seq / p.metrics.step_time_s)
        sharding = "hybrid (HSDP 16 x 8)" if hybrid else "full"
        rows.append(range_row("E5", f"Llama-2 {name} tokens/GPU/s, {sharding} sharding",
                              f"16x dgx-a100 A100-80GB, IB 8x200 or EFA 4x100 (not stated), NCCL 2.18; Llama "
                              f"{name} (h {h}, {layers} layers, {heads} heads, {kv} kv heads), SDPA, FSDP2 {sharding}, "
                              f"bf16, micro-batch {micro} x seq {seq}, "
                              f"{'layer-wise checkpointing' if ckpt else 'no checkpointing'}",
                              "tok/s", published, values, E2E, note="range over the two networks"))
    return rows


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
            "FSDP1 (FULL_SHARD, its limit_all_gathers rate limiter, the mechanism behind the retries): commsim "
            "generates FSDP2, which has no rate limiter; the 'other 7B model' is not named"),
    Skipped("A3", "torch.cuda.empty_cache() every step: about 80 ms a step",
            "no IR op for an explicit cache flush; the PR's model and batch are not given"),
    Skipped("A4", "fms-fsdp batch 12 / 14: 6.83 / 4.91 samples/s; T5-11B on 2 p4d: 5.81 s/batch",
            "FSDP1 runs (FULL_SHARD, its rate limiter): commsim generates FSDP2; no encoder-decoder (T5) "
            "family in the catalogue"),
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


# ---------------------------------------------------------------- output


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1000:
        return f"{v:.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def summary(rows: list[Row], group: str) -> dict:
    errs = [abs(r.error) for r in rows if r.group == group and r.error is not None]
    return {"summary": group, "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None, "items": len(errs)}


def summary_line(s: dict) -> str:
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"
    return (f"{s['summary']}: median |error| = {pct(s['median_abs_error'])}  "
            f"max |error| = {pct(s['max_abs_error'])}  items = {s['items']}")


def family(item: str) -> str:
    """The README's grouping of items: collectives over EFA (N), NVSwitch / InfiniBand (I),
    GEMMs and layers (G), memory-bound kernels (M), interference (X); each end-to-end item
    on its own."""
    return item if item.startswith("E") else item[0]


def family_summaries(rows: list[Row]) -> list[dict]:
    """Median and max |error| of each family's rows, in the order the rows came."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if r.error is not None:
            out.setdefault(family(r.item), []).append(abs(r.error))
    return [{"family": f, "median_abs_error": statistics.median(e), "max_abs_error": max(e), "items": len(e)}
            for f, e in out.items()]


def print_families(fams: list[dict]) -> None:
    print("by family (|error| of each row; a range row compares the middle of its range):")
    for f in fams:
        print(f"  {f['family']:<3} rows {f['items']:>4}  median {100 * f['median_abs_error']:5.1f}%  "
              f"max {100 * f['max_abs_error']:6.1f}%")
    print()


def print_table(rows: list[Row], skipped: list[Skipped]) -> None:
    head = f"{'item':<4} {'what':<46} {'published':>14} {'predicted':>24} {'error':>8}  {'unit':<10} setup"
    print(head)
    print("-" * len(head))
    for r in rows:
        pub = fmt(r.published)
        if r.published_range is not None:
            pub += f" ({fmt(r.published_range[0])}-{fmt(r.published_range[1])})"
        if r.predicted_range is not None:
            inside = "in" if r.in_range else "out"
            pred = f"{fmt(r.predicted)} ({fmt(r.predicted_range[0])}-{fmt(r.predicted_range[1])} {inside})"
        else:
            pred = fmt(r.predicted)
        err = "-" if r.error is None else f"{100 * r.error:+.1f}%"
        print(f"{r.item:<4} {r.what:<46} {pub:>14} {pred:>24} {err:>8}  {r.unit:<10} {r.setup}"
              + (f"  [{r.note}]" if r.note else ""))
    if skipped:
        print("\nskipped (not expressible today):")
        for s in skipped:
            print(f"  {s.item:<4} {s.what}: {s.reason}")
    print()


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
    skipped = [s for s in SKIPPED if s.item in wanted]
    sums = [summary(rows, KC), summary(rows, E2E)]
    fams = family_summaries(rows)
    if args.json:
        for r in rows:
            print(json.dumps(r.to_json()))
        for s in skipped:
            print(json.dumps({"item": s.item, "what": s.what, "skipped": s.reason}))
        for f in fams:
            print(json.dumps(f))
        for s in sums:
            print(json.dumps(s))
        return 0
    print_table(rows, skipped)
    print_families(fams)
    for s in sums:
        print(summary_line(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
