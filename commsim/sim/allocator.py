"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp).

Pure bookkeeping of segments and blocks, no time: the simulator charges the costs
(cudaMalloc, cudaFree, the device-wide synchronisation of a cache flush). The rules,
from reference/allocator.md:

* requests round up to 512 B; at most 1 MiB goes to the small pool (2 MiB segments),
  more to the large pool (a 20 MiB segment below 10 MiB, else rounded up to 2 MiB);
* best fit: the smallest free block of the pool *on the same stream* that fits;
* none fits: cudaMalloc a new segment if the device has room; otherwise free every
  entirely free cached segment (``num_alloc_retries`` += 1) and try once more, then
  out of memory (``num_ooms`` += 1);
* split the chosen block when the rest is worth keeping (small pool: >= 512 B; large
  pool: > 1 MiB);
* a freed block merges with free neighbours of its segment and is reusable only by
  its own stream (deferred frees after other-stream uses are the simulator's job: it
  calls ``free`` once those uses are done).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

KMIN_BLOCK = 512
KSMALL_SIZE = 1 << 20
KSMALL_BUFFER = 2 << 20
KMIN_LARGE_ALLOC = 10 << 20
KLARGE_BUFFER = 20 << 20
KROUND_LARGE = 2 << 20


class OutOfMemory(Exception):
    """The device cannot hold the request even after freeing the cache."""

    def __init__(self, size_bytes: int, reserved_bytes: int, capacity_bytes: int):
        super().__init__(f"out of memory: {size_bytes} bytes requested with {reserved_bytes} of "
                         f"{capacity_bytes} bytes reserved")
        self.size_bytes = size_bytes


def round_size(size: int) -> int:
    return max(KMIN_BLOCK, (size + KMIN_BLOCK - 1) // KMIN_BLOCK * KMIN_BLOCK)


def segment_size(rounded: int) -> int:
    if rounded <= KSMALL_SIZE:
        return KSMALL_BUFFER
    if rounded < KMIN_LARGE_ALLOC:
        return KLARGE_BUFFER
    return (rounded + KROUND_LARGE - 1) // KROUND_LARGE * KROUND_LARGE


@dataclass(eq=False)
class Block:
    segment: "Segment"
    offset: int
    size: int
    allocated: bool = False
    prev: "Block | None" = None
    next: "Block | None" = None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment.id, self.offset)


@dataclass(eq=False)
class Segment:
    id: int
    size: int
    stream: str
    small: bool
    head: Block | None = None
    allocated_blocks: int = 0


@dataclass
class AllocatorStats:
    allocated_bytes: int = 0
    peak_allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_device_alloc: int = 0
    device_alloc_bytes: int = 0  # bytes of every segment cudaMalloc'd
    num_device_free: int = 0


@dataclass
class MallocResult:
    block: Block
    new_segment_bytes: int = 0  # a cudaMalloc of this size was needed
    freed_segment_bytes: tuple[int, ...] = ()  # segments cudaFree'd by a cache flush
    flushed: bool = False


