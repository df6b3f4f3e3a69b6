"""The CLI as a user runs it: exit codes, one-line errors, outputs."""

import json
import subprocess
import sys
from dataclasses import replace

from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from commsim.ir.serialize import save_schedule


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


def test_bad_flag_is_one_line():
    out = run("models", "tiny", "--micro-batch", "0")
    assert out.returncode == 2
    assert out.stderr == ("commsim: error: commsim models: argument --micro-batch: expected a positive integer, "
                          "got 0 (see 'commsim models --help')\n")


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
