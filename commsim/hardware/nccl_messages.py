"""How NCCL cuts a collective into network messages, and what the messages cost where
each one has a cost of its own (p4d's EFA, Simple protocol).

NCCL moves a channel's share of a collective through its connections in steps of a
fixed buffer (``NCCL_BUFFSIZE``, 4 MiB for Simple, in ``NCCL_STEPS`` = 8 slots), and its
network proxy sends one message per slot it fills (src/transport/net.cc: the proxy posts
one isend per slice and advances by the slice's steps). How much a message carries
depends on the algorithm and on the size (src/enqueue.cc ``computeColl``, and the
kernels' loops, src/device/*.h; NCCL 2.1x as I recall its source, which this machine
cannot fetch: the thresholds below are the ones to check first when it can):

* **ring, Simple**: a chunk is at most 4 steps (``ALLREDUCE_CHUNKSTEPS`` = NCCL_STEPS/2,
  2 MiB); each rank's share of a channel is cut into as many chunks as it needs and
  sent in ``loops`` rounds; every ring step moves one chunk over every link, in two
  slices of half a chunk (``SLICESTEPS`` = NCCL_STEPS/4) but never below 1/32 of two steps
  (32 KiB; prims_simple.h ``sliceSize``); one message per slice;
* **tree, Simple**: one step per chunk (512 KiB), halved while the channel has too few
  chunks for the tree's depth (enqueue.cc: below depth x 8 chunks down to 128 KiB, below
  depth x 4 down to 64 KiB, below depth down to 32 KiB; depth = ranks per node - 1 +
  log2(nodes), connect.cc "a good approximation"); one message per chunk.

Only Simple's messages are counted: they alone carry a cost of their own (below).

**Cost.** Over InfiniBand a message costs its bytes. On p4d's EFA (aws-ofi-nccl's
SENDRECV transport, GPUDirect RDMA) each Simple message also costs a fixed time that the
next message on the same connection waits for: ``FabricSpec.message_ns``. Simple is the
protocol whose receives are flushed before the GPU may read them (NCCL's tuner counts
the network's latency twice for it); LL and LL128 carry their flags in the data and
need no flush, and their small messages show no such cost: p3dn's 8-byte ring LL
all-reduce over 8 nodes (published-runs.md N8, 631 us) sends 126 messages over each
network connection, 5 us each at most, all of it its 16 crossings' latency. The
fabric's efficiency (its share of line rate at large sizes) already holds that cost for
messages of the size the efficiency was measured at; smaller messages pay more of it
per byte. So what a collective pays beyond its link time is

    (messages - 1) x message_ns - channel bytes / channel line rate x (1 / efficiency - 1)

per channel, when positive: the first message's cost is in the fabric's latency (the
8-byte points its latency was read from are one message each). Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from commsim.hardware.nccl_tuning import NCCL_STEPS, SIMPLE_BUFFSIZE
from commsim.ir import ops as O

SIMPLE_STEP_BYTES = SIMPLE_BUFFSIZE // NCCL_STEPS  # 512 KiB
RING_CHUNK_STEPS = NCCL_STEPS // 2  # ALLREDUCE / ALLGATHER / REDUCESCATTER_CHUNKSTEPS
RING_SLICE_STEPS = NCCL_STEPS // 4  # ..._SLICESTEPS
# prims_simple.h: a slice is half a chunk, but at least a 32nd of a slice's full size
MIN_SLICE_BYTES = SIMPLE_STEP_BYTES * RING_SLICE_STEPS // 32  # 32 KiB


def log2i(n: int) -> int:
    """floor(log2(n)), 0 for n <= 1 (NCCL's log2i)."""
    return max(0, n.bit_length() - 1)


def tree_depth(ranks: int, nodes: int) -> int:
    """NCCL's tree depth (connect.cc connectTrees): ranks per node - 1 + log2(nodes)."""
    return ranks // nodes - 1 + log2i(nodes)


def tree_chunk_bytes(size_bytes: float, channels: int, depth: int) -> int:
    """The tree's Simple chunk for a ``size_bytes`` all-reduce (enqueue.cc computeColl)."""
    chunk = SIMPLE_STEP_BYTES
    for per_depth, floor in ((8, 131072), (4, 65536), (1, 32768)):
        while size_bytes // (channels * chunk) < depth * per_depth and chunk > floor:
            chunk //= 2
    return chunk


@dataclass(frozen=True, slots=True)
class Messages:
    """The messages one channel sends over its busiest network connection."""

    count: int
    data_bytes: float  # what they carry together


def network_messages(algorithm: str, kind: O.CollectiveKind, size_bytes: float, ranks: int, nodes: int,
                     channels: int) -> Messages:
    """Simple-protocol messages per channel over one network connection of a ring or
    tree collective (NVLS algorithms: ``Messages(0, 0)``, their network part is not
    modelled here)."""
    if nodes < 2 or size_bytes <= 0:
        return Messages(0, 0.0)
    if algorithm == "tree":
        # each channel reduces and broadcasts size / channels through every tree edge
        per_channel = size_bytes / channels
        chunk = tree_chunk_bytes(size_bytes, channels, tree_depth(ranks, nodes))
        return Messages(ceil(per_channel / chunk), per_channel)
    if algorithm != "ring":
        return Messages(0, 0.0)
    if kind is O.CollectiveKind.BROADCAST:  # a chain: the whole buffer once over each link
        per_rank, steps = size_bytes, 1
    else:
        per_rank = size_bytes / ranks
        steps = 2 * (ranks - 1) if kind is O.CollectiveKind.ALL_REDUCE else ranks - 1
    max_chunk = RING_CHUNK_STEPS * SIMPLE_STEP_BYTES
    loops = ceil(per_rank / (channels * max_chunk))
    chunk = per_rank / (channels * loops)
    slices = ceil(chunk / max(chunk / 2, MIN_SLICE_BYTES))
    return Messages(steps * loops * slices, steps * per_rank / channels)


def message_extra_us(msgs: Messages, message_us: float, channel_line_bytes_per_s: float,
                     efficiency: float) -> float:
    """What the messages cost beyond the fabric's latency and its efficiency (module
    docstring), in microseconds; 0 where the fabric has no per-message cost."""
    if message_us <= 0 or msgs.count < 2:
        return 0.0
    in_efficiency_us = msgs.data_bytes / channel_line_bytes_per_s * (1 / efficiency - 1) * 1e6
    return max(0.0, (msgs.count - 1) * message_us - in_efficiency_us)
