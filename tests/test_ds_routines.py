"""bench/ds_routines.py: DeepSpeed's routines timed inside a real step, read per phase and per site."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import ds_routines as dr  # noqa: E402


def _ev(label, t0, t1, thread, faults=0):
    return (label, t0, t1, thread, faults)


# two steps: a forward (with two fetches) and a backward (one flush) each; the first
# step's calls are the warm-up's
EVENTS = [
    _ev("engine.forward", 0.0, 1.0, 0.8), _ev("fetch", 0.1, 0.2, 0.05), _ev("fetch", 0.3, 0.5, 0.10),
    _ev("engine.backward", 1.0, 3.0, 1.5), _ev("bucket flush", 1.5, 2.5, 0.2),
    _ev("engine.forward", 10.0, 11.0, 0.7), _ev("fetch", 10.1, 10.2, 0.03), _ev("fetch", 10.3, 10.5, 0.30),
    _ev("engine.backward", 11.0, 13.0, 1.4), _ev("bucket flush", 11.5, 12.5, 0.4, 256),
    _ev("engine.forward", 20.0, 21.0, 0.9), _ev("fetch", 20.1, 20.2, 0.07), _ev("fetch", 20.3, 20.5, 0.20),
]


def test_routines_count_in_the_phase_that_holds_them_per_step_after_the_warm_up():
    t = dr.routine_table(EVENTS, first=1)
    # forward: steps 2 and 3; fetch 0.03 + 0.30 and 0.07 + 0.20 s of thread time, two calls a step
    thread, wall, calls, fresh = t["forward"]["fetch"]
    assert thread == pytest.approx((0.33 + 0.27) / 2 * 1e3) and calls == 2.0 and fresh == 0.0
    assert wall == pytest.approx(0.3 * 1e3)
    assert t["forward"]["engine.forward"][0] == pytest.approx(0.8e3)
    # backward: only step 2's (step 3 has none); its flush is not a forward routine
    assert t["backward"]["bucket flush"] == pytest.approx((0.4e3, 1.0e3, 1.0, 256 * 4096 / 2**20))
    assert "bucket flush" not in t["forward"] and "fetch" not in t["backward"]


def test_a_sites_spread_is_summed_over_sites():
    # sites: first fetch of each step (0.03, 0.07), second (0.30, 0.20)
    mn, med, mean = dr.site_sums(EVENTS, "fetch", first=1)
    assert mn == pytest.approx((0.03 + 0.20) * 1e3)
    assert med == pytest.approx((0.05 + 0.25) * 1e3) and mean == pytest.approx(med)
    # steps with different call counts have no sites
    assert dr.site_sums(EVENTS + [_ev("fetch", 20.6, 20.7, 0.01)], "fetch", first=1) is None
    # the flush is called in step 2 only: no site spans the steps
    assert dr.site_sums(EVENTS, "bucket flush", first=1) is None


def test_report_sets_deepspeed_beside_the_plain_model():
    plain = [_ev("engine.forward", 0, 1, 0.5), _ev("engine.backward", 1, 2, 1.0),
             _ev("engine.forward", 2, 3, 0.6), _ev("engine.backward", 3, 4, 1.2)]
    row = dr.framework_row("DS small z3")
    lines = dr.report(row, EVENTS, plain, 1, {"forward": {"host_module_hook": (6.5, 10)}})
    assert lines[0] == "DS small z3: 2 ranks, rank 0, steps after the first 1"
    assert lines[2] == f"{'forward':<10}{1000.0:>10.1f}{800.0:>11.1f}{600.0:>17.1f}{200.0:>+16.1f}"
    assert "  forward   host_module_hook 6.50 (10)" in lines


def test_only_deepspeed_and_fsdp2_rows():
    assert dr.framework_row("FSDP2 small").runner == "fsdp2"
    with pytest.raises(ValueError, match="'small z2': not a DeepSpeed or FSDP2 row of the grid; rows: DS small z3"):
        dr.framework_row("small z2")
    out = subprocess.run([sys.executable, str(Path(dr.__file__)), "--row", "small z2"], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "--row 'small z2': not a DeepSpeed or FSDP2 row" in out.stderr


def test_an_fsdp2_row_is_reported_as_fsdp2():
    plain = [_ev("engine.forward", 0, 1, 0.5), _ev("engine.backward", 1, 2, 1.0)]
    lines = dr.report(dr.framework_row("FSDP2 small"), EVENTS, plain, 1, None)
    assert lines[1].endswith(f"{'FSDP2 adds':>16}")


def test_fsdp2_phases_are_the_root_call_the_backward_and_the_step():
    # in a process of its own: the markers patch torch and the model's class for good
    code = """
import sys, torch
sys.path.insert(0, 'bench')
import ds_routines as dr
import runtime.torch_models as tm
from commsim.models import resolve_model
events = []
dr._time_modules({})
dr._fsdp2_phases(events)
torch.manual_seed(0)
m = tm.build_model(resolve_model('tiny'))
opt = torch.optim.AdamW(m.parameters())
ids = torch.randint(0, 100, (2, 8))
for _ in range(2):
    m(ids, labels=ids).backward()
    opt.step()
print(' '.join(e[0] for e in sorted(events, key=lambda e: e[1])))
"""
    root = Path(dr.__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["engine.forward", "engine.backward", "engine.step"] * 2


def test_module_calls_per_class_per_step_after_the_warm_up():
    modules = {"0 Linear": [9.0, 4], "1 Linear": [0.004, 4], "2 Linear": [0.006, 4], "1 Dropout": [0.001, 2],
               "2 Dropout": [0.003, 2]}
    t = dr.module_table(modules, first=1)
    assert t["Linear"] == pytest.approx((5.0, 4.0)) and t["Dropout"] == pytest.approx((2.0, 2.0))
    plain = {"1 Linear": [0.002, 4], "2 Linear": [0.002, 4], "1 Dropout": [0.0, 2], "2 Dropout": [0.0, 2]}
    row = dr.framework_row("DS small z3")
    lines = dr.report(row, EVENTS, [], 1, None, modules, plain)
    i = lines.index("module calls (forward and recompute), exclusive thread ms a step (hooks included): "
                    "DeepSpeed / plain, calls, what DeepSpeed adds a call")
    # sorted by what DeepSpeed adds a step: Linear 3 ms (750 us a call), Dropout 2 ms (1000 us a call)
    assert lines[i + 1] == f"  {'Linear':<32}{5.0:>9.2f} /{2.0:>9.2f}{4.0:>8.1f}{750:>+10.0f} us"
    assert lines[i + 2] == f"  {'Dropout':<32}{2.0:>9.2f} /{0.0:>9.2f}{2.0:>8.1f}{1000:>+10.0f} us"


def test_module_timing_is_exclusive_and_counts_steps_at_the_root():
    torch = pytest.importorskip("torch")
    call = torch.nn.Module.__call__
    modules: dict = {}
    try:
        dr._time_modules(modules)
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        for _ in range(3):
            net(torch.zeros(2, 4))
            net[1](torch.zeros(2))  # a child alone, outside a root call: the same step
    finally:
        torch.nn.Module.__call__ = call
    assert {k: v[1] for k, v in modules.items()} == {f"{s} {c}": n for s in range(3)
                                                     for c, n in (("Sequential", 1), ("Linear", 1), ("ReLU", 2))}
    # the root's own time leaves out its children's
    assert all(v[0] >= 0 for v in modules.values())
