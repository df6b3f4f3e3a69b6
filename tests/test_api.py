"""The Python API: scenarios and their defaults."""

import re

import pytest

from commsim.api import Scenario, build_schedule, default_ds_config, predict
from commsim.ir.errors import CommsimInputError
from commsim.sweep import scenario_for

TINY = Scenario(model="tiny", nodes=1, gpus_per_node=2, micro_batch=2, seq=16)


def test_stage_0_without_a_config_is_stage_0():
    assert default_ds_config(0)["zero_optimization"]["stage"] == 0  # was 3: `stage or 3`
    assert default_ds_config(None)["zero_optimization"]["stage"] == 3
    assert build_schedule(TINY.with_(stage=0))[0].meta.strategy == "zero0"
    assert build_schedule(TINY)[0].meta.strategy == "zero3"
    assert scenario_for(TINY, {"stage": 0, "ds.reduce_bucket_size": 1000}).ds_config["zero_optimization"]["stage"] == 0


def test_fsdp2_scenarios_predict_with_the_seed_settings_by_default():
    sc = Scenario(model="roberta-large", nodes=2, strategy="fsdp2", micro_batch=4, seq=128)
    p = predict(sc)
    m = p.schedule.meta
    assert (m.strategy, m.precision, m.setting("mp_reduce_dtype"), m.setting("reshard_after_forward")) == \
        ("fsdp2", "bf16", "fp32", True)
    assert p.scenario["strategy"] == "fsdp2" and p.scenario["stage"] is None
    assert "FSDP2" in p.title and p.metrics.step_time_s > 0
    fp32 = build_schedule(sc.with_(fsdp_config={}))[0]  # FSDP2's own defaults
    assert fp32.meta.precision == "fp32"
    hsdp = build_schedule(sc.with_(fsdp_config={"hsdp_replicas": 2}))[0]
    assert hsdp.meta.rank_symmetric and len(hsdp.programs) == 16


@pytest.mark.parametrize("strategy", ["deepspeed", "fsdp2"])
def test_default_configs_train_in_fp16_on_a_gpu_without_bf16_tensor_cores(strategy):
    sc = Scenario(model="tiny", cluster="p3dn", nodes=1, micro_batch=2, seq=16, strategy=strategy)
    assert build_schedule(sc)[3] == "fp16"  # V100: bf16 only emulated (G4)
    assert build_schedule(sc.with_(cluster="p4d"))[3] == "bf16"
    predict(sc)
    assert sc.warnings == []
    from commsim.sweep.grid import base_ds_config, base_fsdp_config  # a sweep's and tune's starting config
    assert "fp16" in base_ds_config(sc) and base_fsdp_config(sc)["mp_param_dtype"] == "fp16"


def test_an_explicit_bf16_config_on_a_v100_cluster_is_warned_about():
    bf16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    sc = Scenario(model="tiny", cluster="p3dn", nodes=1, micro_batch=2, seq=16, ds_config=bf16)
    predict(sc)
    assert sc.warnings == ["the DeepSpeed config trains in bf16, which V100-SXM2-32GB has no tensor cores for: its "
                           "matmuls are priced at 10 TFLOPS (emulated); training on it runs in fp16"]
    on_a100 = sc.with_(cluster="p4d", warnings=[])
    predict(on_a100)
    assert on_a100.warnings == []


@pytest.mark.parametrize("changes,message", [
    ({"strategy": "fsdp2", "ds_config": {"zero_optimization": {"stage": 3}}},
     "--ds-config: DeepSpeed settings; --strategy fsdp2 takes its settings from --fsdp-config"),
    ({"strategy": "fsdp2", "stage": 2, "preset": "baseline"}, "--stage, --preset: DeepSpeed settings"),
    ({"fsdp_config": {}}, "--fsdp-config: FSDP settings; give --strategy fsdp2 or fsdp1 with it"),
    ({"strategy": "ddp"}, "--strategy 'ddp': allowed: deepspeed, fsdp2"),
    ({"strategy": "fsdp2", "fsdp_config": {"hsdp_replicas": 3}}, "hsdp_replicas: 3 must divide the world size 16"),
])
def test_fsdp2_settings_and_deepspeed_settings_do_not_mix(changes, message):
    with pytest.raises(CommsimInputError, match=re.escape(message)):
        build_schedule(Scenario(model="roberta-large", nodes=2).with_(**changes))


