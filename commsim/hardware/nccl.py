"""Collectives as NCCL decides and runs them, from public specs and NCCL's own constants.

**Deciding.** For every collective NCCL prices each (algorithm, protocol) pair with its
tuning model (src/graph/tuning.cc, per version: ``nccl_tuning``) and runs the cheapest:

    time = latency + bytes / bandwidth
    latency: base + hops x per-hop latency (NVLink inside a node, the network between
             nodes, plus the latency the net plugin reports: ``stacks``)
    bandwidth: the bus bandwidth of the links the algorithm uses, refined per protocol
             (LL at 1/4 and at most llMaxBw, LL128 at 92% and at most 20-37 GB/s per
             channel, the tree at 92% and at most perChMaxTreeBw per channel), converted
             to algorithm bandwidth (ring: ranks / steps; tree: 1/2), and for the tree
             the medium-size correction NCCL applies ("trees are not perfectly sticking
             to the model for medium sizes")

Algorithms: the ring (all kinds), the double binary tree across nodes with a chain
inside each node (all-reduce), NVLS (NVLink SHARP, all-reduce on one H100/H200 node) and
NVLS tree (across H100 nodes) where the NCCL version has them. Protocols: LL, LL128,
Simple, less those NCCL's rules or the plugin switch off. Where the plugin's own tuner
is on (aws-ofi-nccl on the p5 family), it decides instead, from its model of the real
network: the time below. The choice is made per call; the engine caches plans per
(kind, size, group).

**Running.** The chosen pair then costs what it costs on this machine, which NCCL's
tuner does not always know (it takes a network hop for 2.7-14 us; on EFA one costs tens
of microseconds more). The plan handed to the simulator is, as ever, a latency plus
byte demands on typed links (``links.CollectivePlan``), so that concurrent collectives
share the links:

* latency: NCCL's base and per-hop latencies (of the stack's NCCL version) along the
  algorithm's critical path, with each network crossing costing NCCL's network hop plus
  the fabric's own extra (``FabricSpec.latency_ns``), twice for Simple: NCCL's tuner
  counts the network's latency twice for Simple (the data, then the receive's flush /
  completion before the GPU may read it), and so do the EFA runs (published-runs.md N4's
  per-node slope); LL and LL128 carry their flags in the data, which the GPU polls. The
  number of crossings is the real one: a ring all-reduce's longest path crosses 2N node
  boundaries (N for all-gather / reduce-scatter), the double binary tree is as deep as
  NCCL builds it (src/graph/trees.cc), up and down;
* demands: the bytes each link carries, times the protocol's wire overhead (an LL line
  carries 8 data bytes in 16, an LL128 line 120 in 128): those bytes really cross the
  link, so they are demands the fluid network shares. The ring sends 2(p-1)/p of the
  buffer per rank (all-reduce); the tree sends a node's share to its parent and its
  children, S/2 per tree edge, so a node carries S each way at two nodes and about 2S
  from three nodes up; NVLS moves about S each way through each GPU's port;
* what is neither latency nor wire bytes (the protocol's thread throughput behind LL's
  1/4 and llMaxBw, per-channel ceilings, the tree's 92% and its medium-size correction,
  fewer channels for small messages): the time by NCCL's bandwidth model minus the time
  the links alone would take, added as latency. It is not a link's load: it is the
  collective's own SMs being slow, so it must not take link bandwidth from others that
  run at the same time (adding it as bytes would); it is also not shared, so two such
  collectives at once each pay it in full, which is what their own CTAs do.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import ceil, inf
from typing import Callable

from commsim.hardware.links import CollectivePlan, Link, LinkKind
from commsim.hardware.nccl_messages import log2i, message_extra_us, network_messages
from commsim.hardware.nccl_tuning import (MAX_NTHREADS, MAXCHANNELS, PROTOCOLS, THREAD_THRESHOLD, WIRE_FACTOR,
                                          NcclTuning, arch_of)
from commsim.hardware.specs import NodeSpec
from commsim.ir import ops as O

# HBM traffic per byte a GPU sends: its source read and the destination written; a
# reduction reads the received data again ("2-3x its wire bytes": published-runs.md X1)
HBM_PER_WIRE_BYTE = {O.CollectiveKind.ALL_GATHER: 2.0, O.CollectiveKind.BROADCAST: 2.0,
                     O.CollectiveKind.REDUCE_SCATTER: 3.0, O.CollectiveKind.ALL_REDUCE: 3.0}

# NVLS all-reduce on one H100 node: about 480 GB/s busbw (NVIDIA/nccl-tests issue 212;
# shared/reference/hardware.md), i.e. what the NVSwitch's in-switch reduction sustains:
# algbw = busbw / (2 (8-1)/8). A collective item's figure (hardware.md), used as the
# NVLS ceiling per H100/H200 NVSwitch node.
NVLS_BUSBW_BYTES_PER_S = 480e9
US_PER_S = 1e6

AR = O.CollectiveKind.ALL_REDUCE
AG = O.CollectiveKind.ALL_GATHER
RS = O.CollectiveKind.REDUCE_SCATTER
BCAST = O.CollectiveKind.BROADCAST


# ---------------------------------------------------------------- the double binary tree


def _btree(nranks: int, rank: int) -> tuple[int, tuple[int, ...]]:
    """(parent, children) of ``rank`` in NCCL's binary tree (src/graph/trees.cc ncclGetBtree)."""
    bit = 1
    while bit < nranks:
        if bit & rank:
            break
        bit <<= 1
    if rank == 0:
        return -1, ((bit >> 1,) if nranks > 1 else ())
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    lowbit = bit >> 1
    down0 = -1 if lowbit == 0 else rank - lowbit
    down1 = -1 if lowbit == 0 else rank + lowbit
    while down1 >= nranks:
        down1 = -1 if lowbit == 0 else rank + lowbit
        lowbit >>= 1
    return up, tuple(c for c in (down0, down1) if c != -1)


