"""glibc's heap as the simulator tracks it: which allocations get fresh pages."""

from __future__ import annotations

from commsim.ir import ops as O
from commsim.ir.schedule import Program
from commsim.sim.host_heap import (MMAP_THRESHOLD_MAX, MMAP_THRESHOLD_START, PAGE_BYTES, TOP_PAD_BYTES,
                                   HostHeap, rehearsed_heap)

MiB = 1 << 20


def test_a_size_freed_once_comes_from_the_heap_after():
    """The first 16 MiB block is mmapped (fresh, every page faults); its free raises the
    mmap threshold to its size, so the next one grows the heap (fresh again) and the
    third reuses the heap's pages (nothing faults)."""
    h = HostHeap()
    assert h.malloc("a", 16 * MiB) == 16 * MiB and h.used["a"][2]
    h.free("a")
    assert h.mmap_threshold == 16 * MiB + PAGE_BYTES and h.trim_threshold == 2 * h.mmap_threshold
    assert h.malloc("b", 16 * MiB) == 16 * MiB and not h.used["b"][2]
    assert h.brk >= 16 * MiB + TOP_PAD_BYTES
    h.free("b")
    assert h.trims == 0  # a top of 16 MiB is under the 32 MiB trim threshold
    assert h.malloc("c", 16 * MiB) == 0
    assert h.faulted_bytes == 32 * MiB


def test_a_top_left_at_the_trim_threshold_is_handed_back_and_faults_again():
    h = HostHeap()
    h.malloc("seed", 16 * MiB)
    h.free("seed")  # threshold 16 MiB + a page, trim threshold twice that
    kept = 0  # touched pages the last trim left at the heap's end
    for step in range(2):
        # y's chunk starts 16 bytes (x's header) past a page: it faults one page more
        assert h.malloc("x", 16 * MiB) + h.malloc("y", 16 * MiB) == 32 * MiB + PAGE_BYTES - kept
        h.free("x")
        assert h.trims == step  # x's chunk sits below y: a free chunk, not the top
        h.free("y")  # merges with x's into the top: 32 MiB + pad >= the trim threshold
        assert h.trims == step + 1 and h.top == 0 and TOP_PAD_BYTES <= h.brk <= TOP_PAD_BYTES + PAGE_BYTES
        kept = h.brk


def test_only_written_pages_fault_and_a_freed_chunk_is_reused_split():
    h = HostHeap()
    h.malloc("seed", 8 * MiB)
    h.free("seed")
    assert h.malloc("big", 8 * MiB, touch_bytes=MiB) == MiB  # heap pages: the written MiB only
    h.malloc("pin", 4096)  # above it: its chunk can no longer join the top
    h.free("big")
    assert h.malloc("small", MiB // 2) == 0  # best fit: big's chunk, inside its written MiB
    # the rest of that chunk, split again: fresh from 1 MiB to its end's page
    assert h.malloc("rest", 7 * MiB) == 7 * MiB + MiB // 2 + PAGE_BYTES - MiB
    assert h.used["small"][0] == 0 and h.used["rest"][0] == h.used["small"][1] == MiB // 2 + 16


def test_blocks_over_32_mib_are_always_mapped_and_keep_the_threshold():
    h = HostHeap()
    for _ in range(3):
        assert h.malloc("big", 64 * MiB) == 64 * MiB and h.used["big"][2]
        h.free("big")
    assert h.mmap_threshold == MMAP_THRESHOLD_START and h.brk == 0
    assert h.malloc("partly", 64 * MiB, touch_bytes=MiB + 1) == MiB + PAGE_BYTES  # whole pages
    assert MMAP_THRESHOLD_MAX == 32 * MiB


def test_a_large_request_takes_a_big_enough_top_instead_of_a_mapping():
    """glibc serves even a request over 32 MiB from the top chunk when it is big enough:
    only a request the heap cannot serve is mmapped."""
    h = HostHeap()
    h.malloc("seed", 30 * MiB)
    h.free("seed")
    h.malloc("a", 30 * MiB), h.malloc("b", 30 * MiB), h.malloc("pin", 4096)
    h.free("a"), h.free("b")  # 60 MiB free below pin, kept (not the top)
    assert h.malloc("c", 40 * MiB) == 0 and not h.used["c"][2]


def test_clone_is_independent():
    h = HostHeap()
    h.malloc("a", 1 * MiB)
    c = h.clone()
    c.free("a")
    c.malloc("b", 2 * MiB)
    assert set(h.used) == {"a"} and set(c.used) == {"b"} and h.faulted_bytes == MiB


def test_the_rehearsed_heap_is_a_warm_steps_state():
    """Program order, three steps: a step that takes and frees 16 MiB reaches the state
    where its block reuses the heap's pages; a persistent block stays."""
    setup = (O.Alloc(O.OpId(0), "compute", "params", "params", 8 * MiB),)
    step = (O.Alloc(O.OpId(1), "compute", "tmp", "tmp", 16 * MiB), O.Free(O.OpId(2), "compute", "free tmp", "tmp"))
    h = rehearsed_heap(Program(setup, step))
    assert set(h.used) == {"params"}
    assert h.malloc("tmp", 16 * MiB) == 0
