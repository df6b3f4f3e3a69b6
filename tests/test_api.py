"""The Python API: scenarios and their defaults."""

from commsim.api import Scenario, build_schedule, default_ds_config
from commsim.sweep import scenario_for

TINY = Scenario(model="tiny", nodes=1, gpus_per_node=2, micro_batch=2, seq=16)


def test_stage_0_without_a_config_is_stage_0():
    assert default_ds_config(0)["zero_optimization"]["stage"] == 0  # was 3: `stage or 3`
    assert default_ds_config(None)["zero_optimization"]["stage"] == 3
    assert build_schedule(TINY.with_(stage=0))[0].meta.strategy == "zero0"
    assert build_schedule(TINY)[0].meta.strategy == "zero3"
    assert scenario_for(TINY, {"stage": 0, "ds.reduce_bucket_size": 1000}).ds_config["zero_optimization"]["stage"] == 0
