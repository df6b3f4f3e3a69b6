"""JSON and text forms round-trip to equal schedules; loaders refuse bad files clearly."""

import json

import pytest
from hypothesis import given, settings

from commsim.ir import ScheduleFormatError, schedule_from_json, schedule_from_text, schedule_to_json, schedule_to_text
from commsim.ir.serialize import load_schedule, save_schedule
from commsim.ir.validate import validate
from tests.schedule_gen import schedules


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_generated_schedules_are_valid_and_round_trip(schedule):
    assert validate(schedule) == []
    assert schedule_from_json(schedule_to_json(schedule)) == schedule
    assert schedule_from_text(schedule_to_text(schedule)) == schedule


def test_save_and_load(tmp_path, tiny_schedule):
    path = tmp_path / "s.json"
    save_schedule(tiny_schedule, path)
    assert load_schedule(path) == tiny_schedule
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temporary left behind


@pytest.mark.parametrize("version", [1, 99])
def test_other_schema_versions_are_refused(tiny_schedule, version):
    obj = json.loads(schedule_to_json(tiny_schedule))
    obj["schema_version"] = version
    with pytest.raises(ScheduleFormatError, match=rf"^\$\.schema_version: unsupported schema version {version}; "
                       r"this commsim reads version 2 \(regenerate the schedule with this commsim\)$"):
        schedule_from_json(json.dumps(obj))


def test_old_text_form_is_refused_by_file(tmp_path, tiny_schedule):
    from commsim.ir.load import load_schedule_any

    path = tmp_path / "old.txt"
    path.write_text(schedule_to_text(tiny_schedule).replace("text v2", "text v1", 1))
    with pytest.raises(ScheduleFormatError, match=r"old.txt: line 1: unsupported schema version '1'; this commsim "
                       r"reads version 2 \(regenerate"):
        load_schedule_any(path)


def test_phase_and_meta_fields_round_trip(tiny_schedule):
    from dataclasses import replace

    from commsim.ir import ops as O

    prog = tiny_schedule.programs[0]
    step = tuple(replace(op, phase=O.Phase.BACKWARD) for op in prog.step)
    meta = replace(tiny_schedule.meta, preset="baseline", knobs=(("coalesced_collectives", False),),
                   config=(("reduce_bucket_size", 500),), nodes=1, gpus_per_node=2, micro_batch=4, seq_len=16,
                   grad_accum=2, precision="fp16", checkpointing=True, checkpoint_style="reentrant",
                   rank_symmetric=True)
    s = replace(tiny_schedule, programs=(replace(prog, step=step),), meta=meta)
    assert schedule_from_json(schedule_to_json(s)) == s
    assert schedule_from_text(schedule_to_text(s)) == s
    assert " phase=bwd " in schedule_to_text(s)
    assert " phase=" not in schedule_to_text(tiny_schedule)  # the default (other) is not written


def test_meta_fields_are_checked(tiny_schedule):
    obj = json.loads(schedule_to_json(tiny_schedule))
    obj["meta"]["precision"] = "fp8"
    with pytest.raises(ScheduleFormatError, match=r"^\$\.meta\.precision: 'fp8'; allowed: fp32, bf16, fp16 or null$"):
        schedule_from_json(json.dumps(obj))
    obj = json.loads(schedule_to_json(tiny_schedule))
    obj["meta"]["nodes"] = "two"
    with pytest.raises(ScheduleFormatError, match=r"^\$\.meta\.nodes: expected an integer, got 'two'$"):
        schedule_from_json(json.dumps(obj))
    obj = json.loads(schedule_to_json(tiny_schedule))
    obj["meta"]["seq_len_typo"] = 1
    with pytest.raises(ScheduleFormatError, match=r"^\$\.meta: unknown field\(s\) seq_len_typo; allowed: "):
        schedule_from_json(json.dumps(obj))


def test_bad_field_is_located(tiny_schedule):
    obj = json.loads(schedule_to_json(tiny_schedule))
    obj["programs"][0]["step"][0]["size_bytes"] = "big"
    with pytest.raises(ScheduleFormatError, match=r"^\$\.programs\[0\]\.step\[0\]\.size_bytes: expected an integer, got 'big'$"):
        schedule_from_json(json.dumps(obj))


