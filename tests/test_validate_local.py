"""bench/validate_local.py's order of calibrations and runs, with calibrate and the runs
replaced by stored files (a stored profile, the stored measured trace of each row), so
the order and the files each run is predicted from are checked without measuring."""

import gzip
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STORED = ROOT / "traces" / "local-cpu"
ROWS = ("small z3 opt", "small z2")  # in the grid's order


def run_grid(monkeypatch, tmp_path, *flags: str) -> tuple[list[str], str, Path]:
    """validate_local on the two rows with ``flags``: the events in order ("cal <file>",
    "run <file>"), the printed output and the work folder."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import validate_local as vl
    finally:
        sys.path.remove(str(ROOT / "bench"))
    events: list[str] = []

    def fake_commsim(*args: str, env=None) -> str:
        assert args[0] == "calibrate", args
        out = Path(args[args.index("-o") + 1])
        shutil.copy(STORED / "small_z2.profile.json", out)
        events.append(f"cal {out.name}")
        return ""

    def fake_executor(row, sched_path, out, steps):
        stem = row.name.replace(" ", "_")
        out.write_bytes(gzip.decompress((STORED / f"{stem}.json.gz").read_bytes()))
        events.append(f"run {out.name}")
        return vl.median_step_s(out)

    monkeypatch.setattr(vl, "commsim", fake_commsim)
    monkeypatch.setattr(vl, "measure_executor", fake_executor)
    monkeypatch.setattr(vl, "settle", lambda: (0, 0))
    monkeypatch.setattr(vl.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    argv = ["validate_local.py", *[a for r in ROWS for a in ("--row", r)], *flags]
    monkeypatch.setattr(sys, "argv", argv)
    from io import StringIO

    buf = StringIO()
    monkeypatch.setattr(sys, "stdout", buf)
    vl.main()
    return events, buf.getvalue(), tmp_path


@pytest.mark.parametrize("interleave", [False, True])
def test_order_of_calibrations_and_runs(monkeypatch, tmp_path, interleave):
    """A row's own sitting shares the calibration between its runs (calibrate, run,
    calibrate, run, calibrate); interleaved, every row runs once, then every row again,
    each run between calibrations of its own."""
    events, out, work = run_grid(monkeypatch, tmp_path, "--repeats", "2", *(["--interleave"] if interleave else []))
    if interleave:
        assert events == ["cal profile0.json", "run measured0.json", "cal profile0.after.json",
                          "cal profile1.json", "run measured1.json", "cal profile1.after.json",
                          "cal profile0.before.2.json", "run measured0.2.json", "cal profile0.after.2.json",
                          "cal profile1.before.2.json", "run measured1.2.json", "cal profile1.after.2.json"]
        assert "  pass 1/2: small z2: predicted" in out and "  pass 1/2: small z3 opt: predicted" in out
        assert "pass 2/2" not in out
    else:
        assert events == ["cal profile0.json", "run measured0.json", "cal profile0.after.json",
                          "run measured0.2.json", "cal profile0.after.2.json",
                          "cal profile1.json", "run measured1.json", "cal profile1.after.json",
                          "run measured1.2.json", "cal profile1.after.2.json"]
        assert "pass 1/2" not in out
    # every run predicted from the mean of the calibrations around it, and a line per row
    for i in (0, 1):
        assert (work / f"profile{i}.mean.json").exists() and (work / f"profile{i}.mean.2.json").exists()
    rows = [ln for ln in out.splitlines() if ln.startswith(ROWS)]
    assert [ln[:34].strip() for ln in rows] == list(ROWS)
    assert json.loads((work / "rows.json").read_text())["interleave"] is interleave
    assert "median |error| = " in out.splitlines()[-2] and out.splitlines()[-1].startswith("phases: median |error|")


def test_interleaved_before_only_predicts_each_run_from_its_own_calibration(monkeypatch, tmp_path):
    """--before-only interleaved: one calibration right before each run, none after;
    bench/repredict_local.py finds each run's own."""
    events, _, work = run_grid(monkeypatch, tmp_path, "--repeats", "2", "--interleave", "--before-only")
    assert events == ["cal profile0.json", "run measured0.json", "cal profile1.json", "run measured1.json",
                      "cal profile0.before.2.json", "run measured0.2.json",
                      "cal profile1.before.2.json", "run measured1.2.json"]
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from repredict_local import run_profile
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert [run_profile(work, 1, k).name for k in (0, 1)] == ["profile1.json", "profile1.before.2.json"]
