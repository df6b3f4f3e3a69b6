"""runtime/ds_host_costs.py: DeepSpeed's own routines timed on the CPU, fitted, and the
constants in commsim.strategies.knobs derived from the stored measurements."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commsim.models import describe
from commsim.strategies.knobs import HOST_COSTS, HostCosts
from commsim.strategies.zero3_trace import module_trace
from runtime import ds_host_costs as H

ROOT = Path(__file__).resolve().parents[2]
STORED = sorted((ROOT / "traces" / "host-costs").glob("deepspeed-*-world*.json"))


def test_fit_recovers_a_fixed_cost_and_per_item_costs():
    calls = [(1000 + 200 * p + 3000 * g, {"param": p, "gathered": g}) for p in range(5) for g in range(3)]
    f = H.fit(calls, ["param", "gathered"])
    assert (f["fixed_ns"], f["per_param_ns"], f["per_gathered_ns"]) == (1000, 200, 3000)
    assert f["r2"] == 1.0 and f["total_counts"] == {"param": 30, "gathered": 15}
    # a cost that would come out negative is dropped, the rest refitted
    f = H.fit([(500 - 10 * p, {"param": p}) for p in range(5)], ["param"])
    assert f["per_param_ns"] == 0 and f["fixed_ns"] == 480


def test_a_relative_fit_keeps_the_small_calls_fixed_cost_when_the_large_ones_drift():
    """Flushes of 1-40 gradients: 150 us + 20 us a gradient, the largest two timed 20%
    slow (this machine's speed drifts by a factor between processes)."""
    ns = H.FLUSH_COUNTS
    calls = [(round((150_000 + 20_000 * n) * (1.2 if n >= 32 else 1.0)), {"grad": n}) for n in ns]
    exact = H.fit([(150_000 + 20_000 * n, {"grad": n}) for n in ns], ["grad"], relative=True)
    assert (exact["fixed_ns"], exact["per_grad_ns"]) == (150_000, 20_000)
    absolute, relative = H.fit(calls, ["grad"]), H.fit(calls, ["grad"], relative=True)
    assert absolute["fixed_ns"] < 0.8 * 150_000  # the drift of the large calls took a fifth of it
    assert abs(relative["fixed_ns"] - 150_000) < 0.06 * 150_000
    assert abs(relative["per_grad_ns"] - 20_000) < 0.15 * 20_000


def test_several_processes_runs_become_each_calls_minimum():
    run = {"deepspeed": "0.19.8", "world": 8, "primitives": {"torch_op_ns": 2500},
           "calls": {"flush_sweep": [[300, {"grad": 1}], [900, {"grad": 8}]], "grad_hook": [[40, {}]]}}
    other = {**run, "primitives": {"torch_op_ns": 2400},
             "calls": {"flush_sweep": [[310, {"grad": 1}], [800, {"grad": 8}]], "grad_hook": [[50, {}]]}}
    merged = H.min_over_runs([run, other])
    assert merged["calls"] == {"flush_sweep": [[300, {"grad": 1}], [800, {"grad": 8}]], "grad_hook": [[40, {}]]}
    assert merged["primitives"] == {"torch_op_ns": 2400} and merged["processes"] == 2
    with pytest.raises(AssertionError):  # different calls are not one measurement
        H.min_over_runs([run, {**other, "calls": {**other["calls"], "grad_hook": [[50, {}], [50, {}]]}}])


def test_the_plumbing_over_processes_is_the_fastest_window_less_the_fastest_plain_step():
    def run(untimed, plain, wrapper, per):
        return {"deepspeed": "0.19.8", "world": 8, "primitives": {}, "calls": {},
                "plumbing": {"untimed_ns": untimed, "plain_ns": plain, "wrapper_ns": wrapper, "wrapped_calls": 30,
                             "hook_calls": 20, "per_hook_call_ns": per}}

    merged = H.min_over_runs([run(9_000_000, 2_000_000, 1000, 1), run(8_000_000, 2_500_000, 3000, 2),
                              run(8_500_000, 2_200_000, 2000, 3)])
    # (8.0 ms - 2.0 ms - 30 wrapped calls x 2 us) / 20 hook calls
    assert merged["plumbing"]["per_hook_call_ns"] == 297_000
    assert merged["plumbing"]["per_process_ns"] == [1, 2, 3]
    with pytest.raises(AssertionError):  # other hook counts are not one measurement
        H.min_over_runs([run(1, 1, 1, 1), {**run(1, 1, 1, 1), "plumbing": {**run(1, 1, 1, 1)["plumbing"],
                                                                          "hook_calls": 21}}])


def test_derive_takes_the_flush_timed_alone_where_it_was(tmp_path):
    """The stored 0.19.8 measurements with a flush sweep added whose times follow known
    costs: derive() fits those (fixed, per rank, per gradient, per gradient and rank),
    not the step's flushes; the other figures stay the stored ones'."""
    paths = []
    for path in STORED:
        doc = json.loads(path.read_text())
        if doc["deepspeed"] != "0.19.8":
            continue
        w = doc["world"]
        doc["calls"]["flush_sweep"] = [[150_000 + 300 * w + n * (4_000 + 2_000 * w), {"grad": n}]
                                       for n in H.FLUSH_COUNTS]
        paths.append(tmp_path / path.name)
        paths[-1].write_text(json.dumps(doc))
    derived = H.derive([str(p) for p in paths])["0.19.8"]
    got = [derived[k] for k in ("reduce_flush_ns", "reduce_flush_rank_ns", "reduce_param_ns", "reduce_param_rank_ns")]
    assert got == [150_000, 300, 4_000, 2_000] and derived["_fit"]["flush_timed"] == "alone, 1-40 gradients"
    assert derived["_fit"]["flush_per_rank"] == "fitted"
    # where the runs timed torch.chunk's per view, that is the per-rank term (the least
    # of the worlds' figures), taken off each call before the other three are fitted
    for k, p in enumerate(paths):
        doc = json.loads(p.read_text())
        w = doc["world"]
        doc["calls"]["flush_sweep"] = [[150_000 + 373 * w + n * (4_000 + 2_000 * w), {"grad": n}]
                                       for n in H.FLUSH_COUNTS]
        doc["primitives"]["chunk_view_ns"] = 373 + 20 * k
        p.write_text(json.dumps(doc))
    chunked = H.derive([str(p) for p in paths], exact=True)["0.19.8"]
    got = [chunked[k] for k in ("reduce_flush_ns", "reduce_flush_rank_ns", "reduce_param_ns", "reduce_param_rank_ns")]
    assert got == [150_000, 373, 4_000, 2_000]
    assert chunked["_fit"]["flush_per_rank"] == "torch.chunk per view, timed alone"
    stored = H.derive([str(p) for p in STORED])["0.19.8"]
    assert stored["_fit"]["flush_timed"] == "in the step"
    assert {k: v for k, v in derived.items() if not k.startswith(("reduce_", "_"))} == \
        {k: v for k, v in stored.items() if not k.startswith(("reduce_", "_"))}


def test_the_knobs_constants_are_the_stored_measurements_derived():
    derived = H.derive([str(p) for p in STORED])
    assert set(derived) == {"0.5.10", "0.6.0", "0.19.8"} and set(HOST_COSTS) == set(derived) | {"0.5.4"}
    # 0.5.4: 0.5.10's figures, its gather and release scaled by the two releases' ratio
    # timed side by side (traces/host-costs/pr1188/)
    pair = sorted((ROOT / "traces" / "host-costs" / "pr1188").glob("deepspeed-*-world*.json"))
    assert len(pair) == 4
    before = H.derive_before_pr1188(derived["0.5.10"], [str(p) for p in pair])
    for name, value in before.items():
        if name not in ("launch_ns", "collective_launch_ns"):
            assert getattr(HOST_COSTS["0.5.4"], name) == value, name
    assert before["gather_param_ns"] > 1.4 * derived["0.5.10"]["gather_param_ns"] and before["gather_param_rank_ns"] > 0
    assert {k for k in before if before[k] != derived["0.5.10"][k]} == set(H.PR1188_CHANGED)
    # the hook plumbing, timed later on another machine, scaled per release to the stored runs'
    runs = [json.loads(p.read_text()) for p in sorted((ROOT / "traces" / "host-costs" / "plumbing").glob("*.json"))]
    plumbing = H.derive_plumbing([json.loads(p.read_text()) for p in STORED], runs)
    assert set(plumbing) == set(derived)
    for version, value in plumbing.items():
        assert HOST_COSTS[version].hook_plumbing_ns == value > 0, version
    assert HOST_COSTS["0.5.4"].hook_plumbing_ns == HOST_COSTS["0.5.10"].hook_plumbing_ns  # the same hooks
    for version, fields in derived.items():
        assert fields["_fit"]["worlds"] == [8, 64]
        for name, value in fields.items():
            # launches: the same PyTorch in all three runs, so their mean (within noise)
            if name.startswith("_") or name in ("launch_ns", "collective_launch_ns"):
                continue
            assert getattr(HOST_COSTS[version], name) == value, (version, name)
    assert HOST_COSTS["0.19.8"] == HostCosts()
    means = [sum(derived[v][k] for v in derived) / 3 for k in ("launch_ns", "collective_launch_ns")]
    assert abs(HostCosts().launch_ns - means[0]) <= 100 and abs(HostCosts().collective_launch_ns - means[1]) <= 300


def test_stored_measurements_saw_the_hooks_commsims_trace_has():
    """Real DeepSpeed fired one fetch hook per position of commsim's hook trace and one
    gradient hook per parameter, in every release; a few more releases in commsim's
    trace (DeepSpeed skips the post-backward hook of a module whose inputs need no
    gradient)."""
    md = describe(H.model_config(), 2, 16)
    trace = module_trace(md, True)
    for path in STORED:
        calls = json.loads(path.read_text())["calls"]
        assert len(calls["fetch"]) == sum(e.fetch for e in trace), path.name
        assert len(calls["grad_hook"]) == len(md.registered_params()), path.name
        assert 0 < sum(e.release for e in trace) - len(calls["release"]) <= 8, path.name


def test_installed_deepspeed_is_timed_routine_by_routine(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "c.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "runtime.ds_host_costs", "--deepspeed", "0.19.8", "--world", "8",
                          "--steps", "2", "--flush-repeats", "1", "-o", str(out)], capture_output=True, text=True,
                         env=env, cwd=ROOT,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["world"] == 8 and doc["deepspeed"] == "0.19.8"
    fits = doc["fits"]
    assert {"fetch", "release", "grad_hook", "flush"} <= set(fits)
    # every hook costs something, and a fetch that gathers costs more than one that does not
    assert fits["fetch"]["fixed_ns"] > 0 and fits["grad_hook"]["fixed_ns"] > 0
    assert fits["fetch"]["total_counts"]["gathered"] > 0
    assert doc["primitives"]["torch_op_ns"] > 0 and doc["primitives"]["chunk_view_ns"] > 0
    # the flush alone at every count, dearer with more gradients
    sweep = doc["calls"]["flush_sweep"]
    assert [c["grad"] for _, c in sweep] == list(H.FLUSH_COUNTS)
    assert sweep[-1][0] > sweep[0][0] > 0 and fits["flush_sweep"]["per_grad_ns"] > 0
    # the hook plumbing: the window held every module hook of the step (350 fetches and
    # 344 releases: test_stored_measurements_saw_the_hooks_commsims_trace_has) but the
    # root module's fetch, which runs before its forward, and more time than its routines
    # and the plain model's step together
    hooks = doc["plumbing"]
    assert hooks["hook_calls"] == 349 + 344 and hooks["wrapped_calls"] > hooks["hook_calls"]
    assert hooks["untimed_ns"] > hooks["plain_ns"] > 0 and hooks["per_hook_call_ns"] > 0


def test_deepspeeds_host_costs_join_the_calibrations_own():
    """calibrate --deepspeed-host-costs adds DeepSpeed's routines to the profile's host
    costs: the calibration's launches stay, DeepSpeed's figures win where both have one,
    and both sources are named once."""
    from runtime.calibrate_ds import merge_host_costs

    mine = {"launch_ns": 2600, "collective_launch_ns": 0, "source": "launches timed"}
    ds = {"module_hook_ns": 30000, "launch_ns": 9999, "source": "DeepSpeed timed"}
    assert merge_host_costs(mine, ds) == {"launch_ns": 9999, "collective_launch_ns": 0, "module_hook_ns": 30000,
                                          "source": "launches timed; DeepSpeed timed"}
    assert merge_host_costs(None, ds) == ds and merge_host_costs(ds, ds)["source"] == "DeepSpeed timed"


def test_without_torchs_fake_backend_the_world_is_one_gloo_rank_answering_the_seeds_size():
    # torch 1.x (the seed era's software, timed for comparison: traces/README.md) has no
    # fake backend; hidden here, fake_world takes a one-rank gloo group whose queries
    # answer rank 0 of the given world, and the c10d primitive times a real call on it
    code = """
import sys
sys.modules["torch.testing._internal.distributed.fake_pg"] = None
import torch, torch.distributed as dist
from runtime.ds_host_setup import fake_world
from runtime.ds_host_timing import primitives
fake_world(64)
assert dist.get_backend() == "gloo" and dist.get_world_size() == 64 and dist.get_rank() == 0
p = primitives(torch, 64)
assert p["c10d_all_gather_ns"] > 0 and p["torch_op_ns"] > 0, p
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
