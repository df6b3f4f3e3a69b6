"""A framework's memory-bound kernels priced by class, direction and dtype from a
profile's ``framework_kernels`` table, for a framework's run only."""

import pytest

from commsim.hardware.framework_kernels import framework_kernels_from_dict
from commsim.hardware.profile_doc import profile_from_dict
from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from tests.hardware.test_costs import PROFILE

TABLE = {
    "fp32": {"norm": {"fwd": [[1000, 1e-6], [11000, 11e-6]], "bwd": [[1000, 2e-6], [11000, 32e-6]]},
             "dropout": {"fwd": [[1000, 5e-6], [3000, 45e-6]]}},
    "bf16": {"norm": {"fwd": [[1000, 3e-6], [11000, 43e-6]]}},
    "source": "test",
}


def op(kind, phase, nbytes):
    return O.Compute(O.OpId(1), "c", "k", kind, 0, nbytes // 2, nbytes - nbytes // 2, phase=phase)


def test_each_op_takes_its_class_direction_and_dtype():
    fk = framework_kernels_from_dict(TABLE, "p.json")
    norm = O.ComputeKind.NORM
    # fp32 forward: the line through the points, less the smallest size's time (the call's fixed part)
    assert fk.kernel_s(op(norm, O.Phase.FORWARD, 6000), "fp32") == pytest.approx(6e-6 - 1e-6)
    # recompute runs the forward kernel; backward the backward one
    assert fk.kernel_s(op(norm, O.Phase.RECOMPUTE, 6000), "fp32") == pytest.approx(5e-6)
    assert fk.kernel_s(op(norm, O.Phase.BACKWARD, 6000), "fp32") == pytest.approx(17e-6 - 2e-6)
    # a bf16 step's activations in bf16 (fp16 runs alike); beyond the sizes, the last segment's slope
    assert fk.kernel_s(op(norm, O.Phase.FORWARD, 6000), "bf16") == pytest.approx(23e-6 - 3e-6)
    assert fk.kernel_s(op(norm, O.Phase.FORWARD, 21000), "fp16") == pytest.approx(83e-6 - 3e-6)
    # the optimizer's ops work on fp32 master copies in any precision
    assert fk.kernel_s(op(norm, O.Phase.OPTIMIZER, 6000), "bf16") == pytest.approx(5e-6)
    # not measured: no class, no direction, no dtype
    assert fk.kernel_s(op(O.ComputeKind.SOFTMAX, O.Phase.FORWARD, 6000), "fp32") is None
    assert fk.kernel_s(op(O.ComputeKind.DROPOUT, O.Phase.BACKWARD, 6000), "fp32") is None
    assert fk.kernel_s(op(norm, O.Phase.BACKWARD, 6000), "bf16") is None
    assert fk.source == "test"


def test_only_a_frameworks_run_is_priced_from_the_table():
    p = profile_from_dict({**PROFILE, "framework_kernels": TABLE}, "p.json", "fp32")
    drop = op(O.ComputeKind.DROPOUT, O.Phase.FORWARD, 2000)
    executor = p.compute_ns(drop)
    assert executor == 1000 + int(2000 / 2e9 * 1e9)  # the stand-in's rate per byte and its fixed cost
    framework = p.run_by_framework()
    # CPU (inline) kernels: the framework's launch op carries the fixed cost
    assert framework.compute_ns(drop) == int((25e-6 - 5e-6) * 1e9)
    gemm = O.Compute(O.OpId(1), "c", "", O.ComputeKind.GEMM, 10**9, 0, 0)
    assert framework.compute_ns(gemm) == int(1e9 / 1e10 * 1e9)  # GEMMs as before
    # a profile loaded for bf16 prices the activations' kernels in bf16
    p16 = profile_from_dict({**PROFILE, "framework_kernels": TABLE}, "p.json", "bf16").run_by_framework()
    assert p16.compute_ns(op(O.ComputeKind.NORM, O.Phase.FORWARD, 6000)) == int(20e-6 * 1e9)


@pytest.mark.parametrize("table, names", [
    ([], "must be an object"),
    ({"fp64": {}}, "'fp64' must be fp32 or bf16"),
    ({"fp32": {"gemm": {}}}, "kind 'gemm' must be one of"),
    ({"fp32": {"norm": {"up": [[1, 1], [2, 2]]}}}, "fp32.norm.up: must be fwd or bwd"),
    ({"fp32": {"norm": {"fwd": [[1, 1]]}}}, "at least two"),
    ({"fp32": {"norm": {"fwd": [[1, 1], [2, 0]]}}}, "both > 0"),
    ({"fp32": {"norm": {"fwd": [[1, 1], [1, 2]]}}}, "two points of the same size"),
])
def test_a_bad_table_is_named(table, names):
    with pytest.raises(CommsimInputError, match="p.json: field 'framework_kernels'.*" + names.replace(".", r"\.")):
        profile_from_dict({**PROFILE, "framework_kernels": table}, "p.json")


def test_predict_says_a_frameworks_kernels_priced_its_run(tmp_path):
    import json

    from commsim.api import Scenario, predict
    from commsim.ir.schedule import Program, Schedule
    from commsim.ir.serialize import save_schedule

    path = tmp_path / "p.json"
    path.write_text(json.dumps({**PROFILE, "framework_kernels": TABLE}))
    step = (op(O.ComputeKind.NORM, O.Phase.FORWARD, 6000),)
    sched = tmp_path / "s.json"
    save_schedule(Schedule.uniform(2, Program((), step)), sched)
    sc = Scenario(schedule=str(sched), nodes=1, gpus_per_node=2, hw_profile=str(path), mode="symmetric")
    fw, ex = predict(sc), predict(sc.with_(runner="executor"))
    # a schedule that states no precision is a bf16 step (predict's default)
    line = "a framework's memory-bound kernels by class (bf16)"
    assert any(line in s for s in fw.sources) and not any(line in s for s in ex.sources)
    assert fw.metrics.step_time_s * 1e9 == pytest.approx(20e-6 * 1e9, abs=2)  # the bf16 NORM fwd at 6000 B
