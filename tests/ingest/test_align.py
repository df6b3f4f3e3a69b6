"""Lining a real job's trace up with a prediction (commsim.ingest.load): its collectives take
the predicted ones' op ids in each step that issues them alike, nothing else can match a
predicted op by accident; and the strict collective match of a recording without step
numbers (a Flight Recorder dump)."""

from dataclasses import replace

import pytest

from commsim.api import Scenario, predict
from commsim.ingest.load import align_to_prediction, as_prediction
from commsim.ir.trace import Trace, TraceMeta, TraceSource
from commsim.report.collectives import format_match, schedule_sequence, strict_match
from commsim.report.compare import compare

COLL = {"all_gather", "reduce_scatter", "all_reduce", "broadcast"}


@pytest.fixture(scope="module")
def prediction():
    ds = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 20000}}
    p = predict(Scenario(model="tiny", nodes=1, gpus_per_node=2, seq=16, ds_config=ds))
    return p.trace(), p.schedule


def recorded(pred: Trace, steps: int, drop_in_step: int | None = None) -> Trace:
    """The predicted step as a real job's: ``steps`` steps, ops numbered in time order
    from 0 (ids that collide with the schedule's), one collective dropped in one step."""
    out = []
    for s in range(1, steps + 1):
        recs = sorted(pred.records, key=lambda r: (r.start_ns, r.op_id))
        colls = [r for r in recs if r.kind in COLL]
        for r in recs:
            if s == drop_in_step and r is colls[3]:
                continue
            out.append(replace(r, step=s, op_id=len(out)))
    return Trace(TraceMeta(TraceSource.RECORDED, producer="test"), tuple(out))


def test_matching_steps_compare_their_collectives_one_by_one(prediction):
    pred, _ = prediction
    n = sum(r.kind in COLL for r in pred.records)
    al = align_to_prediction(pred, recorded(pred, 3, drop_in_step=2), 0)
    assert al.steps_matched == (1, 3) and al.steps_differing == (2,) and al.collectives == n
    top = max(r.op_id for r in pred.records)
    pred_ids = {r.op_id: r for r in pred.records}
    for r in al.trace.records:
        if r.step != 2 and r.kind in COLL:
            assert (pred_ids[r.op_id].kind, pred_ids[r.op_id].size_bytes) == (r.kind, r.size_bytes)
        else:
            assert r.op_id > top
    c = compare(pred, al.trace)
    assert len(c.op_errors) == n and all(abs(e) < 1e-9 for e, *_ in c.op_errors)  # the same durations
    assert "1 of 3" not in al.describe() and "2 of 3 recorded step(s)" in al.describe()
    assert "(steps 2 differ)" in al.describe()


def test_a_recorded_trace_stands_for_a_prediction_by_its_median_step(prediction):
    pred, _ = prediction
    rec = recorded(pred, 3)
    slow = Trace(rec.meta, tuple(replace(r, end_ns=r.end_ns + 10**9) if r.step == 3 and r.op_id == max(
        q.op_id for q in rec.records if q.step == 3) else r for r in rec.records))
    as_pred = as_prediction(slow, 0)
    assert {r.step for r in as_pred.records} == {0}
    assert [r.op_id for r in as_pred.records] == [r.op_id for r in slow.records if r.step == 1]


def test_without_step_numbers_the_repetitions_alone_decide(prediction):
    _, schedule = prediction
    step = schedule_sequence(schedule)
    from commsim.ir.trace import TraceRecord

    def rec(keys):
        return [TraceRecord(0, "collectives", i, k, "", 0, 0, b, 0, 0, "other", d, g)
                for i, (k, b, d, g) in enumerate(keys)]

    start = [("broadcast", 128, "bf16", "0,1")] * 3  # start-up collectives before the steps
    m = strict_match(step, rec(start + step * 2), steps_known=False)
    assert m.ok and m.repeats == 2 and not m.steps_known
    assert format_match(m).endswith("so the 3 collective(s) before them are not compared")
    assert not strict_match(step, rec(start + step * 2)).ok  # with steps 0 everywhere: not covered
    assert not strict_match(step[1:], rec(start + step * 2), steps_known=False).ok
    assert strict_match(step, rec(start + step), steps_known=False).repeats == 1
    assert not strict_match(step, rec(start + step), steps_known=False).ok
