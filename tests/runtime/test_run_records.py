"""Real runs' own records read by commsim (commsim.ingest): a 2-rank FSDP2 run on gloo keeps
a torch.profiler trace of its steps and Flight Recorder dumps, a 2-rank DeepSpeed ZeRO-2
run its comms logger's output; ``compare`` and ``calibrate --from-comms-log`` read them,
checked against the schedules commsim generates for the same configurations. One run of
each, shared by the tests."""

import json
import os
import pickle
import statistics
import subprocess
import sys
from collections import Counter, OrderedDict
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from commsim.cli import main
from commsim.hardware.profile_doc import load_profile
from commsim.ingest.comms_logger import DS_KINDS, calibration_points, parse_raw, parse_text
from commsim.ingest.load import align_to_prediction, load_collectives, load_trace
from commsim.ir import ops as O
from commsim.ir.load import load_schedule_any
from commsim.ir.schedule import Program, Schedule
from commsim.ir.serialize import save_schedule
from commsim.ir.trace import Trace, TraceSource
from commsim.report.collectives import recorded_sequence, record_key, schedule_sequence, strict_match
from commsim.report.compare import phase_times

ROOT = Path(__file__).resolve().parents[2]
BASE_PROFILE = ROOT / "traces" / "local-cpu" / "small_z2.profile.json"  # a real 2-rank gloo calibration
# the profiler records steps 1-4 (step 0 warms it up); the Flight Recorder all 5. Four
# measured steps, so that one of them is free of a scheduler slice between the
# profiler's and the script's phase boundaries: a loaded suite run met slices of 4.5
# and 8.4 ms in the optimizer phases of both steps when two were measured
STEPS = 5


def commsim(*args):
    """The CLI in this process (its output captured by pytest): exit status and output."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def torchrun(*args, env=None, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", *map(str, args)], cwd=ROOT, timeout=300, env=env, **kw)


def _run_fsdp(d: Path) -> None:
    cfg = d / "fsdp.json"
    cfg.write_text("{}")
    out = commsim("schedule", "--strategy", "fsdp2", "--fsdp-config", cfg, "--model", "tiny", "--nodes", "1",
                  "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "16", "-o", d / "sched.json")
    assert out.returncode == 0, out.stderr
    out = torchrun("runtime.examples.fsdp_train", "--model", "tiny", "--micro-batch", "2", "--seq", "16", "--steps",
                   STEPS, "--fsdp-config", cfg, "--torch-profile-dir", d / "prof", "--flight-recorder",
                   d / "fr" / "rank", "--flight-recorder-json", d / "frjson" / "rank", "--timings", d / "timings.json",
                   capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def fsdp(made_once):
    """FSDP2's defaults on the tiny model, 2 ranks: its schedule and one real run."""
    d = made_once("fsdp-run", _run_fsdp)
    sched = d / "sched.json"
    return SimpleNamespace(dir=d, sched=sched, schedule=load_schedule_any(sched), prof=d / "prof", fr=d / "fr",
                           frjson=d / "frjson", timings=json.loads((d / "timings.json").read_text()),
                           trace=load_trace(d / "prof"))


def rank_trace(trace: Trace, rank: int) -> Trace:
    return Trace(trace.meta, tuple(r for r in trace.records if r.rank == rank))


DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
             "zero_optimization": {"stage": 2, "reduce_bucket_size": 20000, "overlap_comm": True},
             "log_level": "info", "comms_logger": {"enabled": True, "verbose": True, "prof_all": True}}
DS_STEPS = 3


def _run_ds(d: Path) -> None:
    cfg = d / "ds.json"
    cfg.write_text(json.dumps(DS_CONFIG))
    out = commsim("schedule", "--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--seq", "16",
                  "--ds-config", cfg, "-o", d / "sched.json")
    assert out.returncode == 0, out.stderr
    log = d / "log.txt"
    with log.open("w") as f:
        out = torchrun("runtime.examples.ds_train", "--model", "tiny", "--seq", "16", "--ds-config", cfg, "--steps",
                       DS_STEPS, "--comms-raw-json", d / "raw.json", stdout=f, stderr=subprocess.STDOUT,
                       env={"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions")})
    assert out.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def ds(made_once):
    """DeepSpeed ZeRO-2 with its comms logger, 2 ranks: its schedule and one real run's log."""
    d = made_once("ds-run", _run_ds)
    sched = d / "sched.json"
    return SimpleNamespace(dir=d, sched=sched, schedule=load_schedule_any(sched), log=d / "log.txt",
                           raw=d / "raw.json")


