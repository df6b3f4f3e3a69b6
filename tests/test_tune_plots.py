"""commsim tune (a DeepSpeed config that beats the defaults and that DeepSpeed loads),
and the plots of predictions and sweeps."""

import json
import subprocess
import sys

import pandas as pd
import pytest

from commsim.api import Scenario, predict
from commsim.report import plots
from commsim.report.metrics import STALL_CAUSES
from commsim.tune import _candidates, ds_config_for, tune


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "commsim.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def test_tune_beats_deepspeed_defaults_on_the_seed_scenario_and_deepspeed_loads_it(tmp_path):
    out = tmp_path / "ds.json"
    res = run("tune", "--net", "efa", "--search", "stage3_param_persistence_threshold,stage3_max_live_parameters",
              "--json", "-o", str(out))
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    cfg = json.loads(out.read_text())
    assert cfg == report["ds_config"]
    assert report["best"]["tokens_per_s"] > report["base"]["tokens_per_s"]
    assert report["changes"] and all(c["tokens_per_s_after"] > c["tokens_per_s_before"] for c in report["changes"])
    # the written config predicts what the report says (no hidden settings)
    again = predict(Scenario(net="efa", ds_config=str(out))).metrics
    assert again.tokens_per_s == pytest.approx(report["best"]["tokens_per_s"], rel=1e-9)
    defaults = predict(Scenario(net="efa")).metrics
    assert again.tokens_per_s > defaults.tokens_per_s
    # DeepSpeed's own schema accepts every key and type
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    loaded = ds_config.DeepSpeedConfig(cfg)
    assert loaded.zero_config.stage == 3
    assert loaded.zero_config.param_persistence_threshold == cfg["zero_optimization"]["stage3_param_persistence_threshold"]


def test_tune_keeps_defaults_where_nothing_gains_and_explains(tmp_path):
    # roberta-large on 2 nodes: every searched change is explained with its gain
    r = tune(Scenario(model="roberta-large", nodes=2), ["reduce_bucket_size", "checkpointing"], jobs=2)
    text = r.explain()
    assert r.best.tokens_per_s >= r.base.tokens_per_s
    for d, old, new, before, after in r.steps:
        assert after.tokens_per_s > before.tokens_per_s * 1.005
        assert f"{d}: " in text
    if not r.best.settings["checkpointing"]:
        assert "activation checkpointing is a model setting" in text
    assert "checkpointing" not in json.dumps(r.ds_config)


def test_tune_candidates_and_config_writing():
    start = {"zero_hpz_partition_size": 1, "train_micro_batch_size_per_gpu": 16, "reduce_bucket_size": 123}
    assert _candidates("zero_hpz_partition_size", start, 8, 4) == [1, 8]
    assert _candidates("zero_hpz_partition_size", start, 8, 1) == [1]
    assert _candidates("train_micro_batch_size_per_gpu", start, 8, 4) == [8, 16, 32]
    assert 123 in _candidates("reduce_bucket_size", start, 8, 4)
    cfg = ds_config_for({"zero_optimization": {"stage": 2}}, {"reduce_bucket_size": 5, "stage3_max_live_parameters": 7,
                                                              "train_micro_batch_size_per_gpu": 4,
                                                              "zero_hpz_partition_size": 1, "checkpointing": True}, 2)
    assert cfg == {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5}, "train_micro_batch_size_per_gpu": 4}


def test_tune_errors():
    res = run("tune", "--model", "tiny", "--seq", "16", "--nodes", "1", "--search", "colour")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("commsim: error: --search colour:")
    res = run("tune", "--model", "tiny", "--seq", "16", "--nodes", "1", "--stage", "2",
              "--search", "stage3_max_live_parameters")
    assert res.returncode == 2 and "applies to ZeRO stage 3 only" in res.stderr


SWEEP = pd.DataFrame({
    "nodes": [1, 2, 4, 1, 2, 4], "preset": ["baseline"] * 3 + ["optimized"] * 3,
    "step_time_s": [1.0, 1.2, 1.5, 0.9, 0.95, 1.0], "model_tflops_per_gpu": [100, 83, 66, 111, 105, 100],
    **{f"stall_{c}_s": [0.01 * i for i in range(6)] for c in STALL_CAUSES},
    "oom": [""] * 6, "error": [""] * 5 + ["bad point"],
})


def test_scaling_plot_draws_one_line_per_group_without_failed_points():
    fig = plots.scaling(SWEEP.fillna(""), hue="preset")
    lines = fig.axes[0].get_lines()
    assert [len(line.get_xdata()) for line in lines] == [3, 2]  # the errored point is left out
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["baseline", "optimized"]


def test_stall_bars_split_each_step_into_compute_and_causes():
    fig = plots.stall_bars(SWEEP, label=["nodes", "preset"])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1 baseline", "2 baseline", "4 baseline", "1 optimized",
                                                            "2 optimized"]
    # each bar's segments end at its step time
    for i, step in enumerate(SWEEP["step_time_s"][:5]):
        right = max(p.get_x() + p.get_width() for p in ax.patches if abs(p.get_y() + p.get_height() / 2 - i) < 1e-9)
        assert right == pytest.approx(step)


def test_memory_and_timeline_plots_of_a_prediction(tmp_path):
    pred = predict(Scenario(model="tiny", nodes=1, gpus_per_node=2, micro_batch=2, seq=16))
    fig = plots.memory(pred.result, hbm_bytes=pred.hbm_bytes)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels[:2] == ["allocated", "reserved"] and "device memory" in labels
    plots.save_png(fig, tmp_path / "m.png")
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    fig = plots.timeline(pred.result)
    assert "stall: all_gather" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_plot_cli(tmp_path):
    csv = tmp_path / "s.csv"
    SWEEP.to_csv(csv, index=False)
    res = run("plot", "scaling", str(csv), "--hue", "preset", "-o", str(tmp_path / "s.png"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    res = run("plot", "stalls", str(csv), "--label", "nodes,colour", "-o", str(tmp_path / "t.png"))
    assert res.returncode == 2 and "--label colour: not a column of" in res.stderr
    assert not (tmp_path / "t.png").exists()
