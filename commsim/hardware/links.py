"""Links whose bandwidth concurrent transfers share, and a collective's plan over them.

A collective is described as a fixed latency plus byte *demands* on links (a node's
NICs, a GPU's NVLink port, or a measured profile's one channel), so the simulator can
share each link's bandwidth between the transfers crossing it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple


class LinkKind(enum.Enum):
    NIC = "nic"  # a node's network interfaces to the other nodes, pooled
    NVLINK = "nvlink"  # a GPU's NVLink / NVSwitch port inside the node
    CHANNEL = "channel"  # a measured profile's one communication channel per node (all kinds share it)
    HBM = "hbm"  # one GPU's memory bandwidth, which collectives share with its kernels (index: the rank)


class Link(NamedTuple):
    """A link whose bandwidth concurrent transfers share: its kind and its node (the
    rank, for a GPU's own HBM). (A named tuple: the simulator hashes links on every
    rate change.)"""

    kind: LinkKind
    node: int


@dataclass(frozen=True, slots=True)
class CollectivePlan:
    """How a collective runs: algorithm, fixed latency, and bytes each link must carry."""

    algorithm: str  # e.g. "ring/Simple"
    latency_ns: int
    demands: tuple[tuple[Link, float], ...]  # (link, bytes) pairs
    sms: int = 0  # SMs each member GPU gives the collective's CTAs while it runs (NCCL: one per channel)
    hbm_bytes: float = 0.0  # bytes it moves through each member GPU's HBM
    # host time the backend's call holds the calling thread before it returns (gloo's
    # reduce-scatter works on the caller's thread; NCCL's call only enqueues: 0)
    call_ns: int = 0
    # extra time, on average, when its members compute right after it rather than issue
    # another collective (CPU backends: the occasional wait of about a scheduler tick for
    # a completion, measured by calibrate as ``in_step_points``; 0 elsewhere)
    stall_ns: int = 0