def _dtree(nranks: int, rank: int) -> tuple[tuple[int, tuple[int, ...]], tuple[int, tuple[int, ...]]]:
    """Both trees of NCCL's double binary tree (ncclGetDtree): the second is the first
    mirrored (even counts) or shifted by one (odd counts)."""
    first = _btree(nranks, rank)
    if nranks % 2 == 1:
        u, ch = _btree(nranks, (rank - 1 + nranks) % nranks)
        second = (-1 if u == -1 else (u + 1) % nranks, tuple((c + 1) % nranks for c in ch))
    else:
        u, ch = _btree(nranks, nranks - 1 - rank)
        second = (-1 if u == -1 else nranks - 1 - u, tuple(nranks - 1 - c for c in ch))
    return first, second


@lru_cache(maxsize=None)
def dtree_shape(nodes: int) -> tuple[int, int]:
    """(the most tree edges any node has over both trees, the deeper tree's height) of
    NCCL's double binary tree over ``nodes`` nodes. Each tree carries half the buffer
    and a node moves S/2 over each of its edges in each direction, so the busiest node's
    NIC carries edges x S/2 each way: S at 2 nodes, about 2S from 3 up."""
    if nodes <= 1:
        return 0, 0
    edges = 0
    heights = [0, 0]
    for r in range(nodes):
        trees = _dtree(nodes, r)
        edges = max(edges, sum((parent != -1) + len(ch) for parent, ch in trees))
        for t, _ in enumerate(trees):
            depth, x = 0, r
            while True:
                parent = _dtree(nodes, x)[t][0]
                if parent == -1:
                    break
                depth, x = depth + 1, parent
            heights[t] = max(heights[t], depth)
    return edges, max(heights)


# ---------------------------------------------------------------- the model


@dataclass(frozen=True, slots=True)
class Option:
    """One (algorithm, protocol) for one call: NCCL's estimate and what it costs here."""

    algorithm: str
    protocol: str
    size_bytes: float
    channels: int  # channels the call runs on (after NCCL's cut for small messages)
    tuner_us: float  # the deciding tuner's estimate
    latency_us: float  # executed latency: hops along the critical path
    bw_bytes_per_s: float  # executed algorithm bandwidth by NCCL's bandwidth model
    demands: tuple[tuple[Link, float], ...]  # wire bytes per link

    @property
    def name(self) -> str:
        return f"{self.algorithm}/{self.protocol}"


