"""bench/gc_alignment.py: its report from ranks' --gc-log files, and one real short job."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import gc_alignment as ga  # noqa: E402


def ev(gen: int, step: int, hooks: int, at_s: float, pause_s: float = 0.001) -> dict:
    return {"generation": gen, "step": step, "phase": "backward", "hooks": hooks, "at_s": at_s, "pause_s": pause_s,
            "collected": 0}


def test_report_counts_shared_positions_and_what_the_job_paid():
    steps = [1.0] * 10
    steps[6] = 1.2  # the step of the full pass: 200 ms more than the median
    # rank 0 and rank 1 collect at the same positions from step 3 on (step 1 differs:
    # start-up); one full pass, 0.2 s, at step 6 hook 60 on both, 4 ms apart; rank 1
    # also collects twice between hooks 70 and 71 where rank 0 collects once
    r0 = [ev(0, 1, 11, 0.0), ev(0, 4, 40, 1.0), ev(2, 6, 60, 5.000, 0.2), ev(0, 7, 70, 7.0)]
    r1 = [ev(0, 1, 12, 0.0), ev(0, 4, 40, 1.0), ev(2, 6, 60, 5.004, 0.2), ev(0, 7, 70, 7.0), ev(0, 7, 70, 7.1)]
    rep = ga.alignment([{"events": r0, "step_times_s": steps}, {"events": r1, "step_times_s": steps}])
    assert (rep["positions_shared"], rep["positions_any"]) == (3, 4)
    assert (rep["full_passes_shared"], rep["full_passes_any"]) == (1, 1)
    assert rep["full_pass_start_spread_ms"] == [4.0]
    assert rep["steps_with_a_full_pass"] == [{"step": 6, "extra_ms": 200.0, "pause_ms": 200.0, "pauses_paid": 1.0}]
    assert rep["ranks"][0]["collections"] == {"0": 2, "1": 0, "2": 1}
    assert rep["ranks"][1]["full_passes"] == [{"step": 6, "phase": "backward", "hooks": 60, "pause_ms": 200.0}]
    assert rep["ranks"][0]["promoted_per_step"] is None  # no generation-1 pass counted its survivors


def test_promotions_and_time_per_object_from_counted_passes():
    steps = [1.0] * 10  # 7 settled steps (3-9)
    gen1 = [dict(ev(1, st, 10 * st, float(st)), examined=500, survivors=140) for st in (2, 4, 6, 8)]
    full = dict(ev(2, 9, 90, 9.0, 0.25), examined=500_000, survivors=499_000)
    rep = ga.alignment([{"events": gen1 + [full], "step_times_s": steps}] * 2)
    # three passes in the settled steps (step 2's is start-up): 3 x 140 / 7
    assert rep["ranks"][0]["promoted_per_step"] == 60.0
    assert rep["ranks"][0]["full_passes"][0] == {"step": 9, "phase": "backward", "hooks": 90, "pause_ms": 250.0,
                                                 "objects": 500_000, "us_per_object": 0.5}


def test_a_pass_on_one_rank_only_is_not_shared():
    steps = [1.0] * 8
    r0 = [ev(2, 5, 50, 5.0, 0.1)]
    r1 = [ev(0, 5, 50, 5.0)]
    rep = ga.alignment([{"events": r0, "step_times_s": steps}, {"events": r1, "step_times_s": steps}])
    assert (rep["full_passes_shared"], rep["full_passes_any"]) == (0, 1)
    assert rep["full_pass_start_spread_ms"] == []
    assert rep["steps_with_a_full_pass"][0]["pauses_paid"] == 0.0  # no step time more than the median


def test_real_ranks_collect_at_the_same_program_points(tmp_path):
    # two gloo ranks of real DeepSpeed ZeRO-3, collector thresholds lowered so that a few
    # steps collect often: identical programs collect at the same step and module hook
    logs = ga.run_job(ranks=2, steps=8, layers=4, stage=3, seq=16, threshold="100,3,3", folder=tmp_path)
    rep = ga.alignment(logs)
    assert all(sum(r["collections"].values()) >= 10 for r in rep["ranks"])
    # measured here: every one shared; a thread of the runtime's allocating could move a few
    assert rep["positions_shared"] >= 0.9 * rep["positions_any"]


def test_real_fsdp2_ranks_log_their_collections(tmp_path):
    # the same log from PyTorch FSDP2's script
    logs = ga.run_job(ranks=2, steps=8, layers=4, stage=3, seq=16, threshold="100,3,3", folder=tmp_path,
                      runner="fsdp2")
    rep = ga.alignment(logs)
    assert all(sum(r["collections"].values()) >= 10 for r in rep["ranks"])
    assert all(r["promoted_per_step"] is not None for r in rep["ranks"])
