"""Collectives as NCCL runs them, from public specs (NVIDIA/nccl src/graph/tuning.cc).

time = latency + bytes / bandwidth; ring latency = base + intra-node steps x NVLink hop
+ inter-node steps x network hop (+ the fabric's own latency per network step), with
the LL protocol (lower latency, half the bandwidth: 8-byte lines carry 4 data bytes)
and Simple (full bandwidth); a double binary tree for all-reduce across nodes. The
cheapest option is chosen per call, as NCCL's tuner does. The bytes are *demands* on
each node's NVLink ports and NICs, which the simulator shares between concurrent
transfers.
"""

from __future__ import annotations

from math import ceil, log2
from typing import Callable

from commsim.hardware.links import CollectivePlan, Link, LinkKind
from commsim.hardware.specs import US
from commsim.ir import ops as O

# NCCL tuning.cc (2.18+): base latency per algorithm/protocol and per-hop latencies, us.
NCCL_BASE_LAT_US = {("ring", "LL"): 6.6, ("ring", "Simple"): 8.4, ("tree", "LL"): 6.8, ("tree", "Simple"): 6.8}
NCCL_NVLINK_HOP_US = {("ring", "LL"): 0.6, ("ring", "Simple"): 3.4, ("tree", "LL"): 0.6, ("tree", "Simple"): 4.0}
NCCL_NET_HOP_US = {("ring", "LL"): 2.7, ("ring", "Simple"): 14.0, ("tree", "LL"): 5.0, ("tree", "Simple"): 14.0}
PROTOCOL_BW_FACTOR = {"LL": 0.5, "Simple": 1.0}  # LL: 4 data bytes per 8-byte line
NCCL_CHANNELS = 8  # CTAs (SMs) NCCL occupies while a collective runs (NCCL_MIN_NCHANNELS class)
# HBM traffic per byte a GPU sends: its source read and the destination written; a
# reduction reads the received data again ("2-3x its wire bytes": published-runs.md X1)
HBM_PER_WIRE_BYTE = {O.CollectiveKind.ALL_GATHER: 2.0, O.CollectiveKind.BROADCAST: 2.0,
                     O.CollectiveKind.REDUCE_SCATTER: 3.0, O.CollectiveKind.ALL_REDUCE: 3.0}


def nccl_plan(op: O.Collective, node_of: Callable[[int], int], fabric_latency_ns: int,
              capacity: Callable[[Link], float], local_ns: int) -> CollectivePlan:
    """The cheapest of NCCL's options for ``op``; ``local_ns`` for a group of one."""
    group = op.group
    p = len(group)
    nodes = sorted({node_of(r) for r in group})
    n = len(nodes)
    g = max(sum(1 for r in group if node_of(r) == nd) for nd in nodes)
    s = float(op.size_bytes)
    if p == 1:
        return CollectivePlan("local", local_ns, ())
    kind = op.kind
    # Bytes through each link, one direction, for a ring: every rank sends (p-1)/p of
    # the buffer per pass (two passes for all-reduce); a node's NICs carry what its
    # ring crosses (nccl-tests PERFORMANCE.md busbw factors).
    passes = 2.0 if kind is O.CollectiveKind.ALL_REDUCE else 1.0
    ring_bytes = passes * s * (p - 1) / p
    if kind is O.CollectiveKind.BROADCAST:
        ring_bytes = s
    steps = int(passes * (p - 1))
    inter_steps = int(passes * (n - 1))
    options = []
    for proto in ("LL", "Simple"):
        lat_us = (NCCL_BASE_LAT_US[("ring", proto)] + (steps - inter_steps) * NCCL_NVLINK_HOP_US[("ring", proto)]
                  + inter_steps * NCCL_NET_HOP_US[("ring", proto)])
        lat_ns = int(lat_us * US) + inter_steps * fabric_latency_ns
        demand = ring_bytes / PROTOCOL_BW_FACTOR[proto]
        dem = [(Link(LinkKind.NVLINK, nd), demand) for nd in nodes]
        if n > 1:
            dem += [(Link(LinkKind.NIC, nd), demand) for nd in nodes]
        options.append((f"ring/{proto}", lat_ns, tuple(dem)))
        if kind is O.CollectiveKind.ALL_REDUCE and n > 1:
            # Double binary tree: a node sends and receives the buffer once each way;
            # intra-node chain of g ranks, log2(n) network hops, up and down.
            lat_us = (NCCL_BASE_LAT_US[("tree", proto)]
                      + 2 * ((g - 1) * NCCL_NVLINK_HOP_US[("tree", proto)]
                             + ceil(log2(n)) * NCCL_NET_HOP_US[("tree", proto)]))
            lat_ns = int(lat_us * US) + 2 * ceil(log2(n)) * fabric_latency_ns
            tdem = s / PROTOCOL_BW_FACTOR[proto]
            options.append((f"tree/{proto}", lat_ns,
                            tuple([(Link(LinkKind.NVLINK, nd), tdem) for nd in nodes]
                                  + [(Link(LinkKind.NIC, nd), tdem) for nd in nodes])))

    def est(o: tuple[str, int, tuple]) -> float:
        return o[1] + max(b / capacity(l) for l, b in o[2]) * 1e9

    algo, lat, dem = min(options, key=est)
    wire = max(b for _, b in dem)  # one GPU's bytes on its busiest link
    return CollectivePlan(algo, lat, dem, NCCL_CHANNELS, HBM_PER_WIRE_BYTE[kind] * wire)
