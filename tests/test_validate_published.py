"""bench/validate_published.py: it runs, ends with its two summary lines, and a row's
arithmetic (nccl-tests' busbw conversion, the error, a range's midpoint) is right.
Accuracy is not asserted: the script reports it."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "validate_published.py"


@pytest.fixture(scope="module")
def vp():
    spec = importlib.util.spec_from_file_location("validate_published", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_busbw_follows_nccl_tests(vp):
    # N1's 1 GiB row: 26217 us over 2x8 GPUs is algbw 40.96, busbw 76.79 GB/s in nccl-tests' output
    t_ns = 26217e3
    assert round(vp.busbw_gb_per_s(vp.AR, 2**30, t_ns, 1), 2) == 0.0  # one rank: no bus traffic
    assert round(2**30 / t_ns, 2) == 40.96
    assert round(vp.busbw_gb_per_s(vp.AR, 2**30, t_ns, 16), 2) == 76.79
    # all_gather / reduce_scatter: (n-1)/n of algbw, the size being the gathered output
    assert vp.busbw_gb_per_s(vp.AG, 10**9, 10**6, 8) == 875.0
    assert vp.busbw_gb_per_s(vp.RS, 10**9, 10**6, 8) == 875.0


def test_row_error_and_range(vp):
    row = vp.Row("N1", "x", "setup", "us", 200.0, 150.0, vp.KC)
    assert row.error == -0.25 and row.in_range is None
    r = vp.range_row("E2", "x", "setup", "ms", 60.0, [40.0, 100.0, 70.0], vp.E2E)
    assert r.predicted == 70.0 and r.predicted_range == (40.0, 100.0) and r.in_range
    assert r.error == pytest.approx(10 / 60)
    assert vp.range_row("E2", "x", "setup", "ms", 60.0, [], vp.E2E).error is None


def test_busbw_row_is_the_simulated_collective_converted(vp):
    cluster = vp.cluster_preset("p4d", 1)
    t_ns, _ = vp.collective(cluster, vp.AR, 2**30)
    row = vp.busbw_row("I1", "x", cluster, "p4d", vp.AR, 2**30, 230.8)
    assert row.predicted == 2**30 / t_ns * 2 * 7 / 8
    assert row.error == (row.predicted - 230.8) / 230.8


def test_script_prints_rows_skips_and_two_summary_lines():
    out = run("--only", "N1,X5,N5")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.rstrip("\n").splitlines()
    assert re.fullmatch(r"kernels\+collectives: median \|error\| = \d+\.\d%  max \|error\| = \d+\.\d%  items = 15",
                        lines[-2]), lines[-2]
    assert lines[-1] == "end-to-end: median |error| = n/a  max |error| = n/a  items = 0"
    assert sum(line.startswith("N1 ") for line in lines) == 13
    # N1's 8 B, 1 GiB and 2 GiB rows and X5's two set constants: marked, and left out of the checks
    assert sum("  [sets: " in line for line in lines) == 5
    assert re.fullmatch(r"5 kernels\+collectives rows set a constant \(\[sets: \.\.\.\]\); the other 10: "
                        r"median \|error\| = \d+\.\d%  max \|error\| = \d+\.\d%", lines[-3]), lines[-3]
    assert any(line.strip().startswith("N5 ") for line in lines)  # skipped, with its reason
    # per family, from the same rows: N1's 13 and X5's 2 (the skipped N5 counts nowhere)
    fam = lines[lines.index("by family (|error| of each row; a range row compares the middle of its range):") + 1:]
    assert [f.split()[:3] for f in fam[:2]] == [["N", "rows", "13"], ["X", "rows", "2"]] and fam[2] == ""


def test_json_rows_and_unknown_item():
    out = run("--only", "N1", "--json")
    assert out.returncode == 0, out.stderr
    objs = [json.loads(line) for line in out.stdout.splitlines()]
    rows = [o for o in objs if "published" in o]
    assert len(rows) == 13 and all(o["item"] == "N1" for o in rows)
    for o in rows:
        assert o["error"] == (o["predicted"] - o["published"]) / o["published"]
    assert [o["summary"] for o in objs if "summary" in o] == ["kernels+collectives", "end-to-end"]
    (checks,) = [o for o in objs if "checks_only" in o]
    assert [o["what"] for o in rows if o["sets"]] == ["all_reduce 8 B time", "all_reduce 1 GiB time",
                                                       "all_reduce 2 GiB time"]
    left = sorted(abs(o["error"]) for o in rows if not o["sets"])
    assert checks == {"checks_only": "kernels+collectives", "median_abs_error": (left[4] + left[5]) / 2,
                      "max_abs_error": left[-1], "items": 10, "sources": 3}
    (fam,) = [o for o in objs if "family" in o]
    errs = sorted(abs(o["error"]) for o in rows)
    assert fam == {"family": "N", "median_abs_error": errs[6], "max_abs_error": errs[-1], "items": 13}
    bad = run("--only", "Z9")
    assert bad.returncode == 2 and "Z9" in bad.stderr


def test_e5_fsdp_llama_runs_fit_on_both_networks(vp, tmp_path):
    """E5's four fms-fsdp runs, each predicted on InfiniBand and on EFA: all of them fit in
    80 GB, so each row has a range of two points (with eager attention, or every forward
    output kept, the 7B run ran out of memory)."""
    rows = vp.e5(tmp_path)
    assert [r.item for r in rows] == ["E5"] * 4 and [r.published for r in rows] == [3760.0, 1700.0, 772.0, 380.0]
    for r in rows:
        assert r.predicted_range is not None and r.note == "range over the two networks"
        lo, hi = r.predicted_range
        assert 0 < lo <= hi
