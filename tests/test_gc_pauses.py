"""bench/gc_pauses.py's arithmetic: collections per step by generation, their pauses, the
full passes' period, and the step's wall-time tail."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import gc_pauses  # noqa: E402


def test_summary_counts_only_the_steps_asked_for():
    events = [(0, 2, 9_000_000),  # a warm-up step's full pass: left out
              (2, 0, 40_000), (2, 0, 60_000), (3, 1, 300_000), (4, 2, 200_000_000), (5, 0, 50_000)]
    walls = [10_000_000] * 2 + [5_000_000, 6_000_000, 206_000_000, 7_000_000]
    s = gc_pauses.summarise(events, walls, first=2, steps=4)
    assert s["generations"] == {
        "gen0": {"per_step": 0.75, "median_us": 50.0, "max_us": 60.0, "us_per_step": 37.5},
        "gen1": {"per_step": 0.25, "median_us": 300.0, "max_us": 300.0, "us_per_step": 75.0},
        "gen2": {"per_step": 0.25, "median_us": 200_000.0, "max_us": 200_000.0, "us_per_step": 50_000.0}}
    assert s["steps"] == 4
    assert s["step_ms"] == {"median": 6.5, "p90": 7.0, "p99": 7.0, "max": 206.0}


def test_full_pass_period():
    events = [(1, 2, 1), (25, 2, 1), (55, 2, 1), (85, 2, 1), (90, 1, 1)]
    assert gc_pauses.full_pass_period(events, first=20) == pytest.approx(30.0)
    assert gc_pauses.full_pass_period(events, first=60) is None  # one pass: no period


def test_timer_tags_each_collection_with_the_step():
    t = gc_pauses.GcTimer()
    t.step = 7
    young = [[] for _ in range(50)]  # containers the collector tracks, in the young generations
    t("start", {"generation": 1})
    t("stop", {"generation": 1, "collected": 3})
    assert len(t.events) == 1 and t.events[0][:2] == (7, 1) and t.events[0][2] >= 0
    # a generation-1 pass promotes what it examined less what it collected
    (step, promoted), = t.promoted
    assert step == 7 and len(young) - 3 <= promoted
    t("start", {"generation": 0})
    t("stop", {"generation": 0, "collected": 0})
    assert len(t.promoted) == 1  # young passes promote nothing to the oldest generation
