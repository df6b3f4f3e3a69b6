"""glibc's malloc behind a CPU rank's tensors: which allocations get fresh pages.

Without a caching allocator (PyTorch on CPUs) every tensor is a ``posix_memalign`` of
glibc's malloc, and what an allocation costs is mostly the page faults of its first
write: fresh pages fault, pages the process already touched do not. Which pages are
fresh depends on the heap's history, so this models the main arena's state (ptmalloc2,
glibc 2.26-2.38 ``malloc/malloc.c``) at the grain that decides it:

* a request the bins and the top chunk cannot serve goes to ``sysmalloc``: at or above
  the dynamic mmap threshold it is mmapped (fresh pages every time, unmapped at free);
  below it the top chunk grows by ``sbrk`` (the shortfall plus ``M_TOP_PAD``, whole
  pages) onto fresh pages;
* freeing an mmapped chunk of more than the threshold and at most 32 MiB raises the
  threshold to that chunk's size and the trim threshold to twice it (``__libc_free``:
  the "dynamic brk/mmap threshold"), so a size freed once comes from the heap after;
* a heap request takes the smallest free chunk that fits (the sorted large bins; the
  lowest address among equals), else the top chunk; the rest of a chunk stays free;
* a freed chunk merges with free neighbours, and into the top when it borders it; a
  free of 64 KiB or more (``FASTBIN_CONSOLIDATION_THRESHOLD``) that leaves the top at
  or above the trim threshold runs ``systrim``, which hands all but ``M_TOP_PAD`` of
  the top back to the OS: those pages are fresh again when the heap next grows.

So a step whose large temporaries all die together empties the heap's top, glibc trims
it, and the next step faults the same bytes again, although each is below the mmap
threshold; a step whose live blocks pin the top reuses its pages. Small requests use the
same chunks (tcache and fastbins keep small freed chunks out of merges: modelled, they
changed no replayed step's faults, so they are not). Pure bookkeeping: the rank prices
the fresh bytes ``malloc`` returns.

What the heap sees is the schedule's allocations. A real process also mallocs Python
objects and C++ bookkeeping, which sit among the tensors and pin the top; replaying a
real DeepSpeed step's own tensor allocations (bench/host_heap_check.py) reproduces its
ZeRO-2 faults to the page, but trims ZeRO-3's forward more often than the run does.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from commsim.hardware.profile import GLIBC_MMAP_THRESHOLD_MAX_BYTES as MMAP_THRESHOLD_MAX
from commsim.ir import ops as O
from commsim.ir.schedule import Program

PAGE_BYTES = 4096
MIN_CHUNK_BYTES = 32  # MINSIZE on 64-bit
# malloc.c: DEFAULT_MMAP_THRESHOLD_MIN (128 KiB), DEFAULT_TRIM_THRESHOLD (128 KiB); the
# threshold's ceiling, DEFAULT_MMAP_THRESHOLD_MAX, is MMAP_THRESHOLD_MAX
MMAP_THRESHOLD_START = 128 << 10
TRIM_THRESHOLD_START = 128 << 10
TOP_PAD_BYTES = 128 << 10  # M_TOP_PAD's default, mallopt(3)
CONSOLIDATION_BYTES = 64 << 10  # FASTBIN_CONSOLIDATION_THRESHOLD
# c10's alloc_cpu asks posix_memalign for 64-byte alignment; _int_memalign then asks
# _int_malloc for the request plus the alignment plus MINSIZE (and returns the slack)
TORCH_ALIGN_BYTES = 64


def _chunk(n: int) -> int:
    """request2size: the request plus the size field, in 16-byte units, at least MINSIZE."""
    return max(MIN_CHUNK_BYTES, (n + 8 + 15) & ~15)


def _pages(n: int) -> int:
    return -(-n // PAGE_BYTES) * PAGE_BYTES


@dataclass
class HostHeap:
    """One process's main arena. ``malloc`` / ``free`` by name; ``malloc`` returns the
    bytes of fresh pages the block's first write faults."""

    mmap_threshold: int = MMAP_THRESHOLD_START
    trim_threshold: int = TRIM_THRESHOLD_START
    brk: int = 0  # the heap is [0, brk); the top chunk is [top, brk)
    top: int = 0
    # free chunks below the top: address -> size, and (size, address) sorted for best fit
    free_at: dict[int, int] = field(default_factory=dict)
    by_size: list[tuple[int, int]] = field(default_factory=list)
    free_ending: dict[int, int] = field(default_factory=dict)  # end -> address of that free chunk
    # name -> (addr, size, mmapped, the written bytes an mmapped block unmaps at free)
    used: dict[str, tuple[int, int, bool, int]] = field(default_factory=dict)
    fresh: list[tuple[int, int]] = field(default_factory=list)  # heap pages never written, sorted
    faulted_bytes: int = 0  # every fresh byte written so far
    trims: int = 0

    def clone(self) -> "HostHeap":
        return HostHeap(self.mmap_threshold, self.trim_threshold, self.brk, self.top, dict(self.free_at),
                        list(self.by_size), dict(self.free_ending), dict(self.used), list(self.fresh),
                        self.faulted_bytes, self.trims)

    # ------------------------------------------------------------ malloc
    def malloc(self, name: str, size_bytes: int, touch_bytes: int | None = None) -> int:
        """Allocate ``name``; its first ``touch_bytes`` (None: all) get written. Returns
        the bytes of fresh pages that write faults."""
        assert name not in self.used, f"{name} allocated twice"
        nb = _chunk(size_bytes)
        written = size_bytes if touch_bytes is None else min(touch_bytes, size_bytes)
        got = self._from_bins(nb)
        if got is None and self.brk - self.top < nb + MIN_CHUNK_BYTES:
            req = nb + TORCH_ALIGN_BYTES + MIN_CHUNK_BYTES
            if req >= self.mmap_threshold:
                mapped = _pages(req + 8)
                faulted = _pages(written) if written else 0
                self.used[name] = (-1, mapped, True, faulted)
                self.faulted_bytes += faulted
                return faulted
            self._grow(nb)
        if got is None:
            got = (self.top, nb)
            self.top += nb
        addr, nb = got
        self.used[name] = (addr, nb, False, 0)
        faulted = self._write(addr, written)
        self.faulted_bytes += faulted
        return faulted

    def _from_bins(self, nb: int) -> tuple[int, int] | None:
        """The smallest free chunk of at least ``nb`` (split): its address and size."""
        i = bisect.bisect_left(self.by_size, (nb, -1))
        if i == len(self.by_size):
            return None
        size, addr = self.by_size[i]
        self._remove_free(addr)
        if size - nb < MIN_CHUNK_BYTES:
            return addr, size  # too little left to split off: the whole chunk
        self._add_free(addr + nb, size - nb)
        return addr, nb

    def _grow(self, nb: int) -> None:
        new_brk = self.brk + _pages(nb + TOP_PAD_BYTES + MIN_CHUNK_BYTES - (self.brk - self.top))
        self.fresh.append((self.brk, new_brk))
        self.brk = new_brk

    def _write(self, addr: int, nbytes: int) -> int:
        """Fault the fresh pages [addr, addr + nbytes) spans; return their bytes."""
        if nbytes <= 0 or not self.fresh:
            return 0
        lo, hi = addr // PAGE_BYTES * PAGE_BYTES, _pages(addr + nbytes)
        faulted, kept = 0, []
        for a, b in self.fresh:
            if b <= lo or a >= hi:
                kept.append((a, b))
                continue
            faulted += min(b, hi) - max(a, lo)
            if a < lo:
                kept.append((a, lo))
            if b > hi:
                kept.append((hi, b))
        self.fresh = kept
        return faulted

    # ------------------------------------------------------------ free
    def free(self, name: str) -> int:
        """Free ``name``; returns the bytes of written pages it hands back to the OS (an
        mmapped block's, or those of the heap's top that a trim releases)."""
        addr, size, mmapped, unmapped = self.used.pop(name)
        if mmapped:
            if self.mmap_threshold < size <= MMAP_THRESHOLD_MAX:
                self.mmap_threshold = size
                self.trim_threshold = 2 * size
            return unmapped
        start, end = addr, addr + size
        # merge with the free chunk ending here and the one starting at the end
        if start in self.free_ending:
            start = self.free_ending[start]
            self._remove_free(start)
        if end in self.free_at:
            after = self.free_at[end]
            self._remove_free(end)
            end += after
        if end == self.top:
            self.top = start
            if size >= CONSOLIDATION_BYTES and self.brk - self.top >= self.trim_threshold:
                return self._trim()
        else:
            self._add_free(start, end - start)
        return 0

    def _add_free(self, addr: int, size: int) -> None:
        self.free_at[addr] = size
        self.free_ending[addr + size] = addr
        bisect.insort(self.by_size, (size, addr))

    def _remove_free(self, addr: int) -> None:
        size = self.free_at.pop(addr)
        del self.free_ending[addr + size]
        self.by_size.pop(bisect.bisect_left(self.by_size, (size, addr)))

    def _trim(self) -> int:
        """systrim: release all of the top but M_TOP_PAD (and MINSIZE), in whole pages.
        Returns the bytes of written pages released (fresh ones were never mapped in)."""
        area = self.brk - self.top - MIN_CHUNK_BYTES - 1
        if area <= TOP_PAD_BYTES:
            return 0
        extra = (area - TOP_PAD_BYTES) // PAGE_BYTES * PAGE_BYTES
        if not extra:
            return 0
        old_brk = self.brk
        self.brk -= extra
        never_written = sum(min(b, old_brk) - max(a, self.brk) for a, b in self.fresh if b > self.brk)
        self.fresh = [(a, min(b, self.brk)) for a, b in self.fresh if a < self.brk]
        self.trims += 1
        return extra - never_written


