"""A framework's Python on a CPU rank after its collectives ran: priced cold
(``cache.python_cold_factor``), and only there."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from commsim.api import Scenario, predict

ROOT = Path(__file__).resolve().parent.parent.parent
PYTHON_KINDS = ("host_module_hook", "host_grad_hook", "host_python")


def _profile(tmp_path: Path, factor: float | None) -> str:
    doc = json.loads((ROOT / "traces" / "local-cpu" / "small_z2.profile.json").read_text())
    doc["cache"] = {"bytes": 32 << 20, "bytes_per_s": 6e10, **({"python_cold_factor": factor} if factor else {})}
    path = tmp_path / f"p{factor}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _host_ops(sc: Scenario) -> dict[tuple[int, str], int]:
    trace = predict(sc).trace()
    return {(r.op_id, r.kind): r.duration_ns for r in trace.records
            if r.rank == 0 and r.stream == "host" and r.kind in PYTHON_KINDS}


def test_hooks_after_a_collective_cost_the_factor_more_and_no_others_change(tmp_path):
    sc = Scenario(model="tiny", nodes=1, gpus_per_node=2, seq=16, preset="current", runner="framework",
                  ds_config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
    warm = _host_ops(replace(sc, hw_profile=_profile(tmp_path, None)))
    cold = _host_ops(replace(sc, hw_profile=_profile(tmp_path, 2.0)))
    assert warm.keys() == cold.keys() and warm
    ratios = {k: cold[k] / warm[k] for k in warm if warm[k]}
    # every Python op is either as timed or twice it (integer ns), and both kinds occur:
    # the hooks right after a gather or a flush, and those between collectives' quiet spells
    assert all(r == pytest.approx(1.0) or r == pytest.approx(2.0, abs=1e-3) for r in ratios.values())
    doubled = sum(r > 1.5 for r in ratios.values())
    assert 0 < doubled < len(ratios)


def test_the_executors_host_ops_are_not_touched(tmp_path):
    sc = Scenario(model="tiny", nodes=1, gpus_per_node=2, seq=16, preset="current", runner="executor",
                  ds_config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
    a = predict(replace(sc, hw_profile=_profile(tmp_path, None))).metrics.step_time_s
    b = predict(replace(sc, hw_profile=_profile(tmp_path, 2.0))).metrics.step_time_s
    assert a == b
