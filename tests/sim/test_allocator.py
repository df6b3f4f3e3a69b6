"""The caching-allocator model against the rules of reference/allocator.md (no SimPy)."""

import pytest

from commsim.sim.allocator import (KLARGE_BUFFER, KSMALL_BUFFER, CachingAllocator, OutOfMemory, round_size,
                                   segment_size)

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(512) == KSMALL_BUFFER == 2 * MiB
    assert segment_size(MiB) == 2 * MiB  # 1 MiB is still small
    assert segment_size(MiB + 512) == KLARGE_BUFFER == 20 * MiB
    assert segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(11 * MiB + 1) == 12 * MiB  # rounded up to 2 MiB


def test_small_and_large_pools_and_split_thresholds():
    a = CachingAllocator(1 << 40)
    r = a.malloc(1000, "s")
    assert r.new_segment_bytes == 2 * MiB and r.block.size == 1024
    r2 = a.malloc(3000, "s")  # from the remainder of the small segment: no new segment
    assert r2.new_segment_bytes == 0 and r2.block.offset == 1024 and r2.block.size == 3072
    big = a.malloc(2 * MiB, "s")  # large pool: 20 MiB segment, remainder 18 MiB > 1 MiB kept
    assert big.new_segment_bytes == 20 * MiB and big.block.size == 2 * MiB
    nosplit = a.malloc(int(17.5 * MiB), "s")  # remainder 0.5 MiB <= 1 MiB: not split
    assert nosplit.new_segment_bytes == 0 and nosplit.block.size == 18 * MiB
    assert a.stats.reserved_bytes == 22 * MiB
    assert a.stats.allocated_bytes == 1024 + 3072 + 2 * MiB + 18 * MiB


def test_best_fit_is_per_stream_and_smallest():
    a = CachingAllocator(1 << 40)
    x = a.malloc(4 * MiB, "s")  # [0, 4) of one 20 MiB segment
    a.malloc(2 * MiB, "s")  # [4, 6) stays allocated, so the two holes do not merge
    y = a.malloc(8 * MiB, "s")  # [6, 14)
    last = a.malloc(5 * MiB, "s")  # [14, 20): the 1 MiB rest is not worth a split
    assert last.block.size == 6 * MiB
    a.free(x.block)
    a.free(y.block)
    r = a.malloc(3 * MiB, "s")
    assert (r.new_segment_bytes, r.block.offset) == (0, 0)  # 4 MiB hole beats the 8 MiB one
    other = a.malloc(3 * MiB, "t")  # another stream never reuses s's blocks
    assert other.new_segment_bytes == 20 * MiB


def test_free_merges_neighbours_within_segment():
    a = CachingAllocator(1 << 40)
    blocks = [a.malloc(4 * MiB, "s").block for _ in range(5)]  # fills the 20 MiB segment
    for b in blocks[1:4]:
        a.free(b)
    assert a.inactive_split_bytes() == 12 * MiB
    r = a.malloc(12 * MiB, "s")  # the three merged holes make one block
    assert r.new_segment_bytes == 0 and r.block.offset == 4 * MiB


def test_no_room_needs_flush_then_retry_then_oom():
    a = CachingAllocator(40 * MiB)
    x = a.malloc(15 * MiB, "s")  # 16 MiB segment
    a.malloc(15 * MiB, "s")  # another 16 MiB segment: 32 reserved
    a.free(x.block)
    assert a.malloc(15 * MiB, "t") is None  # t cannot use s's free segment; 16 more do not fit
    r = a.malloc_after_flush(15 * MiB, "t")
    assert r.flushed and r.freed_segment_bytes == (16 * MiB,) and r.new_segment_bytes == 16 * MiB
    assert a.stats.num_alloc_retries == 1 and a.stats.num_device_free == 1
    assert a.malloc(30 * MiB, "t") is None
    with pytest.raises(OutOfMemory):
        a.malloc_after_flush(30 * MiB, "t")
    assert a.stats.num_ooms == 1 and a.stats.num_alloc_retries == 2


def _layout(a: CachingAllocator) -> list:
    out = []
    for sid, seg in sorted(a._segments.items()):
        b, blocks = seg.head, []
        while b is not None:
            assert b.segment is seg and (b.next is None or b.next.prev is b)
            blocks.append((b.offset, b.size, b.allocated))
            b = b.next
        out.append((sid, seg.size, seg.stream, seg.small, seg.allocated_blocks, blocks))
    return out


def test_clone_copies_long_block_chains_and_is_independent():
    """A warmed-up allocator is cloned for every simulated rank. Small pools hold chains of
    thousands of blocks: a recursive copy (copy.deepcopy) overflowed Python's stack on
    roberta-large per-rank; the clone walks them."""
    a = CachingAllocator(1 << 40)
    blocks = [a.malloc(512, "s").block for _ in range(5000)]  # two small segments, long chains
    for b in blocks[::3]:
        a.free(b)
    big = a.malloc(30 * MiB, "t").block
    c, mapping = a.clone()
    assert _layout(c) == _layout(a) and c.stats == a.stats
    assert [k for k, _ in c._pools[(True, "s")]] == [k for k, _ in a._pools[(True, "s")]]
    assert all(mapping[b].segment is c._segments[b.segment.id] for b in blocks)
    # independent: freeing in the copy leaves the original as it was
    before = _layout(a)
    c.free(mapping[big])
    c.free(mapping[blocks[1]])
    assert _layout(a) == before and _layout(c) != before
    assert c.malloc(512, "s").block.segment.id == blocks[0].segment.id  # best fit in the copy's pool