class NcclModel:
    """NCCL's decisions and their costs on one node type, fabric and software stack."""

    def __init__(self, node: NodeSpec):
        stack = node.stack
        fabric = node.fabric
        self.tuning: NcclTuning = stack.tuning
        self.arch = arch_of(node.gpu.name)
        efa = fabric.kind == "efa"
        # the latency the plugin reports to NCCL's tuner (us), and the fabric's real one
        self.plugin_lat_us = stack.plugin_latency_us(fabric.instance) if efa else 0.0
        self.fabric_lat_us = fabric.latency_ns / 1000
        self.plugin_tuner = efa and stack.tuner_on(fabric.instance)
        self.protocols = (stack.efa_protocols(fabric.instance) if efa else None) or PROTOCOLS
        # NCCL enables LL128 by default only on Volta / Ampere (and Hopper from 2.18,
        # as I recall) with NVLink inside the node and, across nodes, the NIC reached
        # through PCIe switches with GPUDirect RDMA (tuning.cc; p3dn's EFA has no GDR).
        ll128_arch = self.arch in ("volta", "ampere") or (self.arch == "hopper" and self.tuning.release >= (2, 18))
        self.ll128_intra = ll128_arch
        self.ll128_net = ll128_arch and fabric.instance != "p3dn.24xlarge"
        # NVLS needs NVSwitch with SHARP: the H100/H200 SXM nodes (NCCL 2.17+)
        self.nvls = self.tuning.has_nvls and self.arch == "hopper"
        self.c_intra = node.nccl_channels
        self.c_inter = min(MAXCHANNELS, 2 * fabric.nics_per_node)  # X5: 2 per NIC
        self.nvls_algbw = NVLS_BUSBW_BYTES_PER_S * 8 / (2 * 7)
        # a network message's own cost (nccl_messages), and one inter-node channel's share
        # of the node's NICs at line rate
        self.message_us = fabric.message_ns / 1000
        self.channel_line = fabric.nics_per_node * fabric.nic_rate_bytes_per_s / self.c_inter
        self.fabric_efficiency = fabric.efficiency

    # ------------------------------------------------------------ per call
    def options(self, op: O.Collective, node_of: Callable[[int], int],
                capacity: Callable[[Link], float]) -> list[Option]:
        """Every (algorithm, protocol) NCCL would consider for ``op``, priced."""
        group = op.group
        p = len(group)
        per_node: dict[int, int] = {}
        for r in group:
            nd = node_of(r)
            per_node[nd] = per_node.get(nd, 0) + 1
        nodes = sorted(per_node)
        n = len(nodes)
        g = max(per_node.values())
        kind = op.kind
        s = float(op.size_bytes)
        channels = self.c_intra if n == 1 else self.c_inter
        # the links' bandwidth as the simulator will share it (the busiest node's)
        nvl_bw = min(capacity(Link(LinkKind.NVLINK, nd)) for nd in nodes)
        nic_bw = min(capacity(Link(LinkKind.NIC, nd)) for nd in nodes) if n > 1 else inf
        algos = ["ring"]
        if kind is AR:
            algos.append("tree")
            if self.nvls and g > 1:
                algos.append("nvls" if n == 1 else "nvls_tree")
        out = []
        for a in algos:
            for proto in self.protocols:
                if a.startswith("nvls") and proto != "Simple":
                    continue  # NVLS runs Simple only
                if proto == "LL128" and not (self.ll128_net if n > 1 else self.ll128_intra):
                    continue
                out.append(self._price(a, proto, kind, s, p, n, g, nodes, channels, nvl_bw, nic_bw, capacity))
        return out

    def plan(self, op: O.Collective, node_of: Callable[[int], int], capacity: Callable[[Link], float],
             local_ns: int) -> CollectivePlan:
        """The cheapest option by the deciding tuner, as latency + demands."""
        if len(op.group) == 1:
            return CollectivePlan("local", local_ns, ())
        best = min(self.options(op, node_of, capacity), key=lambda o: o.tuner_us)
        return to_plan(best, capacity, op.kind)

    # ------------------------------------------------------------ pricing
    def _price(self, a: str, proto: str, kind: O.CollectiveKind, s: float, p: int, n: int, g: int,
               nodes: list[int], channels: int, nvl_bw: float, nic_bw: float,
               capacity: Callable[[Link], float]) -> Option:
        t = self.tuning
        idx = 0 if n == 1 else 1 if n == 2 else 2
        edges, depth = dtree_shape(n)
        wire = WIRE_FACTOR[proto]
        if kind is AR:
            nsteps = 2 * (p - 1)
        elif kind in (AG, RS):
            nsteps = p - 1
        else:  # broadcast: one pass down the ring
            nsteps = p - 1

        # bytes each link carries (one direction), and the algorithm's link-bound algbw
        nvl_bytes = nic_bytes = 0.0
        if a == "ring":
            share = 1.0 if kind is BCAST else nsteps / p  # of the buffer, per rank
            nvl_bytes = share * s if g > 1 else 0.0
            nic_bytes = share * s if n > 1 else 0.0
        elif a == "tree":
            nvl_bytes = 2 * s * (g - 1) / g if g > 1 else 0.0  # the chain: up and down, two trees
            nic_bytes = s / 2 * edges if n > 1 else 0.0
        else:  # nvls, nvls_tree: ld_reduce and multicast store through each GPU's port
            nvl_bytes = s * (g + 1) / g
            nic_bytes = s / 2 * edges if n > 1 else 0.0
        link_algbw = min(nvl_bw * s / nvl_bytes if nvl_bytes else inf,
                         nic_bw * s / nic_bytes if nic_bytes else inf)
        if a.startswith("nvls"):
            link_algbw = min(link_algbw, self.nvls_algbw)

        # NCCL's bandwidth model (tuning.cc): bus bandwidth, refined per protocol
        algbw = self._nccl_algbw(a, proto, kind, link_algbw, p, n, g, nsteps, idx, channels)
        if a == "tree":
            log_size = log2i(int(s) >> 6)
            if log_size < len(t.tree_correction[proto]):
                algbw *= t.tree_correction[proto][log_size]

        # latencies: NCCL's tuner's view, and the executed one
        tuner_lat, exec_lat = self._latencies(a, proto, kind, nsteps, p, n, g, depth)
        if a == "ring" and proto == "Simple" and n > 1 and kind is AR and s / (channels * p) >= 64:
            tuner_lat *= t.ring_plateau[self.arch]  # "Plateau effect of ring"
            exec_lat *= t.ring_plateau[self.arch]

        # fewer channels for small messages (enqueue.cc): the bandwidth scales with them
        nc = channels
        if not a.startswith("nvls"):
            thr = THREAD_THRESHOLD[proto] * (p if (a == "ring" and proto == "LL") else 1)
            while nc > 1 and s < nc * MAX_NTHREADS[proto] * thr:
                nc -= 1
        exec_bw = algbw * nc / channels
        # the network messages of the channels that run (nccl_messages): NCCL's tuner
        # does not know their cost, the execution pays it
        if self.message_us and n > 1 and proto == "Simple":
            exec_lat += message_extra_us(network_messages(a, kind, s, p, n, nc), self.message_us,
                                         self.channel_line, self.fabric_efficiency)

        demands = tuple([(Link(LinkKind.NVLINK, nd), nvl_bytes * wire) for nd in nodes if nvl_bytes]
                        + [(Link(LinkKind.NIC, nd), nic_bytes * wire) for nd in nodes if nic_bytes])
        tuner_us = tuner_lat + s / algbw * US_PER_S
        if self.plugin_tuner:  # the plugin's tuner models the real network: the executed time
            link_s = max((b / capacity(l) for l, b in demands), default=0.0)
            tuner_us = exec_lat + max(link_s, s / exec_bw) * US_PER_S
        return Option(a, proto, s, nc, tuner_us, exec_lat, exec_bw, demands)

    def _nccl_algbw(self, a: str, proto: str, kind: O.CollectiveKind, link_algbw: float, p: int, n: int, g: int,
                    nsteps: int, idx: int, channels: int) -> float:
        """NCCL's algorithm bandwidth (bytes/s) for ``a``/``proto``: the links' bus
        bandwidth with tuning.cc's refinements (its constants are GB/s)."""
        t = self.tuning
        gb = 1e9
        ll_max = t.ll_max_bw[self.arch][idx] * gb
        if a == "ring":
            ratio = 1.0 if kind is BCAST else p / nsteps
            bus = link_algbw / ratio
            if proto == "LL":
                bus = min(ll_max, bus * (0.25 if (n > 1 or kind is AR) else 1 / 3))
            elif proto == "LL128":
                bus = min(bus * (0.7 if g < 2 else 0.92),
                          channels * t.ring_ll128_max_bw_per_channel[self.arch][idx] * gb)
            return bus * ratio
        if a == "tree":
            bus = 2 * link_algbw  # NCCL converts the tree's bus bandwidth to algbw at 1/2
            bus = min(bus * 0.92, channels * t.tree_max_bw_per_channel[self.arch][idx] * gb)
            if proto == "LL":
                bus = min(bus / 3.8, ll_max)
            elif proto == "LL128":
                bus = min(bus * (7 / 9 if n == 1 else 120 / 128),
                          channels * t.tree_ll128_max_bw_per_channel[self.arch][idx] * gb)
            return bus * 0.5
        return link_algbw  # NVLS: the switch's ceiling, or the links'

    def _latencies(self, a: str, proto: str, kind: O.CollectiveKind, nsteps: int, p: int, n: int, g: int,
                   depth: int) -> tuple[float, float]:
        """(NCCL's tuner latency, executed latency), us."""
        t = self.tuning
        base = t.base_lat_us[a][proto]
        nvl = t.hw_lat_us["nvlink"][a][proto]
        net = t.hw_lat_us["net"][a][proto]
        # the tuner adds the plugin's reported latency to each network hop, twice for
        # Simple (the receive flush); the real crossing costs the fabric's own latency
        twice = 2 if proto == "Simple" else 1
        tuner_net = net + self.plugin_lat_us * twice
        real_net = net + self.fabric_lat_us * twice
        if a == "ring":
            net_overhead = t.net_overhead_us * (3 if proto == "Simple" else 1) if n > 1 else 0.0
            intra = max(nvl, net_overhead)
            if t.ring_split_latency:
                inter_steps = (2 * n if n > 1 else 0) if kind is AR else n - 1
                tuner = base + (nsteps - inter_steps) * intra + inter_steps * tuner_net
            else:  # before 2.12 a multi-node ring paid the network hop on every step
                tuner = base + nsteps * (net if n > 1 else nvl)
            # the critical path: the chunk that crosses the most node boundaries
            crossings = (2 * n if kind is AR else n if kind in (AG, RS) else n - 1) if n > 1 else 0
            return tuner, base + (nsteps - crossings) * intra + crossings * real_net
        if a == "tree":
            tuner = base + 2 * ((g - 1) * nvl + log2i(n) * tuner_net)
            return tuner, base + 2 * ((g - 1) * nvl + depth * real_net)
        # nvls / nvls_tree: the switch's hop, then the tree across nodes
        tuner = base + nvl + 2 * log2i(n) * tuner_net
        return tuner, base + nvl + 2 * depth * real_net


def to_plan(o: Option, capacity: Callable[[Link], float], kind: O.CollectiveKind) -> CollectivePlan:
    """An option as the simulator's contract: latency + wire bytes on links, the SMs its
    CTAs hold (one per channel) and its traffic through each member's HBM. What NCCL's
    bandwidth model says beyond the links' own time is the collective's own slowness
    (see the module docstring): extra latency, not extra bytes."""
    # whole nanoseconds, rounded up as the fluid network rounds a transfer's end, so that
    # latency + transfer is hops + the model's time, or hops + the links' when they are
    # slower: never longer on faster links
    link_ns = ceil(max((b / capacity(l) for l, b in o.demands), default=0.0) * 1e9 - 1e-6)
    model_ns = ceil(o.size_bytes / o.bw_bytes_per_s * 1e9 - 1e-6)
    latency_ns = round(o.latency_us * 1000) + max(0, model_ns - link_ns)
    wire = max((b for _, b in o.demands), default=0.0)  # one GPU's bytes on its busiest link
    return CollectivePlan(o.name, latency_ns, o.demands, o.channels, HBM_PER_WIRE_BYTE[kind] * wire)
