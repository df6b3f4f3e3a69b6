"""The trace schema: JSON round trip, DataFrame round trip, Chrome export."""

import json

import pytest

from commsim.ir.errors import ScheduleFormatError
from commsim.ir.trace import Trace, TraceMeta, TraceRecord, TraceSource, make_trace

META = TraceMeta(TraceSource.PREDICTED, producer="test", schedule_hash="abc", hardware="p4d", seed=7,
                 extra=(("mode", "symmetric"),))
RECORDS = [
    TraceRecord(1, "compute", 3, "gemm", "layer0.fwd", 100, 250, 4096, 10**6, 0, "fwd"),
    TraceRecord(0, "allgather", 2, "all_gather", "fetch", 0, 90, 8192, 0, 0, "fwd", "bf16", "0,1"),
    TraceRecord(0, "host", 1, "host_python", "hook", 0, 5),
]


def test_json_round_trip(tmp_path):
    t = make_trace(META, RECORDS)
    assert [r.rank for r in t.records] == [0, 0, 1]
    path = tmp_path / "t.json"
    t.save(path)
    assert Trace.load(path) == t


def test_dataframe_round_trip():
    t = make_trace(META, RECORDS)
    df = t.to_dataframe()
    assert list(df["duration_ns"]) == [90, 5, 150]
    assert Trace.from_dataframe(df, META) == t


def test_chrome_trace_names_ranks_and_streams():
    chrome = make_trace(META, RECORDS).to_chrome_trace()
    xs = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["name"], e["ts"], e["dur"]) for e in xs} == {
        (1, "layer0.fwd", 0.1, 0.15), (0, "fetch", 0.0, 0.09), (0, "hook", 0.0, 0.005)}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in chrome["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["allgather", "compute", "host"]
    json.dumps(chrome)  # serialisable


@pytest.mark.parametrize("version", [2, 4])
def test_load_refuses_other_versions(tmp_path, version):
    obj = make_trace(META, RECORDS).to_dict()
    obj["schema_version"] = version
    path = tmp_path / "t.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ScheduleFormatError, match=rf"t.json: unsupported trace schema version {version}; "
                       r"this commsim reads 3"):
        Trace.load(path)


def test_phase_dtype_and_group_are_columns():
    t = make_trace(META, RECORDS)
    assert t.to_dict()["columns"][-3:] == ["phase", "dtype", "group"]
    assert [r.phase for r in t.records] == ["fwd", "other", "fwd"]
    assert list(t.to_dataframe()["phase"]) == ["fwd", "other", "fwd"]
    assert [(r.dtype, r.group) for r in t.records] == [("bf16", "0,1"), ("", ""), ("", "")]


def test_a_collectives_columns_come_from_the_op():
    from commsim.ir import ops as O

    ag = O.Collective(O.OpId(1), "allgather", "ag", O.CollectiveKind.ALL_GATHER, 64, O.DType.FP16, (0, 2, 4))
    mm = O.Compute(O.OpId(2), "compute", "mm", O.ComputeKind.ELEMENTWISE, 1, 1, 1)
    assert O.collective_columns(ag) == ("fp16", "0,2,4")
    assert O.collective_columns(mm) == ("", "")


def test_on_one_clock_shifts_each_rank_by_its_own_step_start(tmp_path):
    # rank 1 started step 0 1500 ns after rank 0 and step 1 200 ns before it
    meta = TraceMeta(TraceSource.MEASURED, extra=(("step_start_monotonic_ns", {"0": [10_000, 50_000],
                                                                               "1": [11_500, 49_800]}),))
    recs = [TraceRecord(0, "allgather", 1, "all_gather", "ag", 100, 900, 8, 0, 0, "fwd"),
            TraceRecord(1, "allgather", 1, "all_gather", "ag", 0, 700, 8, 0, 0, "fwd"),
            TraceRecord(0, "allgather", 1, "all_gather", "ag", 100, 900, 8, 0, 1, "fwd"),
            TraceRecord(1, "allgather", 1, "all_gather", "ag", 400, 1300, 8, 0, 1, "fwd")]
    path = tmp_path / "m.json"
    make_trace(meta, recs).save(path)  # the starts survive JSON (rank keys as strings)
    aligned = Trace.load(path).on_one_clock()
    assert sorted((r.rank, r.step, r.start_ns, r.end_ns) for r in aligned.records) == [
        (0, 0, 100, 900), (0, 1, 300, 1100), (1, 0, 1500, 2200), (1, 1, 400, 1300)]
    plain = make_trace(META, RECORDS)
    assert plain.on_one_clock() is plain  # nothing to align by
