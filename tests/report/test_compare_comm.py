"""compare's communication time: the time a rank's collectives are in flight, from the
moment the rank reaches each one (its wait for its peers included, as an executor and a
profiler record it), the mean over the ranks, since that wait falls to whichever rank is
ahead; and a predicted trace's collectives start where their rank reached them. Its
split into the collectives' own time and the ranks' waits for their peers."""

from dataclasses import replace

from commsim.api import Scenario, predict
from commsim.ir.trace import Trace, TraceMeta, TraceRecord, TraceSource
from commsim.report.compare import comm_split, compare, format_comparison


def rec(rank, op_id, kind, start_us, end_us, step, stream="compute", group=""):
    return TraceRecord(rank, stream, op_id, kind, f"op{op_id}", start_us * 1000, end_us * 1000,
                       0, 0, step, "fwd", "fp32", group)


def step_of(step, t0, late_rank):
    """Two ranks: a GEMM (the late rank's 30 us longer), then an all-gather that the
    early rank reaches 30 us before the late one; both see it end at the same time."""
    out = []
    for rank in (0, 1):
        late = 30 if rank == late_rank else 0
        out += [rec(rank, 1, "gemm", t0, t0 + 100 + late, step),
                rec(rank, 2, "all_gather", t0 + 100 + late, t0 + 150, step, stream="allgather")]
    return out


def test_communication_is_the_mean_over_ranks():
    pred = Trace(TraceMeta(TraceSource.PREDICTED, producer="test"), tuple(step_of(0, 0, late_rank=1)))
    # the measured steps: rank 1 late, then rank 0, then rank 1
    meas = Trace(TraceMeta(TraceSource.RECORDED, producer="test"),
                 tuple(step_of(1, 0, 1) + step_of(2, 1000, 0) + step_of(3, 2000, 1)))
    c = compare(pred, meas)
    # rank 0's own: 50 us predicted (it waits 30 of them), 50 / 20 / 50 measured; the mean
    # over the two ranks is 35 us in every step, predicted and measured
    assert c.predicted.comm_ns == 50_000
    assert c.predicted_comm_ns == 35_000
    assert c.measured_phase_ns["communication"] == 35_000
    assert c.phase_errors()["communication"] == 0.0
    assert c.to_json()["phase_s"]["communication"] == {"predicted": 35e-6, "measured": 35e-6}


def test_a_single_rank_prediction_is_its_own_mean():
    # a symmetric prediction holds rank 0 only: its communication time is rank 0's
    pred = Trace(TraceMeta(TraceSource.PREDICTED, producer="test"),
                 (rec(0, 1, "gemm", 0, 100, 0), rec(0, 2, "all_gather", 100, 160, 0, stream="allgather")))
    meas = Trace(TraceMeta(TraceSource.RECORDED, producer="test"), tuple(step_of(1, 0, 1)))
    c = compare(pred, meas)
    assert c.predicted_comm_ns == 60_000
    assert c.phase_errors()["communication"] == (60_000 - 35_000) / 35_000


def test_predicted_collectives_start_where_their_rank_reached_them():
    # per-rank mode with drifting ranks: some collective waits for a peer; its trace
    # record starts at the arrival, so that it is timed as a measurement times it
    pred = predict(Scenario(model="tiny", nodes=1, gpus_per_node=2, seq=16, mode="per-rank"))
    waited = [r for rr in pred.result.ranks.values() for r in rr.records if r.wait_peers_ns > 0]
    assert waited, "no collective waited for a peer: the check below would be empty"
    rows = {(t.rank, t.op_id, t.stream): t for t in pred.trace().records}
    for r in waited:
        t = rows[(r.rank, int(r.op.id), r.stream)]
        assert (t.start_ns, t.end_ns) == (r.start_ns - r.wait_peers_ns, r.end_ns)


def test_communication_splits_into_own_time_and_waits_for_peers():
    # the early rank's all-gather lasts 50 us, the late rank's 20: the late rank waited
    # for nobody, so 20 us is the collective's own time and the early rank waited 30;
    # over the two ranks: 20 us own, 15 us waiting, in every step, whichever rank is late
    pred = Trace(TraceMeta(TraceSource.PREDICTED, producer="test"), tuple(step_of(0, 0, late_rank=1)))
    meas = Trace(TraceMeta(TraceSource.RECORDED, producer="test"),
                 tuple(step_of(1, 0, 1) + step_of(2, 1000, 0) + step_of(3, 2000, 1)))
    c = compare(pred, meas)
    assert c.predicted_comm_split_ns == (20_000, 15_000)
    assert c.measured_comm_split_ns == (20_000, 15_000)
    assert c.to_json()["communication_split_s"] == {"own": {"predicted": 20e-6, "measured": 20e-6},
                                                    "peer_wait": {"predicted": 15e-6, "measured": 15e-6}}
    text = format_comparison(c)
    assert "collectives' own" in text and "waits for peers" in text


