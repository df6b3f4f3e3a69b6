"""compare's busy time per kind of op: each kind's predicted and measured time summed over
the ops both traces have (the measured one the mean over its steps), in its text and JSON."""

from commsim.ir.trace import Trace, TraceMeta, TraceRecord, TraceSource
from commsim.report.compare import compare, format_comparison


def rec(op_id, kind, start_us, dur_us, step):
    return TraceRecord(0, "compute", op_id, kind, f"op{op_id}", start_us * 1000, (start_us + dur_us) * 1000,
                       0, 0, step, "fwd", "fp32", "")


def test_busy_by_kind_sums_the_compared_ops():
    pred = Trace(TraceMeta(TraceSource.PREDICTED, producer="test"),
                 (rec(1, "gemm", 0, 100, 0), rec(2, "gemm", 100, 50, 0), rec(3, "softmax", 150, 10, 0),
                  rec(4, "norm", 160, 5, 0)))  # op 4: never measured
    # two measured steps: the GEMMs 20% slower than predicted on average, the softmax as predicted
    meas = Trace(TraceMeta(TraceSource.RECORDED, producer="test"),
                 (rec(1, "gemm", 0, 110, 1), rec(2, "gemm", 110, 60, 1), rec(3, "softmax", 170, 10, 1),
                  rec(1, "gemm", 1000, 130, 2), rec(2, "gemm", 1130, 60, 2), rec(3, "softmax", 1190, 10, 2)))
    c = compare(pred, meas)
    assert c.busy_by_kind() == {"gemm": (150_000, 180_000), "softmax": (10_000, 10_000)}
    text = format_comparison(c)
    assert "busy per op kind" in text
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("busy per op kind"))
    assert lines[i + 1].split() == ["gemm", "0.15", "0.18", "-16.7%"]  # the largest measured first
    assert lines[i + 2].split() == ["softmax", "0.01", "0.01", "+0.0%"]
    assert c.to_json()["busy_s_by_kind"]["gemm"] == {"predicted": 150e-6, "measured": 180e-6}