# ------------------------------------------------------------ torch.profiler


def test_profiler_trace_holds_the_schedules_collectives(fsdp):
    out = commsim("compare", "--collectives", fsdp.prof, fsdp.sched, "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["match"] and report["repeats"] == STEPS - 1, report
    for rank in (0, 1):
        step = schedule_sequence(fsdp.schedule, rank)
        assert Counter(k for k, *_ in step) == {"all_gather": 5, "reduce_scatter": 3}
        seq = recorded_sequence(rank_trace(fsdp.trace, rank))
        assert [record_key(r) for r in seq] == step * (STEPS - 1)  # all fp32 over ranks 0,1
        assert [r.step for r in seq] == [s for s in range(1, STEPS) for _ in step]
        assert strict_match(step, seq).ok


def test_profiler_trace_steps_phases_and_ops(fsdp):
    trace = fsdp.trace
    assert trace.meta.source is TraceSource.RECORDED and trace.meta.get("steps") == list(range(1, STEPS))
    assert trace.meta.get("backend") == "gloo" and trace.meta.get("ranks") == [0, 1]
    script = fsdp.timings  # rank 0's own timer of the same steps
    phase_diffs: dict[str, list[float]] = {}
    for n in range(1, STEPS):
        recs = [r for r in trace.records if r.rank == 0 and r.step == n]
        (step,) = [r for r in recs if r.kind == "step"]
        assert step.label == f"ProfilerStep#{n}"
        # ProfilerStep#n runs from one prof.step() to the next: the script's timed step
        # and the few statements around its timer (measured: 30 us); its phases end
        # where its timer's do, but for those statements (measured: within 0.25 ms)
        assert 0 <= step.duration_ns / 1e9 - script["step_times_s"][n] < 0.001, (n, step.duration_ns, script)
        phases = phase_times(recs)
        for ours, theirs in (("forward", "forward"), ("backward", "backward"), ("optimizer", "step")):
            diff = abs(phases[ours] / 1e9 - script["phase_times_s"][theirs][n])
            # a scheduler slice (two ranks and gloo's threads on two cores) can land in
            # the statements between the two timers' boundaries: 1.7, 2.5, 5.1 and (a
            # loaded suite run) 8.6 ms seen, this VM's slice when oversubscribed being
            # about 4 ms as calibrate measures it; so a loose bound here, and the exact
            # check is the better step's, below
            assert diff < 0.02, (ours, n, phases, script)
            phase_diffs.setdefault(ours, []).append(diff)
        compute = [r for r in recs if r.stream == "compute"]
        # forward: each nn.Linear once (12 in the layers, 2 in the LM head) and the
        # attention's two matmuls per layer
        assert sum(r.kind == "gemm" and r.phase == "fwd" for r in compute) == 14 + 2 * 2
        opt = [r for r in compute if r.kind == "optimizer"]
        assert opt and all(r.phase == "optimizer" for r in opt)
        assert not [r for r in compute if r.phase == "optimizer" and r.kind != "optimizer"]
        colls = [(r.kind, r.phase) for r in sorted(recs, key=lambda r: r.op_id) if r.stream == "comm"]
        assert colls == [("all_gather", "fwd")] * 3 + [("all_gather", "bwd")] * 2 + [("reduce_scatter", "bwd")] * 3
    # and they end where the script's timer ends them but for those statements (within
    # 0.25 ms measured) in a step no scheduler slice fell into: the best of the four
    # (a median broke under a loaded suite run)
    assert all(min(d) < 0.0015 for d in phase_diffs.values()), phase_diffs


def test_compare_a_prediction_with_the_profiler_trace(fsdp):
    pred = fsdp.dir / "pred.json"
    out = commsim("predict", "--schedule", fsdp.sched, "--hw-profile", BASE_PROFILE, "--trace", pred)
    assert out.returncode == 0, out.stderr
    out = commsim("compare", pred, fsdp.prof, "--json")
    assert out.returncode == 0, out.stderr
    c = json.loads(out.stdout)
    steps = sorted(r.duration_ns for r in fsdp.trace.records if r.kind == "step" and r.rank == 0)
    assert c["measured_step_s"] == pytest.approx(statistics.median(steps) / 1e9, abs=1e-12)
    assert c["recorded_steps_aligned"] == list(range(1, STEPS)) and c["recorded_steps_differing"] == []
    assert c["ops_compared"] == 8  # the step's collectives, one by one
    assert set(c["phase_s"]) == {"forward", "backward", "optimizer", "communication"}
    assert all(v["measured"] > 0 for v in c["phase_s"].values())
    words = align_to_prediction(Trace.load(pred), fsdp.trace, 0).describe()
    assert words.startswith(f"per op: {STEPS - 1} of {STEPS - 1} recorded step(s) issue the prediction's 8 "
                            "collectives (kind, bytes, order)")


# ------------------------------------------------------------ Flight Recorder


def without_one_collective(schedule: Schedule, which: int) -> Schedule:
    """The schedule with every rank's ``which``-th collective (and waits on it) removed."""
    programs = []
    for p in schedule.programs:
        colls = [op for op in p.step if isinstance(op, O.Collective)]
        gone = colls[which].id
        step = tuple(replace(op, deps=tuple(d for d in op.deps if d != gone)) if getattr(op, "deps", ()) else op
                     for op in p.step if op.id != gone)
        programs.append(Program(p.setup, step))
    return Schedule(schedule.world_size, tuple(programs), schedule.rank_program, schedule.meta)


def test_flight_recorder_dumps_match_the_schedule_and_not_one_collective_less(fsdp):
    for rank in (0, 1):
        out = commsim("compare", "--collectives", fsdp.fr, fsdp.sched, "--rank", rank, "--json")
        report = json.loads(out.stdout)
        # every step, the first included: FSDP2 communicates alike in each
        assert out.returncode == 0 and report["match"] and report["repeats"] == STEPS, report
        assert report["steps_known"] is False and report["starts"][0] == [0, 0]
        seq = recorded_sequence(load_collectives(fsdp.fr, rank))
        assert [record_key(r) for r in seq] == schedule_sequence(fsdp.schedule, rank) * STEPS + \
            [("barrier", 0, "", "0,1")]
    text = commsim("compare", "--collectives", fsdp.fr, fsdp.sched).stdout
    assert text.startswith(f"match: the recording ends with the schedule's step of 8 collectives {STEPS} times")
    assert "no step numbers (a Flight Recorder dump), so the 0 collective(s) before them" in text
    for which in (0, 5):
        short = fsdp.dir / f"short{which}.json"
        save_schedule(without_one_collective(fsdp.schedule, which), short)
        out = commsim("compare", "--collectives", fsdp.fr, short, "--json")
        report = json.loads(out.stdout)
        assert out.returncode == 1 and not report["match"] and report["expected"] == 7, report
        assert commsim("compare", "--collectives", fsdp.fr, short).stdout.startswith("no match:")


def test_a_json_dump_of_gloo_shows_its_reduce_scatters_as_all_reduces(fsdp):
    step = schedule_sequence(fsdp.schedule)
    seq = [record_key(r) for r in recorded_sequence(load_collectives(fsdp.frjson, 0))]
    as_recorded = [("all_reduce", *k[1:]) if k[0] == "reduce_scatter" else k for k in step]
    assert seq == as_recorded * STEPS + [("barrier", 0, "", "0,1")]
    out = commsim("compare", "--collectives", fsdp.frjson, fsdp.sched)
    assert out.returncode == 1 and out.stdout.startswith("no match")
    assert "gloo carries out a reduce-scatter as an all-reduce" in out.stderr


def test_one_gloo_dump_alone_is_refused(fsdp):
    out = commsim("compare", "--collectives", fsdp.fr / "rank0", fsdp.sched)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1
    assert "does not list process group '0''s ranks" in out.stderr and "every rank's dump" in out.stderr


def test_bad_records_exit_2_with_one_line(fsdp, tmp_path):
    import torch

    c10d = torch._C._distributed_c10d
    # this process has sent no collective with the recorder on: its dumps are empty
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "rank0").write_bytes(c10d._dump_fr_trace())
    (tmp_path / "empty.json").write_bytes(c10d._dump_fr_trace_json())
    (tmp_path / "notes.txt").write_text("step 1 took 40 ms\n")
    (tmp_path / "objects.pkl").write_bytes(pickle.dumps(OrderedDict(entries=[])))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "rank0").write_bytes((fsdp.fr / "rank0").read_bytes())
    (mixed / "trace.json").write_bytes(next(fsdp.prof.iterdir()).read_bytes())
    cases = [
        (("compare", "--collectives", tmp_path / "empty", fsdp.sched), "holds no collectives"),
        (("compare", "--collectives", tmp_path / "empty.json", fsdp.sched), "holds no collectives"),
        (("compare", "--collectives", tmp_path / "notes.txt", fsdp.sched), "not a file commsim reads"),
        (("compare", tmp_path / "notes.txt", fsdp.prof), "not a file commsim reads"),
        (("compare", "--collectives", tmp_path / "objects.pkl", fsdp.sched), "not plain Python values"),
        (("compare", "--collectives", mixed, fsdp.sched), "mixes a"),
        (("compare", fsdp.sched, fsdp.fr), "not a file commsim reads"),
        (("compare", fsdp.prof, fsdp.fr), "holds collectives only"),
        (("compare", "--collectives", fsdp.prof, fsdp.sched, "--rank", "5"), "no records of rank 5"),
    ]
    for args, words in cases:
        out = commsim(*args)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and words in out.stderr, (args, out.stderr)