def test_the_split_needs_no_common_clock():
    # ranks on different hosts: rank 1's clock a second ahead of rank 0's; only
    # durations are compared, so the split is the same
    recs = step_of(1, 0, late_rank=1)
    shifted = [replace(r, start_ns=r.start_ns + 10**9, end_ns=r.end_ns + 10**9) if r.rank == 1 else r for r in recs]
    assert comm_split(shifted, 1) == comm_split(recs, 1) == (20_000, 15_000)


def test_the_split_keeps_groups_apart():
    # one op id, two groups (each pair of ranks its own): each group's shortest member
    # sets its own time; the sums are averaged over the four ranks
    recs = [rec(0, 7, "all_gather", 0, 10, 0, group="0,1"), rec(1, 7, "all_gather", 0, 40, 0, group="0,1"),
            rec(2, 7, "all_gather", 0, 25, 0, group="2,3"), rec(3, 7, "all_gather", 0, 25, 0, group="2,3")]
    assert comm_split(recs, 0) == ((10_000 * 2 + 25_000 * 2) / 4, 30_000 / 4)


def test_a_collective_one_rank_recorded_is_all_own_time():
    recs = [rec(0, 1, "gemm", 0, 100, 0), rec(0, 2, "all_gather", 100, 160, 0, stream="allgather")]
    assert comm_split(recs, 0) == (60_000, 0.0)
    assert comm_split(recs, 5) == (0.0, 0.0)  # no such step


def test_without_collectives_the_split_is_not_printed():
    pred = Trace(TraceMeta(TraceSource.PREDICTED, producer="test"), (rec(0, 1, "gemm", 0, 100, 0),))
    meas = Trace(TraceMeta(TraceSource.RECORDED, producer="test"), (rec(0, 1, "gemm", 0, 90, 1),))
    c = compare(pred, meas)
    assert c.predicted_comm_split_ns == c.measured_comm_split_ns == (0.0, 0.0)
    assert "waits for peers" not in format_comparison(c)


def test_a_noisy_predictions_phases_ops_and_communication_are_medians_over_its_seeded_steps(tmp_path):
    """A per-rank prediction with drifting ranks returns its median step, but each of that
    step's phases, ops and collectives is one draw: compare takes each as its median over
    the seeded steps the trace holds (``step_samples``: rank, op, phase, start, end ns),
    as the measured ones are medians over the measured steps."""
    us = 1000

    def sample(gemm0, gemm1, end):
        # rank 0's forward GEMM, then an all-gather both ranks leave at ``end``
        return ((0, 1, "fwd", 0, gemm0 * us), (0, 2, "fwd", gemm0 * us, end * us),
                (1, 1, "fwd", 0, gemm1 * us), (1, 2, "fwd", gemm1 * us, end * us))

    samples = (sample(100, 130, 150), sample(90, 80, 120), sample(120, 100, 160))
    returned = sample(100, 130, 150)  # the median step by step time
    pred = Trace(TraceMeta(TraceSource.PREDICTED, producer="test", extra=(("step_samples", samples),)),
                 tuple(rec(r, op, "gemm" if op == 1 else "all_gather", a // us, b // us, 0,
                           stream="compute" if op == 1 else "allgather") for r, op, _, a, b in returned))
    meas = Trace(TraceMeta(TraceSource.RECORDED, producer="test"),
                 tuple(step_of(1, 0, 1) + step_of(2, 1000, 0) + step_of(3, 2000, 1)))
    for p in (pred, Trace.load(_saved(pred, tmp_path))):  # and read back from its file
        c = compare(p, meas)
        # rank 0's forward ends at 150 / 120 / 160 us: median 150
        assert c.predicted.phase_ns["forward"] == 150 * us
        # op 1 on rank 0 takes 100 / 90 / 120 us (median 100), op 2 50 / 30 / 40 (median 40)
        assert {r.op_id: pns for _, pns, _, r in c.op_errors} == {1: 100 * us, 2: 40 * us}
        # communication, the mean over the ranks: (50 + 20) / 2, (30 + 40) / 2, (40 + 60) / 2
        assert c.predicted_comm_ns == 35 * us
    # without samples (a symmetric or noise-free prediction) the one step's figures
    plain = compare(Trace(TraceMeta(TraceSource.PREDICTED, producer="test"), pred.records), meas)
    assert {r.op_id: pns for _, pns, _, r in plain.op_errors} == {1: 100 * us, 2: 50 * us}
    assert plain.predicted_comm_ns == (50 + 20) / 2 * us


def _saved(trace, tmp_path):
    path = tmp_path / "pred.json"
    trace.save(str(path))
    return str(path)
