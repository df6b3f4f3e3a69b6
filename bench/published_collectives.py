"""bench/validate_published.py's collective items: N (nccl-tests over EFA: p4de, p5, p3dn)
and I (NVSwitch nodes and InfiniBand: A100, H100, H200).

Each figure is a one-op schedule, one collective over every GPU of the cluster, through
the simulator in symmetric mode on the software stack the source names (or the nearest,
said in the row's note): its time, or nccl-tests' bus bandwidth. Nodes that
commsim/hardware/specs.py has no preset for are built here from its parts, citing the
public spec. Not a script: validate_published runs the items."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is imported

from commsim.hardware.costs import SpecCostModel  # noqa: E402
from commsim.hardware.specs import A100_80, H200, IB_HDR_8, NODE_PRESETS, ClusterSpec, cluster_preset  # noqa: E402
from commsim.hardware.stacks import STACKS  # noqa: E402
from commsim.ir import ops as O  # noqa: E402

from published_rows import AG, AR, KC, RS, GiB, KiB, MiB, Row, duration_ns, run_ops  # noqa: E402


# ---------------------------------------------------------------- one collective, in nccl-tests' terms


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