def test_reading_records_needs_no_torch(fsdp, ds, tmp_path):
    block = "import sys; sys.modules['torch'] = None; from commsim.cli import main; sys.exit(main(sys.argv[1:]))"
    for args in (("compare", "--collectives", fsdp.prof, fsdp.sched), ("compare", "--collectives", fsdp.fr, fsdp.sched),
                 ("calibrate", "--from-comms-log", ds.log, "--hw-profile", BASE_PROFILE, "--ranks", "2", "-o",
                  tmp_path / "p.json")):
        out = subprocess.run([sys.executable, "-c", block, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                             timeout=120)
        assert out.returncode == 0, (args, out.stderr[-2000:])


# ------------------------------------------------------------ DeepSpeed's comms logger


def test_comms_log_ops_are_the_schedules_collectives(ds):
    text = parse_text(ds.log.read_text(), str(ds.log))
    raw = parse_raw(json.loads(ds.raw.read_text()), str(ds.raw))
    # DeepSpeed 0.19.8 logs running sums per op name: both forms are read as such
    assert text.cumulative and raw.cumulative and raw.exact_sizes and not text.exact_sizes
    # the text has log_summary's own barrier too, after the raw data was saved
    text_ops = [op for op in text.ops if op.name != "log_summary_barrier"]
    for name in {op.name for op in raw.ops}:
        t = [op for op in text_ops if op.name == name]
        r = sorted((op for op in raw.ops if op.name == name), key=lambda op: op.seconds)
        t_sorted = sorted(t, key=lambda op: op.seconds)
        assert len(t) == len(r)
        # per-op times: differences of values printed to 0.01 ms
        assert all(abs(a.seconds - b.seconds) <= 1.01e-5 for a, b in zip(t_sorted, r)), name
    points, skipped = calibration_points(raw, 2)
    assert skipped == {}
    # the steps' ops (all but the start-up broadcasts): exactly the schedule's, by kind and bytes
    sched = Counter((k, b) for k, b, _, _ in schedule_sequence(ds.schedule))
    logged = Counter((DS_KINDS[op.name][0], round(op.size_bytes * (2 if DS_KINDS[op.name][1] else 1)))
                     for op in raw.ops if op.name != "broadcast")
    assert logged == Counter({k: v * DS_STEPS for k, v in sched.items()})
    assert {s for s, _ in points["all_reduce"].points} == {b for k, b in sched if k == "all_reduce"}


def test_calibrate_from_the_comms_log_writes_a_profile_predict_takes(ds, tmp_path):
    prof = tmp_path / "profile.json"
    out = commsim("calibrate", "--from-comms-log", ds.raw, "--hw-profile", BASE_PROFILE, "-o", prof)
    assert out.returncode == 0, out.stderr
    assert "over 2 ranks inside a node" in out.stdout  # the ranks, from DeepSpeed's bandwidth figures
    assert "synchronised" in out.stdout and "no overlap information" in out.stdout
    base, new = json.loads(BASE_PROFILE.read_text()), json.loads(prof.read_text())
    assert {k: v for k, v in new.items() if k not in ("collectives", "description", "collective_sources")} == \
        {k: v for k, v in base.items() if k not in ("collectives", "description")}
    points, _ = calibration_points(parse_raw(json.loads(ds.raw.read_text()), "raw"), 2)
    loaded = load_profile(prof)
    for kind in ("all_reduce", "all_gather", "broadcast"):
        fit = loaded.collectives[kind][("intra_node", 2)]
        assert fit.points == points[kind].points and fit == replace(points[kind].fit(),
                                                                     call_points=fit.call_points)
    assert loaded.collectives["reduce_scatter"] == load_profile(BASE_PROFILE).collectives["reduce_scatter"]
    out = commsim("predict", "--schedule", ds.sched, "--hw-profile", prof, "--json")
    assert out.returncode == 0, out.stderr
    base_pred = commsim("predict", "--schedule", ds.sched, "--hw-profile", BASE_PROFILE, "--json")
    assert json.loads(out.stdout)["comm_time_s"] != json.loads(base_pred.stdout)["comm_time_s"]
    # the printed log: sizes as printed, the group size given
    text_prof = tmp_path / "text.json"
    out = commsim("calibrate", "--from-comms-log", ds.log, "--hw-profile", BASE_PROFILE, "--ranks", "2", "-o",
                  text_prof)
    assert out.returncode == 0 and "left out: log_summary_barrier (2)" in out.stdout, out.stdout + out.stderr
    text_sizes = [x for x, _ in load_profile(text_prof).collectives["all_reduce"][("intra_node", 2)].points]
    assert [pytest.approx(x, rel=0.005) for x in text_sizes] == [x for x, _ in points["all_reduce"].points]


def test_compare_a_prediction_with_the_comms_log(ds, tmp_path):
    pred = tmp_path / "pred.json"
    out = commsim("predict", "--schedule", ds.sched, "--hw-profile", BASE_PROFILE, "--trace", pred)
    assert out.returncode == 0, out.stderr
    sched = Counter((k, b) for k, b, _, _ in schedule_sequence(ds.schedule))
    for log in (ds.raw, ds.log):
        out = commsim("compare", pred, log, "--json")
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["ranks"] == 2
        steps = {(r["kind"], r["size_bytes"]): r for r in got["sizes"] if r["kind"] != "broadcast"}
        # every logged size of the steps' collectives is one the schedule has, matched to it, with the
        # run's count of ops (the text log's sizes rounded to 2 decimals of their unit: matched to the nearest)
        assert len(steps) == len(sched)
        for (kind, size), r in steps.items():
            exact = min((b for k, b in sched if k == kind), key=lambda b: abs(b - size))
            assert exact == size if log == ds.raw else abs(exact - size) <= 0.005 * exact
            assert r["logged_ops"] == sched[(kind, exact)] * DS_STEPS and r["predicted_ops"] == sched[(kind, exact)]
            assert r["error_frac"] == pytest.approx((r["predicted_s"] - r["logged_s"]) / r["logged_s"])
        # the start-up broadcasts are in the log and not in a step's prediction
        assert all(r["predicted_s"] is None for r in got["sizes"] if r["kind"] == "broadcast")
    text = commsim("compare", pred, ds.raw).stdout.splitlines()
    assert "synchronised" in text[0] and text[-1].startswith("collectives vs comms log: median |error| = ")
    assert text[-1].endswith("logged size(s) the prediction does not have)")


def test_comms_logs_commsim_cannot_use_exit_2_with_one_line(ds, tmp_path):
    lines = ds.log.read_text().splitlines(keepends=True)
    no_ops = tmp_path / "no_ops.txt"  # the run's log without its op lines and table
    no_ops.write_text("".join(line for line in lines if "comm op:" not in line and "Comm. Op" not in line))
    table = tmp_path / "table.txt"  # log_summary's table alone
    table.write_text("".join(line for line in lines if "comm op:" not in line))
    out_file = tmp_path / "p.json"
    cases = [
        (("--from-comms-log", no_ops, "--hw-profile", BASE_PROFILE, "--ranks", "2"), "not a file commsim reads"),
        (("--from-comms-log", table, "--hw-profile", BASE_PROFILE, "--ranks", "2"), "running sums"),
        (("--from-comms-log", ds.raw), "needs --hw-profile BASE"),
        (("--from-comms-log", ds.log, "--hw-profile", BASE_PROFILE), "give --ranks N"),
        (("--from-comms-log", BASE_PROFILE, "--hw-profile", BASE_PROFILE), "not a file commsim reads"),
        (("--hw-profile", BASE_PROFILE), "goes with --from-comms-log"),
    ]
    for args, words in cases:
        out = commsim("calibrate", *args, "-o", out_file)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and words in out.stderr, (args, out.stderr)
        assert not out_file.exists()
