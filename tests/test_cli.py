"""The CLI as a user runs it: exit codes, one-line errors, outputs."""

import json
import re
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from commsim.ir.serialize import save_schedule
from commsim.strategies.fsdp1_config import parse_fsdp1_config


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "commsim.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_validate_accepts_and_rejects_swapped_collectives(tmp_path, tiny_schedule):
    good = tmp_path / "good.json"
    save_schedule(tiny_schedule, good)
    out = run("validate", str(good))
    assert out.returncode == 0
    assert out.stdout.strip() == f"{good}: valid: 2 ranks, 1 distinct program(s), 6 step ops in all"

    ag = O.Collective(O.OpId(1), "allgather", "ag", O.CollectiveKind.ALL_GATHER, 64, O.DType.BF16, (0, 1))
    ar = O.Collective(O.OpId(2), "allgather", "ar", O.CollectiveKind.ALL_REDUCE, 8, O.DType.FP32, (0, 1),
                      reduce_op=O.ReduceOp.SUM)
    bad = tmp_path / "bad.json"
    save_schedule(Schedule.from_rank_programs(
        [Program((), (ag, ar)), Program((), (replace(ar, id=O.OpId(1)), replace(ag, id=O.OpId(2))))]), bad)
    out = run("validate", str(bad))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"{bad}: rank 1, step op 0: collective order: collective #0 of group (0,1)")
    assert "kind=all_reduce" in lines[0]


def test_validate_text_form_and_show(tmp_path, tiny_schedule):
    path = tmp_path / "s.json"
    save_schedule(tiny_schedule, path)
    out = run("show", str(path), "-o", str(tmp_path / "s.txt"))
    assert out.returncode == 0
    assert run("validate", str(tmp_path / "s.txt")).returncode == 0


def test_bad_files_exit_2_with_one_line(tmp_path):
    missing = tmp_path / "nope.json"
    out = run("validate", str(missing))
    assert (out.returncode, out.stderr) == (2, f"commsim: error: {missing}: cannot read: No such file or directory\n")
    garbage = tmp_path / "g.json"
    garbage.write_text('{"schema_version": 7}')
    out = run("validate", str(garbage))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "unsupported schema version 7" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_flag_is_one_line_with_one_prefix():
    out = run("models", "tiny", "--micro-batch", "0")
    assert out.returncode == 2
    assert out.stderr == ("commsim: error: argument --micro-batch: expected a positive integer, "
                          "got 0 (see 'commsim models --help')\n")
    out = run("frobnicate")
    assert out.returncode == 2
    assert out.stderr.startswith("commsim: error: argument COMMAND: invalid choice: 'frobnicate'")
    assert out.stderr.count("commsim") == 2 and out.stderr.endswith("(see 'commsim --help')\n")
    out = run("predict", "--nodes", "1", "--cluster", "p4d", "--stage", "3", "--grid")  # a flag predict lacks
    assert (out.returncode, out.stderr) == (2, "commsim: error: unrecognized arguments: --grid (see 'commsim --help')\n")


def test_input_errors_have_one_prefix(tmp_path):
    out = run("sweep", "--model", "tiny", "-o", str(tmp_path / "s.csv"))
    assert (out.returncode, out.stderr) == (2, "commsim: error: --grid: give at least one axis, NAME=V1,V2,...\n")
    out = run("tune", "--model", "tiny", "--seq", "16", "--nodes", "1", "--stage", "0", "-o", str(tmp_path / "t.json"))
    assert (out.returncode, out.stderr) == (2, "commsim: error: ZeRO stage 0 has nothing to tune; use stage 1, 2 "
                                               "or 3\n")


def test_models_json():
    out = run("models", "roberta-base", "--json", "--micro-batch", "2", "--seq", "128")
    assert out.returncode == 0
    info = json.loads(out.stdout)
    assert info["params"]["total"] == 124_697_433
    assert info["micro_batch"] == 2 and info["seq_len"] == 128


def test_help_lists_subcommands():
    out = run("--help")
    assert out.returncode == 0
    for sub in ("validate", "show", "models", "predict"):
        assert sub in out.stdout


