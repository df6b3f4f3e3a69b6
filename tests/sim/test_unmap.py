"""Written host pages handed back to the OS at a free (munmap of an mmapped block, a
trim of glibc's heap): what the heap model says each free releases, and the host time
the simulator charges for it, at the free."""

from __future__ import annotations

from commsim.hardware.platform import CPU
from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from commsim.sim.engine import SimConfig, Simulator
from commsim.sim.host_heap import PAGE_BYTES, TOP_PAD_BYTES, HostHeap
from tests.sim.fixed_costs import FixedCosts

MiB = 1 << 20
UNMAP = 0.25  # ns a byte, a test figure


def test_an_mmapped_blocks_free_releases_its_written_pages_only():
    h = HostHeap()
    assert h.malloc("a", 64 * MiB, touch_bytes=3 * MiB) == 3 * MiB
    assert h.free("a") == 3 * MiB
    h.malloc("b", 64 * MiB)
    assert h.free("b") == 64 * MiB


def test_a_trim_releases_the_written_part_of_the_top_and_a_plain_free_nothing():
    h = HostHeap()
    h.malloc("seed", 16 * MiB)
    assert h.free("seed") == 16 * MiB  # mmapped (threshold 128 KiB at first): all of it
    h.malloc("x", 16 * MiB)
    h.malloc("y", 16 * MiB, touch_bytes=MiB)
    assert h.free("x") == 0  # below y: a free chunk, nothing goes back
    released = h.free("y")  # joins x into the top, which is trimmed to the pad
    assert h.trims == 1
    # x's 16 MiB and y's written MiB (and y's header page) were written; of the pad
    # that stays, the part nobody wrote was never mapped in
    assert 17 * MiB - TOP_PAD_BYTES <= released <= 17 * MiB + PAGE_BYTES


def _step(ops: list, unmap: float, warmup: int = 0):
    costs = FixedCosts()
    costs.platform = CPU
    costs.unmap_ns_per_byte = unmap
    res = Simulator(Schedule.uniform(1, Program((), tuple(ops))),
                    costs, SimConfig(warmup_steps=warmup, jitter=0.0, keep_trace=True)).run()
    return res


def _alloc_free_work(size: int, touch: int | None = None) -> list:
    return [O.Alloc(O.OpId(1), "compute", "a", "a", size, touch_bytes=touch),
            O.Free(O.OpId(2), "compute", "free a", "a"),
            O.Compute(O.OpId(3), "compute", "after", O.ComputeKind.ELEMENTWISE, 1_000, 0, 0)]


def test_the_free_of_an_mmapped_block_costs_its_written_bytes_on_the_host():
    for size, touch, unmapped in ((64 * MiB, None, 64 * MiB), (256 * MiB, 32 * MiB, 32 * MiB),
                                  (16 * MiB, None, 0)):  # under glibc's 32 MiB ceiling: the heap keeps it
        plain = _step(_alloc_free_work(size, touch), 0.0)
        res = _step(_alloc_free_work(size, touch), UNMAP)
        assert res.step_time_ns - plain.step_time_ns == int(UNMAP * unmapped)
        # at the free: the allocation's record is as long as without it, the op after starts later
        (a0,), (a1,) = ([r for r in x.ranks[0].records if r.op.id == 1] for x in (plain, res))
        (c0,), (c1,) = ([r for r in x.ranks[0].records if r.op.id == 3] for x in (plain, res))
        assert (a1.end_ns - a1.start_ns, c1.start_ns - c0.start_ns) == (a0.end_ns - a0.start_ns, int(UNMAP * unmapped))


def test_a_kept_buffer_allocated_again_unmaps_its_old_block():
    """A buffer the step allocates and never frees: the next step's allocation replaces
    it, and the old block's pages go back then."""
    ops = [O.Alloc(O.OpId(1), "compute", "a", "a", 64 * MiB)]
    assert _step(ops, UNMAP, warmup=1).step_time_ns - _step(ops, 0.0, warmup=1).step_time_ns == int(UNMAP * 64 * MiB)
    assert _step(ops, UNMAP).step_time_ns == _step(ops, 0.0).step_time_ns  # the first step replaces nothing


def test_a_caching_allocator_unmaps_nothing():
    costs = FixedCosts()
    costs.unmap_ns_per_byte = UNMAP  # a GPU platform: cached blocks
    ops = _alloc_free_work(64 * MiB)
    res = Simulator(Schedule.uniform(1, Program((), tuple(ops))), costs, SimConfig(jitter=0.0)).run()
    costs.unmap_ns_per_byte = 0.0
    assert res.step_time_ns == Simulator(Schedule.uniform(1, Program((), tuple(ops))), costs,
                                         SimConfig(jitter=0.0)).run().step_time_ns


def test_a_kept_buffers_old_pages_go_back_after_its_replacement_took_its_own():
    """On a VM that reports free memory: the new block of a kept buffer is made before
    the old one is dropped, so it cannot take the old block's pages."""
    costs = FixedCosts()
    costs.platform = CPU
    costs.reported = (10_000_000, 1.0)
    ops = (O.Alloc(O.OpId(1), "compute", "a", "a", 64 * MiB, phase=O.Phase.BACKWARD),)
    res = Simulator(Schedule.uniform(1, Program((), ops)), costs, SimConfig(warmup_steps=1, jitter=0.0)).run()
    assert res.ranks[0].reported_page_bytes == {"bwd": 64 * MiB}
