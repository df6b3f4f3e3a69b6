"""commsim tune (a DeepSpeed config that beats the defaults and that DeepSpeed loads),
and the plots of predictions and sweeps."""

import json
import subprocess
import sys

import pandas as pd
import pytest
from matplotlib.colors import to_rgba

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
    assert [t.get_text() for t in ax.get_yticklabels()] == ["nodes=1 preset=baseline", "nodes=2 preset=baseline",
                                                            "nodes=4 preset=baseline", "nodes=1 preset=optimized",
                                                            "nodes=2 preset=optimized"]
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
    assert "stall: all_gather" in [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_stall_colours_are_their_own():
    """A stall strip must not look like an op running: every stall cause's colour is far
    from every op kind's colour, and from every other cause's."""
    from matplotlib.colors import to_rgb

    def far(a, b):
        return sum((x - y) ** 2 for x, y in zip(to_rgb(a), to_rgb(b))) ** 0.5 > 0.2

    stall = [plots.STALL_COLOURS[c] for c in STALL_CAUSES]
    assert all(far(s, op) for s in stall for op in plots.COLOURS.values())
    assert all(far(a, b) for i, a in enumerate(stall) for b in stall[i + 1:])


def test_timeline_legends_clear_the_axis_label():
    pred = predict(Scenario(model="tiny", nodes=1, gpus_per_node=2, micro_batch=2, seq=16))
    fig = plots.timeline(pred.result)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    label = fig.axes[0].xaxis.label.get_window_extent(renderer)
    ticks = fig.axes[0].xaxis.get_tightbbox(renderer)
    page = fig.bbox
    assert len(fig.legends) == 2
    for legend in fig.legends:
        box = legend.get_window_extent(renderer)
        assert not box.overlaps(label) and not box.overlaps(ticks)  # the legend covered "time (s)"
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
    a, b = (legend.get_window_extent(renderer) for legend in fig.legends)
    assert not a.overlaps(b)


def test_stall_bars_table_gives_every_value_its_column():
    fig = plots.stall_bars(SWEEP, label="nodes")
    table = fig.axes[1]
    texts = [t.get_text() for t in table.texts]
    causes = [c for c in STALL_CAUSES]  # every cause is non-zero from the second row on
    header = ["step", "compute", *(c.replace("_", "\n", 1) for c in causes)]
    assert texts[-len(header):] == header
    first = texts[:len(header)]  # row 0: step 1.0, no stalls
    assert first == ["1.000", "1.000"] + ["-"] * len(causes)
    second = texts[len(header):2 * len(header)]
    assert second == ["1.200", f"{1.2 - 0.01 * len(causes):.3f}"] + ["0.010"] * len(causes)
    assert [p.get_facecolor() for p in table.patches] == [
        tuple(to_rgba(plots.STALL_COLOURS[c])) for c in ("compute", *causes)]


def test_plot_cli(tmp_path):
    csv = tmp_path / "s.csv"
    SWEEP.to_csv(csv, index=False)
    res = run("plot", "scaling", str(csv), "--hue", "preset", "-o", str(tmp_path / "s.png"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    res = run("plot", "stalls", str(csv), "--label", "nodes,colour", "-o", str(tmp_path / "t.png"))
    assert res.returncode == 2 and "--label colour: not a column of" in res.stderr
    assert not (tmp_path / "t.png").exists()


def test_tune_searches_fsdp2_settings_and_writes_an_fsdp2_config(tmp_path):
    from commsim.strategies.fsdp2_config import parse_fsdp_config

    base = Scenario(model="roberta-large", nodes=2, strategy="fsdp2", micro_batch=8, seq=256)
    r = tune(base, ["reshard_after_forward", "hsdp_replicas"], jobs=2, max_rounds=1)
    cfg = parse_fsdp_config(r.config)  # loads as FSDP2 settings
    assert set(r.config) == {"mp_param_dtype", "mp_reduce_dtype", "reshard_after_forward", "forward_prefetch",
                             "backward_prefetch", "hsdp_replicas"}
    assert cfg.mp_param_dtype == "bf16" and r.strategy == "fsdp2"
    # reshard true / false / to a node (8 of the 16), HSDP off / over the 2 nodes
    assert r.evaluations == 4 and r.to_json()["fsdp_config"] == r.config
    for d, old, new, before, after in r.steps:
        assert after.tokens_per_s > before.tokens_per_s * 1.005 and f"{d}: " in r.explain()
    out = tmp_path / "fsdp.tuned.json"
    res = run("tune", "--strategy", "fsdp2", "--model", "tiny", "--seq", "16", "--nodes", "2", "--micro-batch", "2",
              "--search", "forward_prefetch", "--rounds", "1", "--quiet", "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert parse_fsdp_config(json.loads(out.read_text())).forward_prefetch in (0, 1, 2)
    res = run("tune", "--strategy", "fsdp2", "--model", "tiny", "--nodes", "1", "--search", "reduce_bucket_size")
    assert res.returncode == 2 and "--search reduce_bucket_size: allowed with --strategy fsdp2: reshard_after_forward" \
        in res.stderr