def test_schedule_writes_a_valid_file_and_summary(tmp_path):
    out_file = tmp_path / "s.json"
    out = run("schedule", "--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--micro-batch", "2",
              "--seq", "16", "-o", str(out_file), "--summary")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "DeepSpeed ZeRO-3 step of tiny on 1x2 GPUs"
    assert run("validate", str(out_file)).returncode == 0


def test_schedule_bad_ds_config_key(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"stage": 3, "reduce_bucket": 5}}')
    out = run("schedule", "--model", "tiny", "--ds-config", str(cfg), "-o", str(tmp_path / "s.json"))
    assert out.returncode == 2
    assert out.stderr == (f"commsim: error: {cfg}: zero_optimization.reduce_bucket: unknown key (DeepSpeed rejects "
                          "it too); see deepspeed/runtime/zero/config.py\n")
    assert not (tmp_path / "s.json").exists()


def test_schedule_and_predict_fsdp2(tmp_path):
    cfg = tmp_path / "fsdp.json"
    cfg.write_text('{"reshard_after_forward": false, "hsdp_replicas": 2}')
    out_file = tmp_path / "s.json"
    out = run("schedule", "--strategy", "fsdp2", "--fsdp-config", str(cfg), "--model", "tiny", "--nodes", "2",
              "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "16", "-o", str(out_file), "--summary")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "PyTorch FSDP2 step of tiny on 2x2 GPUs (HSDP 2 x 2)"
    assert run("validate", str(out_file)).returncode == 0
    res = predict_json("--strategy", "fsdp2", "--fsdp-config", str(cfg), "--model", "tiny", "--nodes", "2", "--seq",
                       "16")
    assert (res["scenario"]["strategy"], res["scenario"]["stage"]) == ("fsdp2", None) and res["step_time_s"] > 0


def test_bad_fsdp_config_is_one_line(tmp_path):
    cfg = tmp_path / "fsdp.json"
    cfg.write_text('{"reshard_after_forward": "yes"}')
    out = run("schedule", "--strategy", "fsdp2", "--fsdp-config", str(cfg), "--model", "tiny", "-o",
              str(tmp_path / "s.json"))
    assert out.returncode == 2
    assert out.stderr == (f"commsim: error: {cfg}: reshard_after_forward: must be true, false or a group size >= 1, "
                          "got 'yes'\n")
    out = run("schedule", "--strategy", "fsdp2", "--stage", "3", "--model", "tiny")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--stage: DeepSpeed settings" in out.stderr


PREDICT_KEYS = {"step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "compute_busy_frac",
                "comm_time_s", "exposed_comm_s", "overlap_frac", "stalls_s", "peak_allocated_bytes",
                "peak_reserved_bytes", "alloc_retries", "cost_usd_per_step", "mode"}


def predict_json(*args):
    out = run("predict", "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_predict_default_scenario_efa_vs_ib_and_baseline_vs_optimized():
    efa = predict_json("--net", "efa")
    ib = predict_json("--net", "ib")
    base = predict_json("--net", "efa", "--preset", "baseline")
    assert PREDICT_KEYS <= set(efa)
    assert efa["mode"] == "symmetric"
    assert efa["step_time_s"] > ib["step_time_s"]
    assert base["step_time_s"] > efa["step_time_s"]
    assert efa["exposed_comm_s"] > ib["exposed_comm_s"]
    idle = efa["step_time_s"] * (1 - efa["compute_busy_frac"])
    assert abs(sum(efa["stalls_s"].values()) - idle) < 1e-6 * efa["step_time_s"] + 1e-6
    # 0.5.10's pool settles after the first warm-up step; 0.19.8's still grows at the cap
    assert (base["warmup_steps"], base["allocator_settled"]) == (2, True)
    assert (efa["warmup_steps"], efa["allocator_settled"]) == (2, False)


def test_predict_writes_trace_and_plot(tmp_path):
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    out = run("predict", "--model", "tiny", "--nodes", "2", "--micro-batch", "2", "--seq", "16",
              "--trace", str(trace), "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert "step time" in out.stdout and "mode: symmetric" in out.stdout
    from commsim.ir.trace import Trace
    df = Trace.load(trace).to_dataframe()
    # (tiny's parameters all persist, and their re-gather after the step runs on the
    # default stream, as DeepSpeed's _allgather_params_coalesced does: no all-gather stream)
    assert {"compute", "reduce", "host"} <= set(df["stream"]) and "all_gather" in set(df["kind"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_predict_schedule_file_must_match_cluster(tmp_path):
    s = tmp_path / "s.json"
    assert run("schedule", "--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--micro-batch", "2",
               "--seq", "16", "-o", str(s)).returncode == 0
    out = run("predict", "--schedule", str(s))
    assert out.returncode == 2
    assert "has 2 ranks but the cluster has 64 GPUs" in out.stderr
    ok = predict_json("--schedule", str(s), "--nodes", "1", "--gpus-per-node", "2", "--mode", "per-rank")
    assert ok["mode"] == "per-rank" and ok["step_time_s"] > 0


def test_predict_hand_made_schedule_without_model(tmp_path, tiny_schedule):
    """A hand-written schedule names no model, so it has no tokens: the step is still
    predicted, the cost per token is absent (null in JSON, said in words), not a crash."""
    s = tmp_path / "s.json"
    save_schedule(Schedule.uniform(2, tiny_schedule.programs[0]), s)  # no ScheduleMeta: no model
    res = predict_json("--schedule", str(s), "--nodes", "1", "--gpus-per-node", "2")
    assert res["step_time_s"] > 0 and res["tokens_per_s"] == 0.0
    assert res["cost_usd_per_million_tokens"] is None and res["cost_usd_per_step"] > 0
    out = run("predict", "--schedule", str(s), "--nodes", "1", "--gpus-per-node", "2")
    assert out.returncode == 0, out.stderr
    assert "per step, no tokens (the schedule names no model)" in out.stdout


def test_predict_with_a_measured_profile(tmp_path):
    from tests.hardware.test_costs import PROFILE

    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({**PROFILE, "collectives": {
        k: {"intra_node": {"2": {"latency_ns": 200000, "bytes_per_s": 1e9}}}
        for k in ("all_gather", "reduce_scatter", "all_reduce")}}))
    res = predict_json("--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "16",
                       "--hw-profile", str(prof))
    assert res["step_time_s"] > 0 and res["mode"] == "symmetric"
    # a framework's run on CPUs says what glibc's heap hands out fresh; the executor's not
    args = ("predict", "--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "16",
            "--hw-profile", str(prof))
    assert re.search(r"^fresh host pages +fwd \d+ MiB, .*optimizer \d+ MiB a step", run(*args).stdout, re.M)
    assert "fresh host pages" not in run(*args, "--runner", "executor").stdout
    # the heap model instead of glibc's ceiling: a framework's CPU run only
    assert re.search(r"^fresh host pages +fwd \d+ MiB", run(*args, "--host-heap").stdout, re.M)
    # a VM that reports free memory (a 1 ms period: every large block's pages are old):
    # the large blocks on reported pages, by phase
    vm = tmp_path / "vm.json"
    doc = json.loads(prof.read_text())
    doc["alloc"] = {**doc["alloc"], "page_report_period_ns": 1_000_000, "reported_page_extra_ns_per_byte": 1.0}
    vm.write_text(json.dumps(doc))
    big = ("predict", "--model", "small", "--nodes", "1", "--gpus-per-node", "2", "--micro-batch", "1", "--seq", "16")
    out = run(*big, "--hw-profile", str(vm)).stdout
    assert re.search(r"^reported host pages +.*\d+ MiB a step \(rank 0; large blocks on pages the VM has reported", out,
                     re.M)
    assert "reported host pages" not in run(*big, "--hw-profile", str(prof)).stdout
    # a measured drift of two components: every rank simulated, both named
    drift = tmp_path / "drift.json"
    drift.write_text(json.dumps({**json.loads(prof.read_text()), "rank_noise": {
        "sd": 0.08, "corr_ns": 3e7, "slow_sd": 0.05, "slow_corr_ns": 8e8}}))
    out = run(*args, "--hw-profile", str(drift)).stdout
    assert re.search(r"^rank speed drift: sd 8\.0%, correlation 30 ms, and sd 5\.0%, correlation 800 ms \(profile\); ",
                     out, re.M), out
    bad = run(*args, "--runner", "executor", "--host-heap")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "--host-heap: models a framework's tensors on CPUs; it needs a CPU (gloo) --hw-profile and --runner framework")
    out = run("predict", "--hw-profile", str(tmp_path / "missing.json"))
    assert out.returncode == 2 and "missing.json: cannot read" in out.stderr


def test_a_profiles_host_costs_reach_a_schedule_file_through_schedule_hw_profile(tmp_path):
    """A profile's measured host costs price a schedule file's host ops only when the file
    was generated with that profile (commsim schedule --hw-profile); predict says which
    host costs it used and warns when a profile's measured ones cannot reach the file."""
    from tests.hardware.test_costs import PROFILE

    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({**PROFILE, "collectives": {
        k: {"intra_node": {"2": {"latency_ns": 200000, "bytes_per_s": 1e9}}}
        for k in ("all_gather", "reduce_scatter", "all_reduce")},
        "host_costs": {"source": "timed", "module_hook_ns": 500_000, "grad_hook_ns": 90_000}}))
    tiny = ["--model", "tiny", "--stage", "3", "--nodes", "1", "--gpus-per-node", "2", "--micro-batch", "2",
            "--seq", "16"]
    plain, measured = tmp_path / "plain.json", tmp_path / "measured.json"
    assert run("schedule", *tiny, "-o", str(plain)).returncode == 0
    out = run("schedule", *tiny, "--hw-profile", str(prof), "-o", str(measured))
    assert out.returncode == 0, out.stderr
    metas = [json.loads(p.read_text())["meta"]["host_costs"] for p in (plain, measured)]
    assert metas == ["DeepSpeed 0.19.8's table (commsim.strategies.knobs.HOST_COSTS)",
                     f"measured into {prof} (timed), over DeepSpeed 0.19.8's table "
                     "(commsim.strategies.knobs.HOST_COSTS)"]
    where = ["--nodes", "1", "--gpus-per-node", "2", "--hw-profile", str(prof)]
    from_file = run("predict", "--schedule", str(measured), *where)
    assert from_file.returncode == 0 and from_file.stderr == "", from_file.stderr
    assert f"host costs: from the schedule file: {metas[1]}" in from_file.stdout
    stale = run("predict", "--schedule", str(plain), *where)
    assert stale.returncode == 0
    assert stale.stderr.strip() == (
        f"commsim: warning: --hw-profile {prof}: its measured host costs do not reach --schedule {plain} (its "
        f"host ops were priced from: {metas[0]}); generate the schedule with `commsim schedule --hw-profile "
        f"{prof}` to use them")
    # the file with the measured (slower) hooks predicts the step the model path predicts
    by_model = predict_json(*tiny, "--hw-profile", str(prof))
    by_file = predict_json("--schedule", str(measured), *where)
    by_stale = predict_json("--schedule", str(plain), *where)
    assert by_file["step_time_s"] == by_model["step_time_s"] > by_stale["step_time_s"]


def test_nccl_stack_picks_the_software_stack():
    out = run("predict", *TINY, "--nodes", "2", "--net", "efa", "--nccl-stack", "2023")
    assert out.returncode == 0, out.stderr
    assert "(EFA 4x100Gb/s; NCCL 2.18.5 + aws-ofi-nccl 1.7.3)" in out.stdout.splitlines()[0]
    assert _refused(run("predict", "--nccl-stack", "2019")) == \
        "commsim: error: --nccl-stack '2019': allowed: early-2022, 2023, 2025"


def _refused(out) -> str:
    """The one line a refused command printed (exit 2, nothing on stdout)."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and out.stdout == "" and len(lines) == 1, (out.returncode, out.stdout, out.stderr)
    return lines[0]


def test_predict_refuses_what_a_profile_cannot_price(tmp_path):
    """A 2-rank gloo profile measured one CPU node: it cannot price a GPU cluster named by
    --net or --cluster, more ranks on a node than it measured, nor (unless
    --extrapolate) groups larger than, or placed unlike, those it measured."""
    stored = "traces/local-cpu/small_z2.profile.json"
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    line = _refused(run("predict", "--net", "efa", "--hw-profile", stored, cwd=root))
    assert line == (f"commsim: error: --hw-profile {stored}: a gloo profile of CPU: AMD EPYC cannot price the GPU "
                    "cluster 8x p4d (EFA 4x100Gb/s; NCCL 2.11 + aws-ofi-nccl 1.2) (--net efa); calibrate that cluster "
                    "with --backend nccl, or leave out --net / --cluster to predict the profiled machine")
    line = _refused(run("predict", "--cluster", "dgx-a100", *TINY[2:], "--hw-profile", stored, cwd=root))
    assert "cannot price the GPU cluster 1x dgx-a100 (IB 8x200Gb/s HDR; NCCL 2.11) (--cluster dgx-a100);" in line
    line = _refused(run("predict", "--hw-profile", stored, cwd=root))  # the seed scenario: 8 GPUs a node
    assert line == (f"commsim: error: --hw-profile {stored}: measured 2 rank(s) per node, the scenario puts 8 on a "
                    "node; calibrate with 8 ranks per node or set --gpus-per-node 2")

    from tests.hardware.test_costs import PROFILE

    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({**PROFILE, "world_size": 4, "ranks_per_node": 4, "collectives": {
        k: {"intra_node": {"2": {"latency_ns": 200000, "bytes_per_s": 1e9}}}
        for k in ("all_gather", "reduce_scatter", "all_reduce")}}))
    tiny4 = ["--model", "tiny", "--micro-batch", "2", "--seq", "16", "--nodes", "1", "--gpus-per-node", "4"]
    line = _refused(run("predict", *tiny4, "--hw-profile", str(prof)))
    assert line == (f"commsim: error: --hw-profile {prof}: the schedule has collectives over 4 ranks inside a node, "
                    "the profile measured groups of at most 2 inside a node; calibrate a job that large, or pass "
                    "--extrapolate to price them from the nearest measured group")
    tiny2x2 = ["--model", "tiny", "--micro-batch", "2", "--seq", "16", "--nodes", "2", "--gpus-per-node", "2"]
    line = _refused(run("predict", *tiny2x2, "--hw-profile", str(prof)))
    assert "the schedule has collectives over 4 ranks across nodes, the profile measured no group across nodes" in line
    out = run("predict", *tiny2x2, "--hw-profile", str(prof), "--extrapolate")
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == ("commsim: warning: --extrapolate: collectives over 4 ranks across nodes priced from "
                                  "the profile's nearest measured group (no group across nodes)")


def test_the_report_says_what_came_from_the_profile(tmp_path):
    from tests.hardware.test_costs import PROFILE

    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({**PROFILE, "collectives": {
        k: {"intra_node": {"2": {"latency_ns": 200000, "bytes_per_s": 1e9}}}
        for k in ("all_gather", "reduce_scatter", "all_reduce")}}))
    out = run("predict", *TINY, "--hw-profile", str(prof))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == (f"from profile {prof} (gloo, CPU: test; 2 rank(s) per node x 1 node(s)): GEMMs by size, "
                        "memory-bound kernels, copies, collectives (groups measured: 2 inside a node), "
                        "compute/communication contention, allocation costs, memory size (8.6 GB)")
    assert lines[2] == ("from cluster preset p4d: the world's shape (1 node(s) x 2 rank(s)) and the price per hour")
    # the profile measured no host costs: the release's table priced the hooks
    assert lines[3] == "host costs: DeepSpeed 0.19.8's table (commsim.strategies.knobs.HOST_COSTS)"
    res = predict_json(*TINY, "--hw-profile", str(prof))
    assert res["hardware_sources"] == lines[1:4]
    assert predict_json(*TINY)["hardware_sources"] == []  # a preset: everything from it


TINY = ["--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "16"]


def _inputs(tmp_path, tiny_schedule):
    """A schedule and a sweep table for the commands that read one."""
    from tests.test_tune_plots import SWEEP

    inp = tmp_path / "in"
    inp.mkdir()
    save_schedule(tiny_schedule, inp / "s.json")
    SWEEP.to_csv(inp / "t.csv", index=False)
    return inp


# every command that writes a file, with the flag that names it
WRITERS = [
    ("show {in}/s.json -o {out}", "-o"),
    ("schedule " + " ".join(TINY) + " -o {out}", "-o"),
    ("predict " + " ".join(TINY) + " --trace {out}", "--trace"),
    ("predict " + " ".join(TINY) + " --plot {out}", "--plot"),
    ("predict " + " ".join(TINY) + " --plot-memory {out}", "--plot-memory"),
    ("sweep " + " ".join(TINY) + " --grid stage=2,3 -o {out}", "-o"),
    ("tune " + " ".join(TINY) + " --search reduce_bucket_size -o {out}", "-o"),
    ("plot stalls {in}/t.csv -o {out}", "-o"),
    ("execute {in}/s.json -o {out}", "-o"),
    ("calibrate --quick -o {out}", "-o"),  # before this check, it failed after minutes of measuring
]


@pytest.mark.parametrize("command,flag", WRITERS, ids=[f"{c.split()[0]} {f}" for c, f in WRITERS])
def test_output_in_a_missing_folder_fails_first_with_one_line(tmp_path, tiny_schedule, capsys, command, flag):
    from commsim.cli import main

    inp = _inputs(tmp_path, tiny_schedule)
    before = sorted(p for p in tmp_path.rglob("*"))
    out = tmp_path / "missing" / "out.file"
    t = time.perf_counter()
    rc = main(command.format(**{"in": inp, "out": out}).split())
    assert time.perf_counter() - t < 5  # no work done
    assert (rc, capsys.readouterr().err) == (2, f"commsim: error: {flag} {out}: folder {out.parent} does not exist\n")
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing left behind


def test_output_that_is_a_folder_or_unwritable(tmp_path, capsys):
    from commsim.cli import main

    assert main(["predict", *TINY, "--plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"commsim: error: --plot {tmp_path}: is a folder; give a file name\n"
    assert main(["schedule", *TINY, "-o", "/sys/s.json"]) == 2  # not writable, even for root
    assert capsys.readouterr().err.startswith("commsim: error: -o /sys/s.json: folder /sys is not writable (")
    assert main(["schedule", *TINY, "-o", str(tmp_path / "s.json")]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # the writability probe left nothing


def test_record_output_folder_is_checked_first(tmp_path, capsys):
    from commsim.cli import main

    out = tmp_path / "missing" / "rec"
    assert main(["record", "-o", str(out), "--", "true"]) == 2
    assert capsys.readouterr().err == f"commsim: error: -o {out}: folder {out.parent} does not exist\n"
    (tmp_path / "file").write_text("")
    assert main(["record", "-o", str(tmp_path / "file"), "--", "true"]) == 2
    assert capsys.readouterr().err == f"commsim: error: -o {tmp_path / 'file'}: exists and is not a folder\n"


def test_predict_json_echoes_the_values_it_used(tmp_path):
    res = predict_json("--model", "tiny", "--nodes", "2", "--seq", "16")
    sc = res["scenario"]
    assert (sc["net"], sc["stage"], sc["gpus_per_node"], sc["micro_batch"]) == ("efa", 3, 8, 16)  # were all null
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}')
    sc = predict_json("--model", "tiny", "--nodes", "2", "--seq", "16", "--cluster", "dgx-a100",
                      "--ds-config", str(cfg))["scenario"]
    assert (sc["net"], sc["stage"], sc["gpus_per_node"], sc["micro_batch"]) == ("ib", 2, 8, 4)
    sc = predict_json("--model", "tiny", "--nodes", "2", "--seq", "16", "--net", "ib", "--gpus-per-node", "4",
                      "--micro-batch", "2", "--stage", "1")["scenario"]
    assert (sc["net"], sc["stage"], sc["gpus_per_node"], sc["micro_batch"]) == ("ib", 1, 4, 2)


def test_warmup_steps_sets_how_many_steps_run_before_the_measured_one():
    res = predict_json("--model", "tiny", "--nodes", "1", "--seq", "16", "--warmup-steps", "3")
    assert (res["scenario"]["warmup_steps"], res["warmup_steps"]) == (3, 3)
    assert predict_json("--model", "tiny", "--nodes", "1", "--seq", "16")["scenario"]["warmup_steps"] is None
    out = run("predict", "--model", "tiny", "--nodes", "1", "--seq", "16", "--warmup-steps", "-1")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "commsim: error: --warmup-steps -1: an integer >= 0, the steps simulated before the measured one"]


def test_more_gpus_per_node_than_the_preset_is_a_warned_what_if():
    out = run("predict", "--model", "tiny", "--nodes", "1", "--gpus-per-node", "16", "--micro-batch", "2",
              "--seq", "16")
    assert out.returncode == 0 and "= 16 GPUs" in out.stdout  # still accepted
    assert out.stderr == ("commsim: warning: --gpus-per-node 16: a p4d node has 8 GPUs; simulating 16 per node as a "
                          "what-if (its NVLink and NICs shared by all of them)\n")  # was silent
    out = run("schedule", "--model", "tiny", "--nodes", "1", "--gpus-per-node", "16", "--cluster", "p5",
              "--micro-batch", "2", "--seq", "16")
    assert out.returncode == 0 and out.stderr.startswith("commsim: warning: --gpus-per-node 16: a p5 node has 8 GPUs")
    out = run("schedule", "--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--micro-batch", "2",
              "--seq", "16")
    assert out.returncode == 0 and out.stderr == ""  # part of a node is ordinary


def test_host_jitter_reaches_the_simulation_and_is_reported():
    args = ("--model", "tiny", "--nodes", "2", "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "64",
            "--preset", "baseline")
    still, jittery = predict_json(*args), predict_json(*args, "--host-jitter", "0.5")
    assert (still["host_jitter"], jittery["host_jitter"]) == (0.0, 0.5)
    # 0.5.10 synchronises at every fetch: each later collective waits for the latest rank
    assert jittery["step_time_s"] > still["step_time_s"]
    text = run("predict", *args, "--host-jitter", "0.5")
    assert text.returncode == 0, text.stderr
    assert "; host jitter 50.0% (each host op's sd: every collective after a synchronisation waits for the latest " \
           "rank, shown as straggler time); seed 0" in text.stdout
    assert "host jitter" not in run("predict", *args).stdout
    for bad in ("1.5", "-0.1"):
        out = run("predict", *args, "--host-jitter", bad)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.strip().splitlines() == [f"commsim: error: --host-jitter {float(bad)}: a relative standard "
                                                   "deviation in [0, 1)"]


def test_host_scale_slows_every_host_routine_and_is_reported():
    args = ("--model", "tiny", "--nodes", "2", "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "64",
            "--preset", "baseline")
    same, slow = predict_json(*args), predict_json(*args, "--host-scale", "2")
    assert (same["scenario"]["host_scale"], slow["scenario"]["host_scale"]) == (1.0, 2.0)
    # 0.5.10 synchronises at every fetch: its host time is on the step's critical path
    assert slow["stalls_s"]["host"] > same["stalls_s"]["host"] > 0
    assert slow["step_time_s"] > same["step_time_s"]
    line = "host: every host routine takes 2x its time (--host-scale), the host optimizer's (memory-bound) excepted"
    assert slow["hardware_sources"] == [line] and same["hardware_sources"] == []
    # a host-bound step says how to price slower hosts, until one is priced
    hint = "  (host: the framework's Python and launches as timed on one core; --host-scale S prices hosts S times " \
           "slower)"
    assert same["stalls_s"]["host"] >= 0.05 * same["step_time_s"]
    assert hint in run("predict", *args).stdout.splitlines()
    text = run("predict", *args, "--host-scale", "2").stdout
    assert line in text.splitlines() and "prices hosts" not in text
    out = run("predict", *args, "--host-scale", "-1")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "commsim: error: --host-scale -1.0: must be a number > 0, how many times as long the host's CPU takes for "
        "each host routine as the core the host costs were measured on (1: as measured)"]


def test_host_gc_stops_every_rank_for_each_ranks_pass():
    args = ("--model", "tiny", "--nodes", "2", "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "64",
            "--preset", "baseline")
    still, gc = predict_json(*args), predict_json(*args, "--host-gc", "4:50:independent")
    assert still["host_gc"] is None and gc["host_gc"] == [4.0, 0.05, "independent"]
    # 4 ranks each passing every 4 steps at its own phase, 50 ms a pass, 0.5.10
    # synchronising at every fetch: about one 50 ms stop a step (a little less: two
    # passes in one op count once)
    assert 0.045 < gc["step_time_s"] - still["step_time_s"] <= 0.05
    text = run("predict", *args, "--host-gc", "4:50:independent")
    assert "; a full garbage collection every 4 steps per rank, 50 ms, each rank at its own phase (the others wait " \
           f"for it at their next collective), {gc['host_gc_pause_s']:.3f} s of host time a step (every rank's " \
           "passes); seed 0" in text.stdout
    assert gc["host_gc_pause_s"] == pytest.approx(gc["step_time_s"] - still["step_time_s"], rel=0.05)
    # aligned (the default): every rank passes at the same point, the job pays one
    # rank's passes, 50 ms every 4 steps
    aligned = predict_json(*args, "--host-gc", "4:50")
    assert aligned["host_gc"] == [4.0, 0.05, "aligned"]
    assert aligned["step_time_s"] - still["step_time_s"] == pytest.approx(0.0125, rel=0.02)
    assert "every rank's at the same point (the job pays one rank's passes), 0.013 s of host time a step (one " \
           "rank's passes)" in run("predict", *args, "--host-gc", "4:50").stdout
    # ZeRO-2's ranks own different partitions: independent unless told otherwise
    z2 = ("--model", "tiny", "--nodes", "2", "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "64",
          "--stage", "2")
    assert predict_json(*z2, "--host-gc", "4:50")["host_gc"] == [4.0, 0.05, "independent"]
    assert predict_json(*z2, "--host-gc", "4:50:aligned")["host_gc"] == [4.0, 0.05, "aligned"]
    out = run("predict", *args, "--host-gc", "50")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == ["commsim: error: --host-gc '50': PERIOD_STEPS:PAUSE_MS[:aligned|"
                                               "independent], a positive number of steps, a non-negative pause in "
                                               "ms and where the ranks' passes fall, e.g. 30:200 or "
                                               "30:200:independent"]


def test_predict_lowers_fsdp1_and_tune_searches_fsdp1_settings(tmp_path):
    args = ("--strategy", "fsdp1", "--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--seq", "64")
    out = predict_json(*args)
    assert out["scenario"]["strategy"] == "fsdp1" and out["step_time_s"] > 0
    assert "commsim predict: tiny, FSDP1, micro-batch 16 x 64, bf16" in run("predict", *args).stdout
    cfg = tmp_path / "fsdp1.tuned.json"
    tuned = run("tune", *args, "--search", "sharding_strategy,forward_prefetch", "--rounds", "1", "--quiet", "--json",
                "-o", str(cfg))
    assert tuned.returncode == 0, tuned.stderr
    report = json.loads(tuned.stdout)
    # FULL_SHARD, SHARD_GRAD_OP, NO_SHARD (one node: no HYBRID_SHARD), then forward prefetch off / on
    assert report["evaluations"] == 4 and json.loads(cfg.read_text()) == report["fsdp_config"]
    assert parse_fsdp1_config(report["fsdp_config"]).sharding_strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    bad = run("tune", *args, "--search", "hsdp_replicas")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "commsim: error: --search hsdp_replicas: allowed with --strategy fsdp1: sharding_strategy, limit_all_gathers, "
        "backward_prefetch, forward_prefetch, micro_batch, checkpointing"]
