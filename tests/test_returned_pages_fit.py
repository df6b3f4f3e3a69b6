"""bench/returned_pages_fit.py: each large block's reused pages, their age and slow share,
from a program and its measured rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import returned_pages_fit as rf  # noqa: E402

MIB = 1 << 20
MS = 1_000_000
COLUMNS = ['rank', 'stream', 'op_id', 'kind', 'label', 'start_ns', 'end_ns', 'size_bytes', 'flops', 'step', 'phase',
           'dtype', 'group']
PROGRAM = [
    {"op": "alloc", "id": 1, "label": "a", "buffer": "a", "size_bytes": 64 * MIB, "touch_bytes": None},
    {"op": "compute", "id": 2},
    {"op": "free", "id": 3, "buffer": "a"},
    {"op": "collective", "id": 4},
    {"op": "host_work", "id": 5},
    {"op": "alloc", "id": 6, "label": "b", "buffer": "b", "size_bytes": 64 * MIB, "touch_bytes": 32 * MIB},
    {"op": "alloc", "id": 7, "label": "small", "buffer": "s", "size_bytes": 16 * MIB, "touch_bytes": None},
    {"op": "free", "id": 8, "buffer": "b"},
    {"op": "free", "id": 9, "buffer": "s"},
]


def _rows(step: int, t0: int, a_ns_per_byte: float, b_ns_per_byte: float) -> list[list]:
    a_end = t0 + int(64 * MIB * a_ns_per_byte)
    b_start = a_end + 10 * MS + 1000 * MS  # the compute, then a second on the host
    b_end = b_start + int(32 * MIB * b_ns_per_byte)
    return [[0, "host", 1, "alloc", "a", t0, a_end, 64 * MIB, 0, step, "fwd", "", ""],
            [0, "compute", 2, "gemm", "", a_end, a_end + 10 * MS, 0, 0, step, "fwd", "", ""],
            # the collective runs on an issuer thread: its end must not place the free
            [0, "comm", 4, "all_gather", "", a_end, a_end + 5000 * MS, 0, 0, step, "fwd", "", ""],
            [0, "host", 5, "host_python", "", a_end + 10 * MS, b_start, 0, 0, step, "fwd", "", ""],
            [0, "host", 6, "alloc", "b", b_start, b_end, 64 * MIB, 0, step, "fwd", "", ""],
            [0, "host", 7, "alloc", "small", b_end, b_end + MS, 16 * MIB, 0, step, "fwd", "", ""]]


def test_a_block_reuses_the_newest_returns_and_its_rate_gives_its_slow_share():
    rows = _rows(0, 0, 0.5, 1.5) + _rows(1, 3000 * MS, 2.5, 0.5)
    got = rf.reuses(PROGRAM, rows, COLUMNS, "row", fast=0.5, extra=2.0, from_step=0)
    assert [(r.step, r.label, r.mib) for r in got] == [(0, "a", 64), (0, "b", 32), (1, "a", 64), (1, "b", 32)]
    # step 0: a finds nothing returned (old pages); b reuses 32 of a's 64 MiB, freed when
    # the compute ended (not the collective) one second before, half of it slow
    assert got[0].age_s == rf.OLD_S and got[0].slow_share == 0.0
    assert abs(got[1].age_s - 1.0) < 1e-9 and got[1].slow_share == 0.5
    # step 1: a takes b's 32 MiB first (freed at b's end, after b's alloc: the small block
    # stays in the heap), then a's other 32 MiB; its rate is past the slow one: all slow
    b_end = 10 * MS + 1000 * MS + int(64 * MIB * 0.5) + int(32 * MIB * 1.5)
    a0_free = int(64 * MIB * 0.5) + 10 * MS
    expected = (32 * MIB * (3000 * MS - b_end - MS) + 32 * MIB * (3000 * MS - a0_free)) / (64 * MIB) / 1e9
    # (the small block's alloc ran between b's end and the frees: the free sits at its end)
    assert abs(got[2].age_s - expected) < 1e-6 and got[2].slow_share == 1.0
    assert rf.reuses(PROGRAM, rows, COLUMNS, "row", 0.5, 2.0, from_step=1)[0] == got[2]


def test_the_fit_finds_the_ramp_the_data_follow():
    data = [rf.Reuse("r", 0, 1, "x", 64, age, rf.ramp_share(age, 1.0, 2.0)) for age in (0.2, 0.9, 1.5, 2.0, 2.6, 4)]
    assert rf.fit_ramp(data, [0.5, 1.0, 1.5], [1.0, 2.0, 3.0]) == (1.0, 2.0, 0.0)
    assert rf.slow_share(0.2, 0.5, 2.0) == 0.0 and rf.slow_share(9.0, 0.5, 2.0) == 1.0


def test_a_folder_is_read_row_by_row_with_each_runs_profile(tmp_path, capsys, monkeypatch):
    (tmp_path / "rows.json").write_text(json.dumps({"rows": ["small z2"]}))
    (tmp_path / "sched0.json").write_text(json.dumps({"rank_program": [0], "programs": [{"setup": [],
                                                                                            "step": PROGRAM}]}))
    (tmp_path / "measured0.json").write_text(json.dumps({"columns": COLUMNS, "rows": _rows(0, 0, 0.5, 1.5)}))
    (tmp_path / "profile0.mean.json").write_text(json.dumps({"alloc": {"first_touch_ns_per_byte": 0.5,
                                                                       "reported_page_extra_ns_per_byte": 2.0}}))
    # a framework row (step and phase times only) is passed over
    (tmp_path / "sched1.json").write_text((tmp_path / "sched0.json").read_text())
    (tmp_path / "measured1.json").write_text(json.dumps({"step_times_s": [1.0], "phase_times_s": {}}))
    (tmp_path / "profile1.mean.json").write_text((tmp_path / "profile0.mean.json").read_text())
    # a second run whose calibration met no reported pages: named, not counted
    (tmp_path / "measured0.2.json").write_text((tmp_path / "measured0.json").read_text())
    (tmp_path / "profile0.mean.2.json").write_text(json.dumps({"alloc": {"first_touch_ns_per_byte": 0.5}}))
    skipped = []
    got = rf.folder_reuses(tmp_path, from_step=0, skipped=skipped)
    assert [(r.row, r.label, r.slow_share) for r in got] == [("small z2", "a", 0.0), ("small z2", "b", 0.5)]
    assert skipped == [f"{tmp_path.name}: small z2, run 2: profile0.mean.2.json has no reported page's extra"]
    monkeypatch.setattr(sys, "argv", ["returned_pages_fit.py", str(tmp_path), "--from-step", "0"])
    rf.main()
    captured = capsys.readouterr()
    out = captured.out
    assert captured.err == f"skipped {skipped[0]}\n"
    assert out.startswith("2 large allocations (1 row-ranks)\n")
    assert out.splitlines()[2:4] == ["    1-1.25            1       32       50.0%    0.0%",
                                     "     never            1       64        0.0%  100.0%"]
    assert out.splitlines()[4].endswith("the model's rule at a 2.05 s period (0.2); none reported (0.2)")
