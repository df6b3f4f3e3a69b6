"""bench/host_heap_check.py's reading of a profiler trace and its replay (no DeepSpeed run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import host_heap_check as hc  # noqa: E402

MiB = 1 << 20


def trace_file(tmp_path: Path) -> Path:
    """A step: forward makes and frees a 16 MiB block; backward makes 8 MiB blocks, one
    freed 50 us later (too soon to have been written); the step maps a 40 MiB block."""
    ev = [{"ph": "X", "name": f"ds_train.{p}", "ts": t, "dur": 900} for p, t in
          (("forward", 0), ("backward", 1000), ("step", 2000))]

    def mem(ts, addr, nbytes):
        return {"ph": "i", "name": "[memory]", "ts": ts, "args": {"Bytes": nbytes, "Addr": addr, "Device Type": 0}}

    ev += [mem(10, 1, 16 * MiB), mem(500, 1, -16 * MiB),
           mem(1010, 2, 8 * MiB), mem(1060, 2, -8 * MiB), mem(1100, 3, 8 * MiB), mem(1800, 3, -8 * MiB),
           mem(2010, 4, 40 * MiB), mem(2800, 4, -40 * MiB),
           mem(2950, 5, 1 * MiB)]  # outside every phase: left out
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    return path


def test_the_steps_events_by_phase_and_the_unwritten_block(tmp_path):
    events = hc.step_events(trace_file(tmp_path))
    assert [(p, a, b // MiB, w) for p, a, b, w in events] == [
        ("forward", 1, 16, True), ("forward", 1, -16, True),
        ("backward", 2, 8, False), ("backward", 2, -8, True), ("backward", 3, 8, True), ("backward", 3, -8, True),
        ("step", 4, 40, True), ("step", 4, -40, True)]


def test_the_replay_settles_where_glibc_would(tmp_path):
    fresh = hc.replay(hc.step_events(trace_file(tmp_path)), 4)
    # 16 MiB: mapped once, then from the heap, whose pages the later steps reuse; the
    # 8 MiB blocks fit in its freed chunk; 40 MiB is over the 32 MiB ceiling: mapped,
    # fresh every step
    assert fresh == {"forward": 0.0, "backward": 0.0, "step": 40.0}
    assert hc.replay(hc.step_events(trace_file(tmp_path)), 1)["forward"] == 16.0