@dataclass
class CachingAllocator:
    capacity_bytes: int
    stats: AllocatorStats = field(default_factory=AllocatorStats)

    def __post_init__(self) -> None:
        self._pools: dict[tuple[bool, str], list[tuple[tuple[int, int, int], Block]]] = {}
        self._segments: dict[int, Segment] = {}
        self._next_segment = 0

    # ------------------------------------------------------------ pools
    def _pool(self, small: bool, stream: str) -> list:
        return self._pools.setdefault((small, stream), [])

    def _insert_free(self, b: Block) -> None:
        pool = self._pool(b.segment.small, b.segment.stream)
        bisect.insort(pool, (b.key, b), key=lambda t: t[0])

    def _remove_free(self, b: Block) -> None:
        pool = self._pool(b.segment.small, b.segment.stream)
        i = bisect.bisect_left(pool, b.key, key=lambda t: t[0])
        assert pool[i][1] is b, "free block missing from its pool"
        pool.pop(i)

    def _best_fit(self, small: bool, stream: str, size: int) -> Block | None:
        pool = self._pool(small, stream)
        i = bisect.bisect_left(pool, (size, -1, -1), key=lambda t: t[0])
        return pool[i][1] if i < len(pool) else None

    # ------------------------------------------------------------ public
    def malloc(self, size_bytes: int, stream: str) -> MallocResult | None:
        """Best fit, else a new segment if the device has room; None if only a cache
        flush could make room (the caller synchronises the device, then calls
        ``malloc_after_flush``)."""
        rounded = round_size(size_bytes)
        small = rounded <= KSMALL_SIZE
        block = self._best_fit(small, stream, rounded)
        if block is not None:
            self._remove_free(block)
            return MallocResult(self._take(block, rounded))
        seg = segment_size(rounded)
        if self.stats.reserved_bytes + seg > self.capacity_bytes:
            return None
        return MallocResult(self._take(self._new_segment(seg, stream, small), rounded), seg)

    def malloc_after_flush(self, size_bytes: int, stream: str) -> MallocResult:
        """Free every entirely free segment, then cudaMalloc once more; else OutOfMemory."""
        rounded = round_size(size_bytes)
        seg = segment_size(rounded)
        freed = self.release_cached()
        self.stats.num_alloc_retries += 1
        if self.stats.reserved_bytes + seg > self.capacity_bytes:
            self.stats.num_ooms += 1
            raise OutOfMemory(size_bytes, self.stats.reserved_bytes, self.capacity_bytes)
        block = self._take(self._new_segment(seg, stream, rounded <= KSMALL_SIZE), rounded)
        return MallocResult(block, seg, freed, True)

    def free(self, block: Block) -> None:
        assert block.allocated, "double free"
        block.allocated = False
        block.segment.allocated_blocks -= 1
        self.stats.allocated_bytes -= block.size
        for nb in (block.prev, block.next):
            if nb is not None and not nb.allocated:
                self._remove_free(nb)
                block = self._merge(block, nb)
        self._insert_free(block)

    def release_cached(self) -> tuple[int, ...]:
        """cudaFree every entirely free segment; returns their sizes."""
        freed = []
        for seg in list(self._segments.values()):
            if seg.allocated_blocks == 0:
                assert seg.head is not None and seg.head.next is None and seg.head.size == seg.size
                self._remove_free(seg.head)
                del self._segments[seg.id]
                self.stats.reserved_bytes -= seg.size
                self.stats.num_device_free += 1
                freed.append(seg.size)
        return tuple(freed)

    def clone(self) -> tuple["CachingAllocator", dict[Block, Block]]:
        """An independent copy of the allocator's state, and each block's copy (so a
        holder of blocks can follow them). Segments are walked block by block: the
        chains can be thousands of blocks long, too deep for a recursive copy."""
        new = CachingAllocator(self.capacity_bytes, replace(self.stats))
        new._next_segment = self._next_segment
        mapping: dict[Block, Block] = {}
        for sid, seg in self._segments.items():
            copy = Segment(seg.id, seg.size, seg.stream, seg.small, None, seg.allocated_blocks)
            prev = None
            b = seg.head
            while b is not None:
                nb = Block(copy, b.offset, b.size, b.allocated, prev)
                if prev is None:
                    copy.head = nb
                else:
                    prev.next = nb
                mapping[b] = nb
                prev = nb
                b = b.next
            new._segments[sid] = copy
        for key, pool in self._pools.items():
            new._pools[key] = [(k, mapping[b]) for k, b in pool]
        return new, mapping

    def inactive_split_bytes(self) -> int:
        """Free bytes inside segments that also hold live blocks (fragmentation)."""
        total = 0
        for seg in self._segments.values():
            if seg.allocated_blocks:
                b = seg.head
                while b is not None:
                    if not b.allocated:
                        total += b.size
                    b = b.next
        return total

    # ------------------------------------------------------------ internals
    def _new_segment(self, size: int, stream: str, small: bool) -> Block:
        seg = Segment(self._next_segment, size, stream, small)
        self._next_segment += 1
        seg.head = Block(seg, 0, size)
        self._segments[seg.id] = seg
        self.stats.reserved_bytes += size
        self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self.stats.reserved_bytes)
        self.stats.num_device_alloc += 1
        self.stats.device_alloc_bytes += size
        return seg.head

    def _take(self, block: Block, rounded: int) -> Block:
        rest = block.size - rounded
        keep = rest >= KMIN_BLOCK if block.segment.small else rest > KSMALL_SIZE
        if keep:
            tail = Block(block.segment, block.offset + rounded, rest, False, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = rounded
            self._insert_free(tail)
        block.allocated = True
        block.segment.allocated_blocks += 1
        self.stats.allocated_bytes += block.size
        self.stats.peak_allocated_bytes = max(self.stats.peak_allocated_bytes, self.stats.allocated_bytes)
        return block

    def _merge(self, a: Block, b: Block) -> Block:
        first, second = (a, b) if a.offset < b.offset else (b, a)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        if first.segment.head is second:
            first.segment.head = first
        return first
