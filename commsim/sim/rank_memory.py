"""A simulated rank's memory: ``Alloc`` through the caching allocator (a cache hit, a
new segment whose cudaMalloc waits for the device, or a flush that synchronises every
stream, frees the free segments and retries) or host malloc priced by size on CPUs, and
``Free`` returning a block once every other stream that used it has passed the free
(record_stream). On a VM that reports free memory, a large block on pages its rank freed
about a reporting period ago or more costs extra (``returned_pages``). A mixin of
``rank.RankSim``, whose state it uses."""

from __future__ import annotations

import itertools

import simpy

from commsim.hardware.profile import GLIBC_MMAP_THRESHOLD_MAX_BYTES
from commsim.ir import ops as O
from commsim.sim.allocator import Block, CachingAllocator, OutOfMemory
from commsim.sim.host_heap import HostHeap, mapped_fresh_bytes
from commsim.sim.records import HostBlock
from commsim.sim.returned_pages import ReturnedPages


class RankMemory:
    """Allocation and free of one rank; the attributes it reads are RankSim's."""

    def _init_memory(self) -> None:
        self.alloc = CachingAllocator(self.cost.hbm_bytes)
        self.result.allocator = self.alloc
        # a framework's tensors on a CPU: their fresh pages' price; which bytes are fresh,
        # glibc's 32 MiB ceiling says, or with SimConfig.host_heap the modelled heap
        self.fresh_ns_per_byte = self.cost.fresh_page_ns_per_byte()
        self.heap: HostHeap | None = None
        self.heap_keys: dict[str, str] = {}  # live buffer -> its block's name in the heap
        self.heap_n = itertools.count()
        # a CPU rank in a VM that reports free memory: the large blocks it gave back, and
        # what a reported page's first write costs over a fast one (returned_pages)
        reported = self.cost.reported_pages()
        self.returned = ReturnedPages(reported[0]) if reported else None
        self.reported_extra_ns_per_byte = reported[1] if reported else 0.0
        self.mapped: dict[str, int] = {}  # live mmapped buffer (malloc platforms) -> its written bytes

    def adopt_memory(self, warm: "RankMemory") -> None:
        """Start from another rank's memory state (a warm-up already simulated)."""
        alloc, mapping = warm.alloc.clone()
        self.alloc = alloc
        self.blocks = {b: mapping[blk] for b, blk in warm.blocks.items()}
        self.block_stream = dict(warm.block_stream)
        self.result.allocator = alloc
        self.buffer_streams = {b: set() for b in self.blocks}
        self.heap = warm.heap.clone() if warm.heap is not None else None
        self.heap_keys = dict(warm.heap_keys)
        if warm.returned is not None:  # its returns' times on this simulation's clock
            self.returned = warm.returned.clone(self.env.now - warm.env.now)
        self.mapped = dict(warm.mapped)

    def _malloc(self, op: O.Alloc):
        env, cost, platform = self.env, self.cost, self.platform
        res = self.alloc.malloc(op.size_bytes, op.stream)
        t0 = env.now
        if res is None:
            # Flush: synchronise every stream, free all entirely free segments, retry.
            self.result.flush_times_ns.append(t0)
            pending = [e for e in self.last_issued.values() if not e.processed]
            if pending:
                yield from self._block(pending)  # deferred frees return as their events fire
            try:
                res = self.alloc.malloc_after_flush(op.size_bytes, op.stream)
            except OutOfMemory as e:
                self.sim.out_of_memory(f"rank {self.rank}: {e} at `{op.label}` ({op.buffer})")
                yield env.event()  # the simulation stops; this never resumes
                return
            delay = sum(cost.free_base_ns + int(cost.free_ns_per_byte * s) for s in res.freed_segment_bytes)
            delay += cost.malloc_base_ns + int(cost.malloc_ns_per_byte * res.new_segment_bytes)
            yield env.timeout(delay)
            self.result.host_blocks.append(HostBlock(t0, env.now, "allocator_flush"))
        elif res.new_segment_bytes and platform.caching_allocator:
            # cudaMalloc synchronises the device (allocator.md), then maps the segment.
            pending = [e for e in self.last_issued.values() if not e.processed]
            if pending and platform.malloc_syncs_device:
                yield simpy.AllOf(env, pending)
            yield env.timeout(cost.malloc_base_ns + int(cost.malloc_ns_per_byte * res.new_segment_bytes))
            self.result.host_blocks.append(HostBlock(t0, env.now, "allocator"))
        elif self.fresh_ns_per_byte is not None:
            # a framework's torch.empty: only the first write of fresh pages costs; glibc's
            # heap (or its fixed ceiling alone) says which they are; the rank's thread at
            # work (its stalls too)
            unmapped, kept = self._replace_kept(op)
            if self.heap is None:
                fresh = mapped_fresh_bytes(op.size_bytes, op.touch_bytes)
                self._note_mapped(op, fresh)
            else:
                key = self.heap_keys[op.buffer] = f"{op.buffer}#{next(self.heap_n)}"
                fresh = self.heap.malloc(key, op.size_bytes, op.touch_bytes)
                _, _, mmapped, written = self.heap.used[key]
                self._note_mapped(op, written if mmapped else 0)
            pages = self.result.fresh_page_bytes
            pages[op.phase.value] = pages.get(op.phase.value, 0) + fresh
            extra = self._reported_ns(op)
            self._return_kept(kept)
            ns = int(self.fresh_ns_per_byte * fresh) + extra + cost.host_unmap_ns(unmapped)
            yield from self._on_core(self._stalled(ns))
        elif not platform.caching_allocator:
            # host malloc, every time (the block bookkeeping still gives peaks): priced by
            # size where the profile measured it (heap reuse vs fresh mmapped pages)
            # the rank's thread at work, so its stalls arrive during it too (RankStalls)
            unmapped, kept = self._replace_kept(op)
            self._note_mapped(op, mapped_fresh_bytes(op.size_bytes, op.touch_bytes))
            extra = self._reported_ns(op)
            self._return_kept(kept)
            ns = cost.host_malloc_ns(op.size_bytes, op.touch_bytes) + extra + cost.host_unmap_ns(unmapped)
            yield from self._on_core(self._stalled(ns))
        else:
            yield env.timeout(self.sim.config.alloc_hit_ns)
        self.blocks[op.buffer] = res.block
        self.block_stream[op.buffer] = op.stream
        self.buffer_streams[op.buffer] = set()
        st = self.alloc.stats
        self.result.memory_samples.append((env.now, st.allocated_bytes, st.reserved_bytes))

    def _replace_kept(self, op: O.Alloc) -> tuple[int, int]:
        """A step buffer the previous step kept (allocated again, never freed): its old
        block goes with this allocation. Returns the written bytes that hands back to
        the OS, and those of its mmapped block (``_return_kept``)."""
        kept = self.mapped.pop(op.buffer, 0)
        unmapped = kept
        if self.heap is not None and op.buffer in self.heap_keys:
            unmapped = self.heap.free(self.heap_keys.pop(op.buffer))  # its mmapped bytes or a trim's
        return unmapped, kept

    def _return_kept(self, kept: int) -> None:
        """The kept buffer's old mmapped block is unmapped once its replacement holds its
        own pages (the new tensor is made before the old one is dropped): its pages go
        back to the OS after the new block took its own."""
        if kept and self.returned is not None:
            self.returned.returned(self.env.now, kept)

    def _note_mapped(self, op: O.Alloc, written: int) -> None:
        """``op``'s block is mmapped with ``written`` bytes written (0: a heap block):
        its free unmaps them."""
        if written:
            self.mapped[op.buffer] = written

    def _reported_ns(self, op: O.Alloc) -> int:
        """A large (mmapped) block's fresh pages on a VM that reports free memory: the
        share of them the guest has reported, by the age of the pages this rank gave
        back (``sim.returned_pages``), costs the extra; 0 elsewhere."""
        if self.returned is None or op.size_bytes < GLIBC_MMAP_THRESHOLD_MAX_BYTES:
            return 0
        written = op.size_bytes if op.touch_bytes is None else op.touch_bytes
        return self._take_returned(written, op.phase)

    def _take_returned(self, written: int, phase: O.Phase) -> int:
        """Fresh pages for ``written`` bytes of a large block now: the reported ones are
        counted in ``phase`` and their extra (ns) returned. Needs ``self.returned``."""
        nbytes = self.returned.take(self.env.now, written)
        if nbytes:
            pages = self.result.reported_page_bytes
            pages[phase.value] = pages.get(phase.value, 0) + nbytes
        return int(nbytes * self.reported_extra_ns_per_byte)

    def _release(self, block: Block, heap_key: str | None, mapped_bytes: int = 0) -> int:
        """Return ``block``; the written bytes its release hands back to the OS."""
        self.alloc.free(block)
        unmapped = mapped_bytes
        if heap_key is not None:
            unmapped = self.heap.free(heap_key)  # its mmapped bytes, or those a trim releases
        if mapped_bytes and self.returned is not None:  # glibc unmaps it: its pages go back to the OS now
            self.returned.returned(self.env.now, mapped_bytes)
        return unmapped

    def _free(self, op: O.Free) -> int:
        """Free a buffer. Returns the host time (ns) its unmap costs where that hands
        written pages back to the OS (munmap, a heap trim): the host thread tears them
        down (the caller charges it, so that a free without one creates no generator)."""
        block = self.blocks.pop(op.buffer)
        home = self.block_stream.pop(op.buffer)
        key = self.heap_keys.pop(op.buffer, None) if self.heap is not None else None
        mapped = self.mapped.pop(op.buffer, 0) if self.mapped else 0
        # record_stream: the block returns once every other stream that used it has
        # passed this point (an event recorded on each at free time).
        evs = [self.last_issued[s] for s in self.buffer_streams.pop(op.buffer, ()) if s != home
               and s in self.last_issued and not self.last_issued[s].processed]
        if evs:
            left = [len(evs)]

            def one_done(_ev: simpy.Event, block: Block = block, left: list[int] = left,
                         key: str | None = key, mapped: int = mapped) -> None:
                left[0] -= 1
                if left[0] == 0:
                    self._release(block, key, mapped)

            for e in evs:
                e.callbacks.append(one_done)
            # the block goes when another stream is done with it, but glibc's unmap of a
            # mmapped one is known now; the free's thread pays it (a trim's is not)
            unmapped = mapped
        else:
            unmapped = self._release(block, key, mapped)
        st = self.alloc.stats
        self.result.memory_samples.append((self.env.now, st.allocated_bytes, st.reserved_bytes))
        return self.cost.host_unmap_ns(unmapped) if unmapped else 0

