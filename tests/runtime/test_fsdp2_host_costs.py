"""FSDP2's host time per hook call (runtime/fsdp2_host_costs.py): the arithmetic, a real
run on torch's fake process group, the default derived from the stored runs, and the
generator charging it at every hook."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from commsim.api import describe_model
from commsim.ir import ops as O
from commsim.strategies import World, generate_fsdp2
from commsim.strategies.fsdp2_config import parse_fsdp_config
from commsim.strategies.knobs import HostCosts
from runtime.fsdp2_host_costs import derive, hook_figure

ROOT = Path(__file__).resolve().parents[2]
STORED = ROOT / "traces" / "host-costs"


def test_the_figure_takes_out_what_the_schedule_prices_itself():
    extra = {"aten.view.default": 200, "fsdp.all_gather_copy_in.default": 13, "fsdp.split_with_sizes_copy.default": 13,
             "fsdp.chunk_cat.default": 7, "aten.empty.memory_format": 27, "c10d._allgather_base_.default": 13,
             "c10d._reduce_scatter_base_.default": 7}
    got = hook_figure([9_000_000, 8_000_000], [3_500_000, 3_000_000], extra, 2_000.0, 4_000.0, 7)
    # (8.0 ms - 3.0 ms - 60 priced ops x 2 us - 20 collectives x 4 us) / 29 hook calls
    assert got == {"per_hook_call_ns": 165_517, "hook_calls": 29, "priced_ops": 60, "collective_calls": 20}
    assert hook_figure([1], [2], {}, 0.0, 0.0, 1)["per_hook_call_ns"] == 0  # never negative


def test_real_fsdp2_runs_the_hooks_and_copies_the_schedule_has(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "run.json"
    res = subprocess.run([sys.executable, "-m", "runtime.fsdp2_host_costs", "--steps", "2", "-o", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(out.read_text())
    ops = doc["extra_ops"]
    # 6 layers and the root: 7 gathers in forward, 6 again in backward (the root keeps its
    # parameters), one reduce-scatter per unit, as fsdp2.py lowers them
    assert doc["units"] == 7 and doc["hook_calls"] == 29
    assert ops["fsdp.all_gather_copy_in.default"] == ops["fsdp.split_with_sizes_copy.default"] == 13
    assert ops["c10d._allgather_base_.default"] == 13
    assert ops["fsdp.chunk_cat.default"] == ops["c10d._reduce_scatter_base_.default"] == 7
    assert doc["collective_calls"] == 20 and doc["priced_ops"] == 33 + ops.get("aten.empty.memory_format", 0)
    assert len(doc["sharded_steps_ns"]) == len(doc["plain_steps_ns"]) == 2
    assert doc["per_hook_call_ns"] > 0 and doc["sharded_ns"] > doc["plain_ns"]
    # a DTensor op's dispatch over a plain op's, timed in the same process: microseconds
    assert 1_000 < doc["dtensor_op_ns"] < 1_000_000
    res = subprocess.run([sys.executable, "-m", "runtime.fsdp2_host_costs", "--world", "1", "-o", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and "--world: at least 2" in res.stderr


def _ds_run(world: int, scale: float) -> dict:
    calls = {"fetch": [[int(1000 * scale), {"param": 1}]], "release": [[int(3000 * scale), {"param": 1}]]}
    return {"deepspeed": "0.19.8", "world": world, "calls": calls, "primitives": {"op_ns": 1}}


def test_derive_scales_by_the_machines_ratio_on_deepspeeds_routines(tmp_path):
    stored = tmp_path / "stored"
    stored.mkdir()
    for w in (8, 64):
        (stored / f"deepspeed-0.19.8-world{w}.json").write_text(json.dumps(_ds_run(w, 1.5)))
    paths = []
    # three processes' fastest FSDP2 and plain steps, dispatch and call costs (ns), the
    # same model (100 priced ops, 10 collective calls, 29 hook calls a step)
    for i, (sharded, plain, op, coll, w) in enumerate([(1_000_000, 500_000, 10, 100, 8), (900_000, 520_000, 12, 110, 64),
                                                       (950_000, 480_000, 20, 90, 8)]):
        paths.append(tmp_path / f"f{i}.json")
        paths[-1].write_text(json.dumps({"per_hook_call_ns": 0, "sharded_ns": sharded, "plain_ns": plain, "op_ns": op,
                                         "collective_ns": coll, "units": 7, "hook_calls": 29, "priced_ops": 100,
                                         "collective_calls": 10}))
        paths.append(tmp_path / f"d{i}.json")
        paths[-1].write_text(json.dumps(_ds_run(w, 1.0)))
    got = derive(str(stored), [str(p) for p in paths])
    # the fastest FSDP2 step less the fastest plain one, less 100 ops at the median 12 ns
    # and 10 calls at 100 ns, over 29 hook calls: 14,407 ns; the stored machine 1.5x slower
    assert got == {"fsdp2_hook_ns": 21_600, "fsdp2_measured_ns": 14_407, "machine_ratio_x1000": 1500}


def test_the_default_is_the_stored_fsdp2_runs_derived():
    runs = sorted(str(p) for p in (STORED / "fsdp2").glob("*.json"))
    assert any("fsdp2-" in p for p in runs) and any("deepspeed-0.19.8" in p for p in runs)
    assert derive(str(STORED), runs)["fsdp2_hook_ns"] == HostCosts().fsdp2_hook_ns


def test_every_fsdp2_hook_is_charged_the_fsdp2_figure():
    from commsim.strategies.fsdp2_layout import FSDP2Layout

    md = describe_model("tiny", 2, 16, 4)
    blocks = len(FSDP2Layout.build(md, 2, parse_fsdp_config({})).blocks)
    costs = HostCosts(fsdp2_hook_ns=123_456, module_hook_ns=1)
    for ckpt in (False, True):
        s = generate_fsdp2(md, World(1, 2), parse_fsdp_config({}), checkpointing=ckpt, costs=costs)
        hooks = [op for op in s.program_of(0).step if isinstance(op, O.HostWork) and op.kind is O.HostKind.MODULE_HOOK]
        units = 1 + blocks
        # four a unit and the root's final callback (as the measurement divides); reentrant
        # recompute adds a pre/post forward for each layer
        assert len(hooks) == 4 * units + 1 + (2 * blocks if ckpt else 0)
        assert {op.duration_ns for op in hooks} == {123_456}


@pytest.mark.parametrize("fw", ["fsdp1", "fsdp2"])
def test_calibrate_puts_the_fsdp_hook_figure_in_the_profile(fw, tmp_path, monkeypatch):
    import importlib

    import runtime.launch as L

    F = importlib.import_module(f"runtime.{fw}_host_costs")

    def fake_local(nproc, backend, out, quick=False, shapes=()):
        Path(out).write_text(json.dumps({"host_costs": {"launch_ns": 2600, "source": "launches timed"}}))

    monkeypatch.setattr(L, "calibrate_local", fake_local)
    monkeypatch.setattr(F, "measure_for_profile",
                        lambda log: {f"{fw}_hook_ns": 190_000, "source": f"{fw.upper()} timed"})
    out = tmp_path / "p.json"
    L.calibrate(str(out), **{f"{fw}_host_costs": True})
    assert json.loads(out.read_text())["host_costs"] == {"launch_ns": 2600, f"{fw}_hook_ns": 190_000,
                                                         "source": f"launches timed; {fw.upper()} timed"}


def test_calibrate_under_a_launcher_refuses_to_time_fsdp2(tmp_path, monkeypatch):
    import runtime.launch as L
    from commsim.ir.errors import CommsimInputError

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CommsimInputError, match=r"^--fsdp2-host-costs: run it without torchrun"):
        L.calibrate(str(tmp_path / "p.json"), fsdp2_host_costs=True)


def test_the_profiles_dtensor_op_is_the_processes_median(monkeypatch):
    pytest.importorskip("torch")
    import runtime.fsdp2_host_costs as F

    shape = {"units": 7, "hook_calls": 29, "priced_ops": 0, "collective_calls": 0, "op_ns": 0, "collective_ns": 0}
    docs = [{**shape, "sharded_ns": s, "plain_ns": 1_000_000, "dtensor_op_ns": d}
            for s, d in ((3_900_000, 21_000), (4_000_000, 17_000), (4_100_000, 30_000))]
    monkeypatch.setattr(F, "measure_processes", lambda processes, log: docs)
    got = F.measure_for_profile(3, log=lambda m: None)
    # the hooks: the fastest FSDP2 step less the fastest plain one, over 29 calls
    assert got["fsdp2_hook_ns"] == round(2_900_000 / 29) and got["dtensor_op_ns"] == 21_000
    assert "runtime/dtensor_dispatch.py: the processes' median" in got["source"]