def mapped_fresh_bytes(size_bytes: int, touch_bytes: int | None = None) -> int:
    """glibc's fixed ceiling alone (no heap history): a block under 32 MiB reuses pages
    the heap already touched, one of 32 MiB or more is mapped afresh and its written
    part faults. The simulator's default for a framework's tensors: the heap model sees
    only the schedule's allocations, and so trims more than a real process does."""
    if size_bytes < MMAP_THRESHOLD_MAX:
        return 0
    return size_bytes if touch_bytes is None else min(touch_bytes, size_bytes)


# A measured step comes after warm-up steps; glibc's heap settles in two or three (its
# first step maps what later ones take from the heap, its second grows the heap over it)
REHEARSED_STEPS = 3


def rehearsed_heap(program: Program, steps: int = REHEARSED_STEPS) -> HostHeap:
    """The heap after ``program``'s setup and ``steps`` of its step, each allocation and
    free in program order (a CPU rank runs its ops inline, in that order)."""
    heap = HostHeap()
    for op in program.setup:
        heap.malloc(op.buffer, op.size_bytes, op.touch_bytes)
    for _ in range(steps):
        for op in program.step:
            if isinstance(op, O.Alloc):
                if op.buffer in heap.used:  # a step buffer the previous step kept
                    heap.free(op.buffer)
                heap.malloc(op.buffer, op.size_bytes, op.touch_bytes)
            elif isinstance(op, O.Free) and op.buffer in heap.used:
                heap.free(op.buffer)
    return heap
