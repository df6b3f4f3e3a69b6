"""commsim sweep: a grid predicted in parallel into a tidy, resumable table."""

import io
import subprocess
import sys

import pandas as pd
import pytest

from commsim.api import Scenario
from commsim.ir.errors import CommsimInputError
from commsim.sweep import parse_grid, scenario_for, sweep, text_progress
from commsim.sweep.table import append_row

BASE = Scenario(model="tiny", nodes=1, gpus_per_node=2, micro_batch=2, seq=16)


def test_grid_parsing_and_scenarios():
    grid = parse_grid(["stage=2,3", "net=efa,ib", "knob.coalesced_collectives=false", "ds.reduce_bucket_size=1000"])
    assert grid == {"stage": [2, 3], "net": ["efa", "ib"], "knob.coalesced_collectives": [False],
                    "ds.reduce_bucket_size": [1000]}
    sc = scenario_for(BASE, {"stage": 2, "ds.reduce_bucket_size": 1000, "knob.coalesced_collectives": False})
    assert sc.ds_config == {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
                            "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}
    assert sc.knobs == ("coalesced_collectives=False",)
    with pytest.raises(CommsimInputError, match="colour is not a predict setting"):
        parse_grid(["colour=red"])
    # the host's speed is a float axis, whole numbers included
    assert parse_grid(["host_scale=1,1.5,2"]) == {"host_scale": [1.0, 1.5, 2.0]}
    assert all(type(v) is float for v in parse_grid(["host_scale=1,2"])["host_scale"])


def test_sweep_is_resumable(tmp_path):
    out = tmp_path / "s.csv"
    seen = []
    df = sweep(BASE, parse_grid(["stage=2,3", "net=efa"]), jobs=2, output=out, progress=lambda d, t: seen.append(t))
    assert len(df) == 2 and seen[0] == 2
    assert set(df["stage"]) == {2, 3} and (df["step_time_s"] > 0).all()
    seen.clear()
    df = sweep(BASE, parse_grid(["stage=2,3", "net=efa,ib"]), jobs=2, output=out, progress=lambda d, t: seen.append(t))
    assert seen[0] == 2  # only the two new points ran
    assert len(df) == 4 and sorted(df["net"]) == ["efa", "efa", "ib", "ib"]


def test_sweep_cli(tmp_path):
    out = tmp_path / "s.csv"
    res = subprocess.run([sys.executable, "-m", "commsim.cli", "sweep", "--model", "tiny", "--nodes", "1",
                          "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "16", "--grid", "stage=2,3",
                          "--grid", "preset=baseline,optimized", "-o", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"{out}: 4 rows (0 with errors)"
    assert "sweep [" in res.stderr and "4/4 points" in res.stderr


def test_sweep_cli_fails_when_a_point_fails(tmp_path):
    out = tmp_path / "s.csv"
    args = [sys.executable, "-m", "commsim.cli", "sweep", "--model", "tiny", "--nodes", "2", "--micro-batch", "2",
            "--seq", "16", "--grid", "net=efa,infiniband", "--quiet", "-o", str(out)]
    res = subprocess.run(args, capture_output=True, text=True)
    assert res.returncode == 1  # was 0
    assert res.stdout == f"{out}: 2 rows (1 with errors)\n"
    assert res.stderr.splitlines()[-1] == f"commsim: 1 of 2 points failed; the error column of {out} says why"
    rows = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert sorted(rows["net"]) == ["efa", "infiniband"]  # the good point is written too
    assert rows.set_index("net").loc["infiniband", "error"].startswith("--net 'infiniband': allowed:")
    res = subprocess.run(args, capture_output=True, text=True)  # resumed: the failed point is still failed
    assert res.returncode == 1 and "1 of 2 points failed" in res.stderr


def test_fsdp2_settings_are_grid_axes():
    base = BASE.with_(strategy="fsdp2")
    grid = parse_grid(["fsdp.reshard_after_forward=true,false,2", "fsdp.mp_reduce_dtype=null,fp32"])
    assert grid == {"fsdp.reshard_after_forward": [True, False, 2], "fsdp.mp_reduce_dtype": [None, "fp32"]}
    sc = scenario_for(base, {"fsdp.reshard_after_forward": False, "fsdp.mp_reduce_dtype": None})
    # on top of the seed scenario's FSDP2 settings
    assert sc.fsdp_config == {"mp_param_dtype": "bf16", "mp_reduce_dtype": None, "reshard_after_forward": False}
    df = sweep(base, parse_grid(["fsdp.reshard_after_forward=true,false"]), jobs=1)
    assert len(df) == 2 and (df["error"] == "").all()
    keep, reshard = (df[df["fsdp.reshard_after_forward"] == v].iloc[0] for v in (False, True))
    assert keep["comm_time_s"] < reshard["comm_time_s"]  # no all-gathers in backward


def test_a_wider_row_rewrites_the_table_as_text(tmp_path):
    out = tmp_path / "s.csv"
    header = append_row(out, {"point_id": "0123", "stage": 2, "error": "bad"}, None)
    header = append_row(out, {"point_id": "4567", "stage": 3, "error": "", "step_time_s": 0.5}, header)
    assert header == ["point_id", "stage", "error", "step_time_s"]
    # the first id stays text (a numeric read would have written 123)
    assert out.read_text() == "point_id,stage,error,step_time_s\n0123,2,bad,\n4567,3,,0.5\n"


def test_ray_flags_need_the_ray_backend(tmp_path, capsys):
    from commsim.cli import main

    args = ["sweep", "--model", "tiny", "--grid", "stage=2,3", "-o", str(tmp_path / "s.csv")]
    assert main(args + ["--address", "auto"]) == 2
    assert capsys.readouterr().err == "commsim: error: --address / --ray-runtime-env: only with --backend ray\n"
    assert main(args + ["--backend", "ray", "--ray-runtime-env", "[1]"]) == 2
    assert capsys.readouterr().err == "commsim: error: --ray-runtime-env: a JSON object, e.g. '{\"pip\": [\"commsim\"]}'\n"
    assert not (tmp_path / "s.csv").exists()


def test_the_progress_clock_starts_at_the_last_zero():
    stream, times = io.StringIO(), iter([0.0, 10.0, 10.0, 12.0, 13.0])
    show = text_progress(stream, clock=lambda: next(times))
    show(0, 4)  # say a backend's start-up takes 10 s: the clock restarts
    show(1, 4)
    show(4, 4)
    assert stream.getvalue().split("\r")[1:] == [
        "sweep [------------------------------] 0/4 points, 0 s elapsed, ~0 s left ",
        "sweep [#######-----------------------] 1/4 points, 2 s elapsed, ~6 s left ",
        "sweep [##############################] 4/4 points, 3 s elapsed, ~0 s left \n"]
