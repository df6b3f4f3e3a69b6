"""bench/collective_timeline.py: timed collectives, paired across ranks (no processes launched)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import collective_timeline as ct  # noqa: E402


class FakeTensor:
    def __init__(self, n: int) -> None:
        self.n = n

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 4


class FakeWork:
    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        return True

    def is_completed(self) -> bool:
        return self.waited


def fake_dist() -> types.SimpleNamespace:
    calls = []

    def op(name):
        def f(*a, **k):
            calls.append(name)
            return FakeWork() if k.get("async_op") else None
        return f

    return types.SimpleNamespace(calls=calls, **{n: op(n) for n in ct.WRAPPED})


def test_a_blocking_call_ends_when_it_returns_and_an_async_one_when_its_wait_does():
    dist, recs = fake_dist(), []
    ct.wrap(dist, recs)
    assert dist.reduce_scatter_tensor(FakeTensor(10), FakeTensor(20)) is None
    work = dist.all_gather_into_tensor(FakeTensor(40), FakeTensor(20), async_op=True)
    assert recs[1]["end_ns"] is None and not work.is_completed()  # the handle's other methods pass through
    assert work.wait() is True and work.is_completed()
    assert dist.calls == ["reduce_scatter_tensor", "all_gather_into_tensor"]
    assert [(r["op"], r["bytes"]) for r in recs] == [("reduce_scatter_tensor", 80), ("all_gather_into_tensor", 160)]
    assert recs[0]["end_ns"] == recs[0]["return_ns"] >= recs[0]["start_ns"]
    assert recs[1]["end_ns"] >= recs[1]["return_ns"]
    dist.all_reduce(tensor=FakeTensor(3))  # by keyword, as some frameworks call it
    assert recs[2]["bytes"] == 12


def rec(op, nbytes, start, end):
    return {"op": op, "bytes": nbytes, "start_ns": start * 1_000_000, "return_ns": start * 1_000_000,
            "end_ns": None if end is None else end * 1_000_000}


def test_ranks_are_paired_call_by_call_over_the_last_share():
    r0 = [rec("all_reduce", 8, 0, 100),  # early: outside the last half
          rec("reduce_scatter_tensor", 64, 10, 14), rec("reduce_scatter_tensor", 64, 20, 23),
          rec("all_gather_into_tensor", 32, 30, None)]  # never waited: left out
    r1 = [rec("all_reduce", 8, 0, 100),
          rec("reduce_scatter_tensor", 64, 12, 15), rec("reduce_scatter_tensor", 64, 20, 24),
          rec("all_gather_into_tensor", 32, 31, 33)]
    assert ct.pair_stats([r0, r1], last=0.75) == {
        ("reduce_scatter_tensor", 64): {"held": 3.5, "skew": 1.0, "together": 3.5, "calls": 2.0}}


def test_records_of_different_runs_do_not_pair():
    with pytest.raises(ValueError, match="different collectives"):
        ct.pair_stats([[rec("all_reduce", 8, 0, 1)], [rec("broadcast", 8, 0, 1)]], last=1.0)
    with pytest.raises(ValueError, match="a share in"):
        ct.pair_stats([[]], last=0)


def test_report_reads_a_runs_folder_and_refuses_an_empty_one(tmp_path, capsys):
    for r, start in ((0, 10), (1, 12)):
        (tmp_path / f"rank{r}.json").write_text(json.dumps([rec("reduce_scatter_tensor", 1 << 20, start, 15)]))
    assert ct.main(["--report", str(tmp_path), "--last", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["reduce_scatter_tensor", "1.000", "1", "5.00", "2.00", "3.00"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ct.main(["--report", str(empty)]) == 2
    assert capsys.readouterr().err.strip() == (f"collective_timeline: --report {empty}: {empty}: needs rank0.json, "
                                               "rank1.json, ... from a run under torchrun; found 0")