@pytest.mark.parametrize("strategy", ["deepspeed", "fsdp2"])
def test_a_frameworks_own_run_on_a_cpu_profile_waits_for_its_blocking_collectives(strategy):
    """On a gloo profile the framework's run (runner "framework") waits on the host for
    each async_op=False collective; commsim's executor replays the schedule as a GPU runs
    it (runner "executor"), and on a GPU cluster nothing waits."""
    from pathlib import Path

    from commsim.ir import ops as O

    prof = str(Path(__file__).resolve().parents[1] / "traces" / "local-cpu" / "small_z2.profile.json")
    base = Scenario(model="tiny", nodes=1, gpus_per_node=2, strategy=strategy, micro_batch=2, seq=16,
                    **({"ds_config": {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}}
                       if strategy == "deepspeed" else {}))

    def waits(sc):
        return sum(isinstance(op, O.HostSync) and op.label.endswith("async_op=False, waited on the host")
                   for op in build_schedule(sc)[0].programs[0].step)

    assert waits(base.with_(hw_profile=prof)) > 0
    assert waits(base.with_(hw_profile=prof, runner="executor")) == 0 == waits(base)


def test_a_prediction_whose_allocator_flushes_simulates_every_rank(monkeypatch, capsys):
    """roberta-10b at micro-batch 22 on one p4d node flushes the caching allocator: the
    symmetric run (every rank flushing at once) is replaced by a per-rank one, where each
    rank's flush holds up the collectives it joins, and the prediction says so; above the
    rank limit the symmetric run stays, with a line that says what it understates."""
    import commsim.api as api

    sc = Scenario(model="roberta-10b", nodes=1, micro_batch=22)
    sym = predict(sc.with_(mode="symmetric"))
    assert sym.metrics.alloc_flushes > 0 and not sym.metrics.oom
    pred = predict(sc)
    assert pred.metrics.mode == "per-rank" and len(pred.result.ranks) == 8
    note = [s for s in pred.sources if s.startswith("mode: per-rank because")]
    assert note == [f"mode: per-rank because the caching allocator flushed {sym.metrics.alloc_flushes} time(s) in the "
                    "symmetric run: a flush on one rank stalls every collective it joins (symmetric step "
                    f"{sym.metrics.step_time_s:.3f} s)"]
    assert "simulating each of the 8 ranks" in capsys.readouterr().err
    assert pred.metrics.step_time_s >= sym.metrics.step_time_s

    monkeypatch.setattr(api, "PER_RANK_AFTER_FLUSH_MAX_RANKS", 4)
    capped = predict(sc)
    assert capped.metrics.mode == "symmetric" and capped.metrics.step_time_s == sym.metrics.step_time_s
    assert any("8 ranks are too many to simulate one by one" in s for s in capped.sources)
    # asked for explicitly, a mode is kept
    assert predict(sc.with_(mode="symmetric")).sources == sym.sources


def test_an_unknown_checkpoint_style_is_refused_before_generating():
    with pytest.raises(CommsimInputError, match=r"^--checkpoint-style 'non-reentrant': allowed: reentrant, non_reentrant$"):
        predict(Scenario(model="tiny", strategy="fsdp1", checkpoint_style="non-reentrant"))


def test_the_report_says_when_the_caching_allocator_had_not_settled():
    from commsim.cli.predict_cmd import report_lines

    pred = predict(Scenario(net="efa"))  # 0.19.8's pool still grows after the last warm-up step
    lines = report_lines(pred, 0)
    at = next(i for i, line in enumerate(lines) if line.startswith("memory "))
    grown = pred.metrics.new_segment_bytes
    assert grown == pred.result.ranks[0].new_segment_bytes > 0
    assert lines[at + 1] == (f"  (not settled: after 2 warm-up steps the measured step still cudaMalloc'd "
                             f"{grown / 1e9:.1f} GB of new segments; the pool may grow further, up to a cache flush)")
