"""The Adam step by implementation: DeepSpeed's fused Adam with an optimizer section,
PyTorch's AdamW passes (and temporaries) with a client optimizer."""

from math import ceil

import pytest

from commsim.ir import ops as O
from commsim.ir.validate import validate
from commsim.models import MODEL_PRESETS, describe
from commsim.strategies import World, generate
from commsim.strategies.dsconfig import parse_ds_config
from commsim.strategies.knobs import Knobs

MD = describe(MODEL_PRESETS["tiny"], 2, 16)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_adam_traffic_by_implementation(stage):
    n = sum(ceil(p.numel / 2) for p in MD.registered_params()) if stage == 3 else \
        ceil(sum(p.numel for p in MD.registered_params()) / 2)
    for optimizer, read, written, ops in (({"type": "AdamW"}, 16, 12, 1), (None, 48, 32, 8)):
        cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
        if optimizer:
            cfg["optimizer"] = optimizer
        ds = parse_ds_config(cfg)
        assert ds.optimizer_impl == ("fused" if optimizer else "torch")
        s = generate(MD, World(1, 2), ds, Knobs())
        assert validate(s) == []
        step = s.programs[0].step
        adam = [op for op in step if isinstance(op, O.Compute) and op.label.startswith("optimizer.adam")]
        assert len(adam) == ops
        assert sum(op.bytes_read for op in adam) == read * n and sum(op.bytes_written for op in adam) == written * n
        temps = [op for op in step if isinstance(op, O.Alloc) and "torch AdamW temporary" in op.label]
        assert [op.size_bytes for op in temps] == ([] if optimizer else [4 * n, 4 * n])
        assert s.meta.setting("optimizer") == ds.optimizer_impl


def test_optimizer_section_errors_and_warnings():
    from commsim.ir.errors import CommsimInputError

    with pytest.raises(CommsimInputError, match=r"ds_config: optimizer: must be an object with a \"type\""):
        parse_ds_config({"optimizer": "adam"})
    assert parse_ds_config({"optimizer": {"type": "Lamb"}}).warnings == (
        "ds_config: optimizer.type: 'Lamb' is modelled with Adam's memory traffic",)


def test_single_tensor_adamw_states_what_each_pass_reuses():
    """One parameter's eight passes run back to back (_single_tensor_adam): each states
    the bytes an earlier pass over the same parameter touched, within the parameter's
    four arrays and two temporaries; foreach's passes state none."""
    from commsim.strategies.builder import ProgramBuilder
    from commsim.strategies.optimizer import torch_adamw

    k = 1000
    b = ProgramBuilder()
    torch_adamw(b, "compute", "opt", [("w", k), ("b", 10)], ("p", "g", "m", "v"), launch_ns=100, foreach=False,
                dtensor_op_ns=50)
    ops = [op for op in b.step if isinstance(op, O.Compute)]
    assert len(ops) == 16 and all(op.label.startswith("opt:w.") for op in ops[:8])
    w = ops[:8]
    assert [op.label.rsplit(".", 1)[1] for op in w] == [
        "weight_decay", "exp_avg_lerp", "exp_avg_sq_mul", "exp_avg_sq_addcmul", "denom_sqrt", "denom_div",
        "denom_add_eps", "param_addcdiv"]
    assert [op.bytes_read + op.bytes_written for op in w] == [8 * k, 12 * k, 8 * k, 12 * k, 8 * k, 8 * k, 8 * k, 16 * k]
    assert [op.reuse_bytes for op in w] == [0, 0, 0, 12 * k, 4 * k, 4 * k, 8 * k, 16 * k]
    assert {op.working_set_bytes for op in w} == {24 * k}
    # every pass writes over an array it read but the two into fresh temporaries
    assert [op.in_place_bytes for op in w] == [4 * k, 4 * k, 4 * k, 4 * k, 0, 0, 4 * k, 4 * k]
    assert [op.reuse_bytes for op in ops[8:]] == [0, 0, 0, 120, 40, 40, 80, 160]
    launches = [op.duration_ns for op in b.step if isinstance(op, O.HostWork)]
    assert launches == [150] * 16  # each op a DTensor's
    flat = ProgramBuilder()
    torch_adamw(flat, "compute", "opt", [("w", k), ("b", 10)], ("p", "g", "m", "v"), launch_ns=100, foreach=True,
                dtensor_op_ns=50)
    fops = [op for op in flat.step if isinstance(op, O.Compute)]
    assert len(fops) == 8 and {(op.reuse_bytes, op.working_set_bytes) for op in fops} == {(0, 0)}
    assert fops[0].bytes_read == 4 * (k + 10)
    assert [op.duration_ns for op in flat.step if isinstance(op, O.HostWork)] == [100] * 8
