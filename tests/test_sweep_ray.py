"""commsim sweep --backend ray: batches of points as Ray tasks give the local pool's table
(every value but each point's own wall time), resume by point_id, run from the command
line on a running Ray instance; a sweep starts a Ray instance or joins one as told and
leaves it as it found it; without Ray, or with nothing at the address, one line.

One Ray instance (2 CPUs, started in this process) serves every test that needs one:
starting Ray costs 5-15 s on this machine.
"""

import logging
import os
import subprocess
import sys

import pandas as pd
import pytest

from commsim.api import Scenario
from commsim.sweep import METRICS, parse_grid, sweep
from commsim.sweep.ray_backend import batch_count, make_batches

BASE = Scenario(model="tiny", nodes=1, gpus_per_node=2, micro_batch=2, seq=16)
AXES = ["stage=2,3", "nodes=1,2", "micro_batch=1,2"]  # 8 points, 8 different predictions
SCENARIO_FLAGS = ["--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "16"]
GRID_FLAGS = [a for axis in AXES for a in ("--grid", axis)]


def table(path) -> pd.DataFrame:
    """The CSV as text, rows by point_id: what must match between backends."""
    return pd.read_csv(path, dtype=str, keep_default_na=False).sort_values("point_id").reset_index(drop=True)


def assert_same_table(got, want) -> None:
    assert list(got.columns) == list(want.columns)
    assert len(got) == len(want) == 8
    assert (got["error"] == "").all()
    assert (got["wall_s"].astype(float) > 0).all()
    pd.testing.assert_frame_equal(got.drop(columns="wall_s"), want.drop(columns="wall_s"))


@pytest.fixture(scope="module")
def local_table(tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "local.csv"
    sweep(BASE, parse_grid(AXES), jobs=2, output=out)
    df = table(out)
    assert len(df[list(METRICS)].drop_duplicates()) == 8  # the comparisons see eight different rows
    return df


@pytest.fixture(scope="module")
def ray_head():
    import ray

    # Under the suite's load (the other worker's multi-process tests on two cores) Ray's
    # metrics agent has taken over 15 s to start; the raylet then gave up on it (its
    # RAY_raylet_start_wait_time_s, 15 s) and ray.init failed "timed out during startup"
    # after 30 s. The raylet waits as long as ray.init does, and a failed start is tried
    # once more: starting Ray is not what these tests check.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_raylet_start_wait_time_s", os.environ.get("RAY_raylet_start_wait_time_s", "30"))
        for attempt in (1, 2):
            try:
                ctx = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
                break
            except Exception:
                ray.shutdown()
                if attempt == 2:
                    raise
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


def test_batches_are_about_four_per_cpu_and_at_most_64_points():
    assert batch_count(200, 2) == 8
    assert batch_count(5, 2) == 5  # never an empty batch
    assert batch_count(10_000, 2) == 157  # ceil(10000 / 64)
    assert batch_count(1000, 64) == 256
    assert batch_count(0, 2) == 0
    assert make_batches(list(range(10)), 4) == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]


def test_ray_gives_the_local_table_and_resumes(tmp_path, ray_head, local_table):
    import ray

    out = tmp_path / "ray.csv"
    seen = []
    df = sweep(BASE, parse_grid(AXES[:2] + ["micro_batch=1"]), output=out, backend="ray",
               progress=lambda d, t: seen.append((d, t)))
    # 0 twice: before connecting to Ray, and once the batches are submitted (the bar's clock restarts)
    assert len(df) == 4 and seen == [(0, 4), (0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    seen.clear()
    sweep(BASE, parse_grid(AXES), output=out, backend="ray", progress=lambda d, t: seen.append((d, t)))
    assert seen[0] == (0, 4)  # only the four new points ran
    assert_same_table(table(out), local_table)
    assert ray.is_initialized()  # the caller's instance is left running


def test_cli_on_a_running_ray_instance(tmp_path, ray_head, local_table):
    out = tmp_path / "s.csv"
    res = subprocess.run([sys.executable, "-m", "commsim.cli", "sweep", *SCENARIO_FLAGS, *GRID_FLAGS,
                          "--backend", "ray", "--address", ray_head, "-o", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"{out}: 8 rows (0 with errors)\n"
    lines = res.stderr.replace("\r", "\n").split("\n")
    # no Ray log lines: commsim's own and the progress bar's only
    assert [x for x in lines if x.strip() and not x.startswith("sweep")] == []
    assert lines[0] == f"sweep: 8 points over stage, nodes, micro_batch on ray -> {out}" and "8/8 points" in res.stderr
    assert_same_table(table(out), local_table)


@pytest.mark.parametrize("address, env, init_kwargs", [
    (None, None, {"address": "local", "num_cpus": 3, "include_dashboard": False}),  # a new instance of --jobs CPUs
    ("HEAD", None, {"address": "HEAD"}),
    ("auto", "HEAD", {"address": "auto"}),  # Ray reads RAY_ADDRESS
    (None, "HEAD", {"address": None}),
])
def test_which_ray_a_sweep_starts_or_joins_and_leaves(monkeypatch, ray_head, address, env, init_kwargs):
    # ray.init / ray.shutdown recorded, not run: the module's instance does the work (a
    # second instance would cost another 5-15 s); the bench starts and stops a real one
    import ray

    calls = []
    answers = iter([False])  # not connected, to the sweep's question; connected, to Ray's own ones later
    monkeypatch.setattr(ray, "is_initialized", lambda: next(answers, True))
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("shutdown", {})))
    if env:
        monkeypatch.setenv("RAY_ADDRESS", ray_head)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    address = ray_head if address == "HEAD" else address
    df = sweep(BASE, parse_grid(["stage=2,3"]), jobs=3, backend="ray", address=address)
    assert len(df) == 2 and (df["error"] == "").all()
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False, "runtime_env": None}
    want = {k: ray_head if v == "HEAD" else v for k, v in init_kwargs.items()}
    assert calls == [("init", {**want, **quiet}), ("shutdown", {})]


def test_a_sweep_leaves_the_callers_ray_instance_running(monkeypatch, ray_head):
    import ray

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append("init"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    sweep(BASE, parse_grid(["stage=2"]), backend="ray", address="auto")
    assert calls == []


def test_an_unreachable_address_is_one_line(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "commsim.cli", "sweep", *SCENARIO_FLAGS, "--grid", "stage=2,3",
                              "--backend", "ray", "--address", f"127.0.0.1:{port}", "--quiet",
                              "-o", str(tmp_path / "s.csv")], capture_output=True, text=True)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines()[-1] == (f"commsim: error: --backend ray: cannot reach Ray (--address 127.0.0.1:{port}): "
                                           "[Errno 111] Connection refused")


def test_without_ray_one_line_names_the_extra(tmp_path):
    code = ("import sys\n"
            "sys.modules['ray'] = None  # as without Ray installed: `import ray` fails\n"
            "from commsim.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    res = subprocess.run([sys.executable, "-c", code, "sweep", *SCENARIO_FLAGS, "--grid", "stage=2,3",
                          "--backend", "ray", "-o", str(tmp_path / "s.csv")], capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stdout == ""
    assert res.stderr == "commsim: error: --backend ray: Ray is not installed; pip install 'commsim[ray]'\n"
    assert not (tmp_path / "s.csv").exists()