def test_unknown_op_and_field(tiny_schedule):
    obj = json.loads(schedule_to_json(tiny_schedule))
    obj["programs"][0]["step"][0]["op"] = "teleport"
    with pytest.raises(ScheduleFormatError, match=r"step\[0\]: unknown op 'teleport'; allowed: compute, collective"):
        schedule_from_json(json.dumps(obj))
    obj = json.loads(schedule_to_json(tiny_schedule))
    obj["programs"][0]["step"][0]["colour"] = 1
    with pytest.raises(ScheduleFormatError, match=r"unknown field\(s\) colour for Collective"):
        schedule_from_json(json.dumps(obj))


def test_bad_enum_lists_allowed(tiny_schedule):
    obj = json.loads(schedule_to_json(tiny_schedule))
    obj["programs"][0]["step"][0]["dtype"] = "fp8"
    with pytest.raises(ScheduleFormatError, match=r"'fp8' is not one of 'fp32', 'fp16', 'bf16'"):
        schedule_from_json(json.dumps(obj))


def test_not_json():
    with pytest.raises(ScheduleFormatError, match=r"^not valid JSON \(line 1, column 2\): Expecting property name"):
        schedule_from_json("{{")


def test_text_form_exact(tiny_schedule):
    assert schedule_to_text(tiny_schedule).splitlines()[4:] == [
        "program 0",
        "setup",
        '  0 alloc stream=compute buffer=w size_bytes=4096 label="init w"',
        "step",
        '  1 collective stream=allgather kind=all_gather size_bytes=8192 dtype=bf16 group=0-1 buffers=w label="fetch \\"w\\""',
        '  2 compute stream=compute kind=gemm flops=1024 bytes_read=10 bytes_written=10 gemm=8x8x8x1 deps=1 buffers=w label="fwd"',
        '  3 host_sync scope=device label="sync"',
    ]


def test_group_runs_in_text():
    from commsim.ir import ops as O
    from commsim.ir.text import op_from_text, op_to_text

    op = O.Collective(O.OpId(3), "ag", "x", O.CollectiveKind.ALL_GATHER, 40, O.DType.FP32, (0, 1, 2, 3, 8, 10, 11))
    line = op_to_text(op)
    assert "group=0-3,8,10-11 " in line
    assert op_from_text(line) == op


def test_gzip_schedules_round_trip_by_name(tmp_path, tiny_schedule):
    from commsim.ir.load import load_schedule_any

    path = tmp_path / "s.json.gz"
    save_schedule(tiny_schedule, path)
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    assert load_schedule(path) == tiny_schedule and load_schedule_any(path) == tiny_schedule


def test_stated_reuse_round_trips_and_unstated_reuse_is_not_written(tiny_schedule):
    """A compute op's reuse_bytes / working_set_bytes are written only when stated, so a
    schedule without them (every stored one) keeps its canonical form and hash."""
    from dataclasses import replace

    from commsim.ir import ops as O
    from commsim.ir.schedule import Program, Schedule
    from commsim.ir.serialize import schedule_hash

    text = schedule_to_json(tiny_schedule)
    assert "reuse_bytes" not in text and "working_set_bytes" not in text and "in_place_bytes" not in text
    prog = tiny_schedule.programs[0]
    step = tuple(replace(op, reuse_bytes=12, working_set_bytes=4096, in_place_bytes=min(4, op.bytes_written))
                 if isinstance(op, O.Compute) else op for op in prog.step)
    stated = Schedule(tiny_schedule.world_size, (Program(prog.setup, step),), tiny_schedule.rank_program,
                      tiny_schedule.meta)
    obj = json.loads(schedule_to_json(stated))
    fwd = next(op for op in obj["programs"][0]["step"] if op["op"] == "compute")
    assert (fwd["reuse_bytes"], fwd["working_set_bytes"]) == (12, 4096)
    assert fwd["in_place_bytes"] == min(4, fwd["bytes_written"])
    assert schedule_from_json(schedule_to_json(stated)) == stated
    assert schedule_from_text(schedule_to_text(stated)) == stated
    assert schedule_hash(stated) != schedule_hash(tiny_schedule)
    # stated as 0 is unstated: the same document and hash as without the fields
    zero = Schedule(tiny_schedule.world_size, (Program(prog.setup, tuple(
        replace(op, reuse_bytes=0, working_set_bytes=0, in_place_bytes=0) if isinstance(op, O.Compute) else op
        for op in prog.step)),),
        tiny_schedule.rank_program, tiny_schedule.meta)
    assert schedule_to_json(zero) == text and schedule_hash(zero) == schedule_hash(tiny_schedule)
