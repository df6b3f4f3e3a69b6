"""One GPU's SMs and HBM, shared by its kernels and the collectives running beside them.

NCCL runs a collective as CTAs of its own, one per channel, each holding an SM for the
collective's whole length: a compute kernel beside it gets the other SMs (NCCL's CTAs
never share an SM with compute: published-runs.md X5). A GEMM of T output tiles then
runs in ceil(T / free SMs) waves instead of ceil(T / SMs), so a GEMM of exactly one
wave takes two (X2); a kernel with no tiles loses the SMs' share of its arithmetic.

Both also move bytes through the GPU's HBM: a collective about 2x its wire bytes (its
source read and its destination written; 3x where it reduces: the received data is read
again), the NCCL maintainer's "2-3x its wire bytes" (X1); a kernel its own bytes. When
their demands together exceed the HBM bandwidth, each gets at least its proportional
share of it: max(what the other leaves, bandwidth x own demand / both demands).

Pure functions of the cost model: the simulator's GPU rank tracks what its in-flight
collectives take (``Taken``) and asks the cost model for a kernel's time under it
whenever that changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil


@dataclass(frozen=True, slots=True)
class GpuResources:
    """What one GPU has to share."""

    sm_count: int
    hbm_bytes_per_s: float  # what memory-bound kernels reach (not the datasheet peak)


@dataclass(frozen=True, slots=True)
class KernelNeeds:
    """A kernel alone on the GPU: its fixed cost, its arithmetic time on all SMs and its
    memory time at full bandwidth (its time alone is fixed + the larger of the two), the
    bytes it moves through HBM, and its output tiles (0: not tiled, e.g. elementwise)."""

    fixed_ns: int
    flop_ns: float
    mem_ns: float
    hbm_bytes: float
    tiles: int = 0

    @property
    def alone_ns(self) -> int:
        return self.fixed_ns + int(max(self.flop_ns, self.mem_ns))


@dataclass(frozen=True, slots=True)
class Taken:
    """What a rank's in-flight collectives hold: how many there are, and of a GPU the SMs
    their CTAs occupy and the HBM bytes per second they move. (A model that prices
    interference by a measured factor only looks at ``collectives``.)"""

    collectives: int = 0
    sms: int = 0
    hbm_bytes_per_s: float = 0.0

    def __bool__(self) -> bool:
        return self.collectives > 0

    def plus(self, sms: int, hbm_bytes_per_s: float) -> "Taken":
        return Taken(self.collectives + 1, self.sms + sms, self.hbm_bytes_per_s + hbm_bytes_per_s)

    def minus(self, sms: int, hbm_bytes_per_s: float) -> "Taken":
        assert self.collectives > 0
        if self.collectives == 1:
            return IDLE  # exactly idle again, whatever float rounding left
        return Taken(self.collectives - 1, self.sms - sms, self.hbm_bytes_per_s - hbm_bytes_per_s)


IDLE = Taken()


def fair_share(capacity: float, mine: float, others: float) -> float:
    """Bandwidth a demand of ``mine`` gets beside ``others`` on ``capacity``: all it asks
    while both fit, else at least its proportional share (and whatever the others leave)."""
    if mine + others <= capacity:
        return mine
    return max(capacity - others, capacity * mine / (mine + others))


def kernel_ns(needs: KernelNeeds, gpu: GpuResources, taken: Taken = IDLE) -> int:
    """The kernel's time on ``gpu`` while collectives hold ``taken`` of it."""
    if not (taken.sms or taken.hbm_bytes_per_s):
        return needs.alone_ns
    # NCCL leaves a kernel at least one SM: a collective's CTAs are few
    free = max(1, gpu.sm_count - taken.sms)
    if needs.tiles:
        flop = needs.flop_ns * ceil(needs.tiles / free) / ceil(needs.tiles / gpu.sm_count)
    else:
        flop = needs.flop_ns * gpu.sm_count / free
    mem = needs.mem_ns
    if needs.hbm_bytes and taken.hbm_bytes_per_s:
        alone_s = needs.alone_ns / 1e9
        want = needs.hbm_bytes / alone_s  # its rate alone
        got = fair_share(gpu.hbm_bytes_per_s, want, taken.hbm_bytes_per_s)
        mem = max(mem, needs.hbm_bytes / got * 1e9)
    return needs.fixed_ns + int(max(flop, mem))


def kernel_hbm_rate(needs: KernelNeeds, duration_ns: int) -> float:
    """The HBM bytes per second a kernel moves while it runs for ``duration_ns``."""
    return needs.hbm_bytes / (duration_ns / 1e9) if duration_ns > 0 else 0.0
