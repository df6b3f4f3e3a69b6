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
