"""FSDP1's host time per hook call (runtime/fsdp1_host_costs.py): a real run on torch's
fake process group doing what fsdp1.py lowers, the default derived from the stored runs,
the generator charging it at every hook, and calibrate putting it in a profile."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from commsim.api import describe_model
from commsim.ir import ops as O
from commsim.strategies import World, generate_fsdp1
from commsim.strategies.fsdp1_config import parse_fsdp1_config
from commsim.strategies.knobs import HostCosts
from runtime.fsdp2_host_costs import derive

ROOT = Path(__file__).resolve().parents[2]
STORED = ROOT / "traces" / "host-costs"


def test_real_fsdp1_runs_the_collectives_and_kernels_its_schedule_has(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "run.json"
    res = subprocess.run([sys.executable, "-m", "runtime.fsdp1_host_costs", "--steps", "2", "-o", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(out.read_text())
    ops = doc["extra_ops"]
    # 6 layers and the root: 7 gathers in forward, 6 in backward (the root is not
    # resharded after forward), a reduce-scatter a unit, each flat gradient concatenated
    # from its views' and pre-divided by 2 (2 ranks: no post-divide) into a new shard;
    # no pad (the units' sizes are even), no casts (no mixed precision)
    assert doc["framework"] == "fsdp1" and doc["units"] == 7 and doc["hook_calls"] == 29
    gathers = sum(v for k, v in ops.items() if k.startswith("c10d.") and "allgather" in k)
    assert gathers == 13 and ops["c10d._reduce_scatter_base_.default"] == 7
    assert ops["aten.cat.default"] == ops["aten.div_.Tensor"] == ops["aten.empty_like.default"] == 7
    assert "aten.constant_pad_nd.default" not in ops and "aten._to_copy.default" not in ops
    assert doc["collective_calls"] == 20 and doc["priced_ops"] == 21
    md = describe_model("tiny", 2, 16, 4)
    s = generate_fsdp1(md, World(1, 2), parse_fsdp1_config({}), checkpointing=False)
    step = s.program_of(0).step
    assert sum(isinstance(op, O.Collective) for op in step) == 2 * 3 - 1 + 3  # the same shape on tiny's 3 units
    assert doc["per_hook_call_ns"] > 0 and doc["sharded_ns"] > doc["plain_ns"]
    res = subprocess.run([sys.executable, "-m", "runtime.fsdp1_host_costs", "--world", "1", "-o", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and "--world: at least 2" in res.stderr


def test_the_default_is_the_stored_fsdp1_runs_derived():
    runs = sorted(str(p) for p in (STORED / "fsdp1").glob("*.json"))
    assert any("fsdp1-" in p for p in runs) and any("deepspeed-0.19.8" in p for p in runs)
    got = derive(str(STORED), runs)
    assert set(got) == {"fsdp1_hook_ns", "fsdp1_measured_ns", "machine_ratio_x1000"}
    assert got["fsdp1_hook_ns"] == HostCosts().fsdp1_hook_ns


@pytest.mark.parametrize("ckpt", [False, True])
def test_every_fsdp1_hook_is_charged_the_fsdp1_figure(ckpt):
    md = describe_model("tiny", 2, 16, 4)
    costs = HostCosts(fsdp1_hook_ns=123_456, module_hook_ns=1, hook_plumbing_ns=1)
    s = generate_fsdp1(md, World(1, 2), parse_fsdp1_config({}), checkpointing=ckpt, costs=costs)
    hooks = [op for op in s.program_of(0).step if isinstance(op, O.HostWork) and op.kind is O.HostKind.MODULE_HOOK]
    blocks = 2
    # four a unit (the root's pre-forward is its root pre-forward) and the final
    # callback, as the measurement divides; reentrant recompute adds each block's
    # pre- and post-forward
    assert len(hooks) == 4 * (blocks + 1) + 1 + (2 * blocks if ckpt else 0)
    assert {op.duration_ns for op in hooks} == {123_456}
