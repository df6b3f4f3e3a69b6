"""compare's communication time: the time a rank's collectives are in flight, from the
moment the rank reaches each one (its wait for its peers included, as an executor and a
profiler record it), the mean over the ranks, since that wait falls to whichever rank is
ahead; and a predicted trace's collectives start where their rank reached them."""

from commsim.api import Scenario, predict
from commsim.ir.trace import Trace, TraceMeta, TraceRecord, TraceSource
from commsim.report.compare import compare


def rec(rank, op_id, kind, start_us, end_us, step, stream="compute"):
    return TraceRecord(rank, stream, op_id, kind, f"op{op_id}", start_us * 1000, end_us * 1000,
                       0, 0, step, "fwd", "fp32", "")


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
