"""bench/repredict_local.py: a kept validate_local folder predicted again. The rows come
from the folder's manifest (or, without one, its settings files matched to the grid),
each run from the profile validate_local predicted it with, and the table's error is
the prediction against the stored measurement."""

from __future__ import annotations

import json
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "repredict_local.py"
PROFILE = ROOT / "traces" / "local-cpu" / "small_z2.profile.json"  # a stored 2-rank gloo profile


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def ds_folder(tmp_path: Path, step_s: float) -> Path:
    """A folder as validate_local leaves it for one run of the grid's 'DS small z2'."""
    work = tmp_path / "work"
    work.mkdir(parents=True)
    (work / "rows.json").write_text(json.dumps({"rows": ["DS small z2"], "repeats": 1, "calibrate_once": False,
                                                "before_only": False}))
    (work / "ds0.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}))
    shutil.copy(PROFILE, work / "profile0.json")
    shutil.copy(PROFILE, work / "profile0.mean.json")
    # ds_train's timings: three warm-up steps, then the measured ones (median step_s)
    steps = [9.0, 9.0, 9.0, step_s - 0.01, step_s, step_s + 0.02]
    phases = {"forward": [1.0] * 6, "backward": [2.0] * 6, "step": [0.5] * 6}
    # minor faults: 1 MiB a step in backward, 32 MiB in the step, after a noisy warm-up
    page = resource.getpagesize()
    faults = {"forward": [9999, 0, 0, 0, 0, 0], "backward": [9999] * 3 + [(1 << 20) // page] * 3,
              "step": [9999] * 3 + [(32 << 20) // page] * 3}
    (work / "measured0.json").write_text(json.dumps({"step_times_s": steps, "phase_times_s": phases,
                                                     "phase_minor_faults": faults}))
    return work


def test_a_folder_predicted_again_against_its_measurement(tmp_path):
    work = ds_folder(tmp_path, 0.8)
    out = run(str(work))
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("DS small z2"))
    pred, meas, err = re.match(r"DS small z2\s+2\s+([\d.]+)\s+([\d.]+)\s+([+-][\d.]+)%", line).groups()
    assert float(meas) == 0.8  # the median of the measured steps, warm-up left out
    # the error of the unrounded prediction: within the printed figures' rounding of it
    assert abs(float(err) - (float(pred) - 0.8) / 0.8 * 100) <= 0.05 + 0.0005 / 0.8 * 100
    assert "phases: forward" in out.stdout and out.stdout.rstrip().splitlines()[-2].startswith("median |error|")
    # the heap's fresh pages beside the run's faults, the warm-up steps left out
    pages = re.search(r"fresh pages, MiB a step \(predicted / measured\): forward (\d+) / 0, backward (\d+) / 1, "
                      r"optimizer (\d+) / 32$", out.stdout, re.M)
    assert pages is not None, out.stdout
    assert int(pages.group(3)) > 0  # ZeRO-2's step: a flat fp32 gradient and AdamW's temporaries, over 32 MiB
    # the same prediction whatever the measurement: only the error moves
    work2 = ds_folder(tmp_path / "b", 1.6)
    line2 = next(ln for ln in run(str(work2)).stdout.splitlines() if ln.startswith("DS small z2"))
    assert line2.split()[4] == pred and float(line2.split()[5]) == 1.6
    # another profile's stalls put into every run's profile: the prediction moves
    stalled = tmp_path / "stalls.json"
    stalled.write_text(json.dumps({**json.loads(PROFILE.read_text()),
                                   "rank_stalls": {"rate_per_s": 200.0, "lengths_ns": [2_000_000, 6_000_000]}}))
    out3 = run(str(work), "--rank-stalls", str(stalled))
    line3 = next(ln for ln in out3.stdout.splitlines() if ln.startswith("DS small z2"))
    assert float(line3.split()[4]) > float(pred)


def test_folders_it_cannot_read(tmp_path):
    work = ds_folder(tmp_path, 0.8)
    out = run(str(work), "--row", "small z2")
    assert out.returncode == 2 and "--row 'small z2': not a row this folder measured" in out.stderr
    out = run(str(work), "--rank-stalls", str(PROFILE))
    assert out.returncode == 2 and f"--rank-stalls {PROFILE}: the profile has no rank_stalls" in out.stderr
    (work / "rows.json").unlink()  # no manifest: ds0.json is not the grid's first row
    out = run(str(work))
    assert out.returncode != 0 and "ds0.json is not the grid's row 0 ('small z3 opt')" in out.stderr


def test_the_heap_model_reaches_the_framework_rows_only(tmp_path):
    """--host-heap on a folder with an executor row: that row is predicted as it is (the
    heap model is of a framework's tensors, and predict refuses it for the executor)."""
    import gzip

    work = ds_folder(tmp_path, 0.8)
    for name in ("ds0.json", "profile0.json", "profile0.mean.json", "measured0.json"):
        (work / name).rename(work / name.replace("0", "1"))
    (work / "rows.json").write_text(json.dumps({"rows": ["small z2", "DS small z2"], "repeats": 1,
                                                "calibrate_once": False, "before_only": False}))
    (work / "measured0.json").write_bytes(gzip.decompress((ROOT / "traces" / "local-cpu" / "small_z2.json.gz")
                                                          .read_bytes()))
    shutil.copy(PROFILE, work / "profile0.json")
    shutil.copy(PROFILE, work / "profile0.mean.json")
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from local_grid import GRID, row_config
    finally:
        sys.path.remove(str(ROOT / "bench"))
    (work / "ds0.json").write_text(json.dumps(row_config(next(r for r in GRID if r.name == "small z2"))))
    plain, heap = run(str(work)), run(str(work), "--host-heap")
    assert plain.returncode == 0 and heap.returncode == 0, plain.stderr + heap.stderr
    lines = {k: {ln[:34].strip(): ln.split() for ln in o.stdout.splitlines() if ln.startswith(("small z2", "DS small"))}
             for k, o in (("plain", plain), ("heap", heap))}
    assert set(lines["plain"]) == set(lines["heap"]) == {"small z2", "DS small z2"}
    assert lines["plain"]["small z2"] == lines["heap"]["small z2"]  # the executor's row as it was


def test_reported_pages_of_an_executor_run(tmp_path):
    """The reported pages line's figures: the simulator's reported bytes by phase beside
    each large allocation's slow share, from its rate between the profile's first touch
    and first touch plus the reported pages' extra (rank 0, the measured steps only)."""
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "bench"))
    from local_grid import GRID
    from local_report import EXECUTOR_WARMUP, reported_pages

    from commsim.ir.trace import TraceMeta, TraceRecord, TraceSource, make_trace

    mib = 1 << 20
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"alloc": {"first_touch_ns_per_byte": 0.5, "reported_page_extra_ns_per_byte": 3.0}}))

    def alloc(step, rank, ns_per_byte, phase, size=64 * mib):
        return TraceRecord(rank, "host", 1, "alloc", "a", 0, int(size * ns_per_byte), size, 0, step, phase, "", "")

    recs = [alloc(0, 0, 3.5, "optimizer")]  # a warm-up step: not counted
    for step in range(EXECUTOR_WARMUP, EXECUTOR_WARMUP + 2):
        recs += [alloc(step, 0, 0.5, "bwd"), alloc(step, 0, 2.0, "optimizer"), alloc(step, 1, 3.5, "optimizer"),
                 alloc(step, 0, 9.0, "bwd", size=16 * mib)]  # rank 1 and small blocks: not counted
    out = tmp_path / "measured.json"
    make_trace(TraceMeta(TraceSource.MEASURED), recs).save(out)
    pred = SimpleNamespace(result=SimpleNamespace(ranks={0: SimpleNamespace(reported_page_bytes={"optimizer": 40 * mib})}))
    row = next(r for r in GRID if r.name == "small z3 opt")
    # optimizer: (2.0 - 0.5) / 3.0 = half of 64 MiB a step; backward: none
    assert reported_pages(row, out, pred, profile) == {"backward": (0.0, 0.0), "optimizer": (40.0, 32.0)}
    profile.write_text(json.dumps({"alloc": {"first_touch_ns_per_byte": 0.5}}))
    assert reported_pages(row, out, pred, profile) == {}  # not measured: no line
