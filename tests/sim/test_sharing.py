"""A GPU's SMs and HBM shared by its kernels and collectives, both ways (hardware.sharing
priced, the GPU rank and the engine's HBM links applying it), on exact numbers."""

import pytest

from commsim.hardware.links import CollectivePlan, Link, LinkKind
from commsim.hardware.sharing import IDLE, GpuResources, KernelNeeds, Taken, fair_share, kernel_ns
from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from commsim.sim.engine import SimConfig, Simulator
from tests.sim.fixed_costs import FixedCosts

GPU = GpuResources(sm_count=10, hbm_bytes_per_s=1e9)  # 1 byte per ns


def test_a_gemm_of_one_wave_takes_two_beside_a_collective():
    # 10 tiles on 10 SMs: one wave; with 2 SMs held by NCCL's CTAs, two waves (X2)
    one_wave = KernelNeeds(fixed_ns=0, flop_ns=1000, mem_ns=0, hbm_bytes=0, tiles=10)
    assert kernel_ns(one_wave, GPU) == 1000
    assert kernel_ns(one_wave, GPU, Taken(1, sms=2)) == 2000
    # 20 tiles: two waves alone, three beside it
    assert kernel_ns(KernelNeeds(0, 1000, 0, 0, tiles=20), GPU, Taken(1, sms=2)) == 1500
    # not tiled: the SMs' share of its arithmetic
    assert kernel_ns(KernelNeeds(0, 1000, 0, 0), GPU, Taken(1, sms=2)) == 1250
    assert kernel_ns(one_wave, GPU, IDLE) == 1000


def test_hbm_is_shared_in_proportion_when_both_want_more_than_there_is():
    assert fair_share(100.0, 30.0, 50.0) == 30.0  # both fit
    assert fair_share(100.0, 80.0, 80.0) == 50.0  # proportional: half each
    assert fair_share(100.0, 90.0, 10.0) == 90.0  # fits exactly
    assert fair_share(100.0, 95.0, 10.0) == pytest.approx(90.476, abs=1e-3)  # max(90, 100*95/105)
    # a memory-bound kernel (1000 bytes in 1000 ns: it wants all of HBM) beside a
    # collective moving 1 byte/ns: half the bandwidth each, so twice as long
    copy = KernelNeeds(0, flop_ns=0, mem_ns=1000, hbm_bytes=1000)
    assert kernel_ns(copy, GPU, Taken(1, hbm_bytes_per_s=1e9)) == 2000
    # wanting 1 and 0.25 of it: max(what the other leaves, 0.75; its proportional share, 0.8)
    assert kernel_ns(copy, GPU, Taken(1, hbm_bytes_per_s=0.25e9)) == 1250
    # arithmetic-bound: HBM is not its limit
    gemm = KernelNeeds(0, flop_ns=1000, mem_ns=100, hbm_bytes=100)
    assert kernel_ns(gemm, GPU, Taken(1, hbm_bytes_per_s=0.5e9)) == 1000


DEVICE = GpuResources(sm_count=10, hbm_bytes_per_s=1e10)  # 10 bytes per ns


class SharedGpu(FixedCosts):
    """1 flop = 1 ns on all 10 SMs of a not-tiled kernel, 10 bytes/ns of HBM; a collective
    holds 5 SMs and moves 2x its bytes through HBM, 1 byte/ns on its link."""

    gpu_resources = DEVICE

    def compute_ns(self, op, taken=IDLE):
        nbytes = float(op.bytes_read + op.bytes_written)
        return kernel_ns(KernelNeeds(0, float(op.flops), nbytes / 10, nbytes), DEVICE, taken)

    def link_capacity(self, link):
        return DEVICE.hbm_bytes_per_s if link.kind is LinkKind.HBM else self.bw

    def collective(self, op):
        nodes = sorted({self.node_of(r) for r in op.group})
        return CollectivePlan("fixed", self.latency_ns, tuple((Link(LinkKind.NIC, n), float(op.size_bytes))
                                                              for n in nodes), sms=5, hbm_bytes=2.0 * op.size_bytes)


def _records(prog: Program, ranks: int = 1):
    res = Simulator(Schedule.uniform(ranks, prog), SharedGpu(), SimConfig(mode="symmetric", warmup_steps=0)).run()
    return {r.op.label: (r.start_ns, r.end_ns) for r in res.ranks[0].records}


def _gemm(i: int, flops: int, nbytes: int = 0) -> O.Compute:
    return O.Compute(O.OpId(i), "compute", f"c{i}", O.ComputeKind.ELEMENTWISE, flops, nbytes, 0)


def _ag(i: int, size: int) -> O.Collective:
    return O.Collective(O.OpId(i), "comm", f"ag{i}", O.CollectiveKind.ALL_GATHER, size, O.DType.UINT8, (0,))


def test_a_kernel_starting_with_a_collective_is_slowed_for_their_overlap():
    # both start at 0: the kernel runs on 5 of 10 SMs (half speed) until the all-gather
    # ends at 400, then at full speed: 200 of its 1000 ns of work done by 400, 800 left
    assert _records(Program((), (_ag(1, 400), _gemm(2, 1000)))) == {"ag1": (0, 400), "c2": (0, 1200)}


def test_a_collective_starting_mid_kernel_slows_only_the_rest():
    # c2 (on a stream of its own) runs alone for 300 ns (300 of 1000 done), then shares the
    # GPU with a collective that starts at 300 (waiting on c1) and lasts 400: 200 more done
    # by 700, 500 left at full speed. (Kernels on two streams do not share SMs here.)
    c1 = _gemm(1, 300)
    ag = O.Collective(O.OpId(3), "comm", "ag3", O.CollectiveKind.ALL_GATHER, 400, O.DType.UINT8, (0,),
                      deps=(c1.id,))
    c2 = O.Compute(O.OpId(2), "other", "c2", O.ComputeKind.ELEMENTWISE, 1000, 0, 0)
    got = _records(Program((), (c1, c2, ag)))
    assert got == {"c1": (0, 300), "c2": (0, 1200), "ag3": (300, 700)}


def test_a_memory_bound_kernel_slows_the_collective_beside_it():
    # the kernel wants all of HBM (10000 bytes in 1000 ns), the collective 2 x 100 bytes
    # in the 100 ns its link takes (2 bytes/ns): 12 wanted of 10, so each gets its
    # proportional share: the collective 10 x 2/12 bytes/ns, moving its 200 HBM bytes in
    # 120 ns (not 100); the kernel 10 x 10/12 meanwhile (1000 bytes), then the rest alone
    got = _records(Program((), (_ag(1, 100), _gemm(2, 0, nbytes=10000))))
    assert got == {"ag1": (0, 120), "c2": (0, 1020)}
