"""The strict comparison of a recording with a schedule's step (commsim.report.collectives):
equal collective for collective in the recording's last steps, or no match, on a real
generated schedule and recordings built from it."""

from dataclasses import replace

import pytest

from commsim.api import Scenario, build_schedule
from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from commsim.ir.trace import TraceRecord
from commsim.report.collectives import format_match, schedule_sequence, strict_match


@pytest.fixture(scope="module")
def schedule() -> Schedule:
    ds = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 20000}}
    return build_schedule(Scenario(model="tiny", nodes=1, gpus_per_node=2, seq=16, ds_config=ds))[0]


def recording(steps: list[list[tuple]], tail_of_step: int = 1, barrier: bool = True) -> list[TraceRecord]:
    """A rank's recorded collectives: each step's keys in order; the last ``tail_of_step``
    collectives of a step counted in the next step, as after DeepSpeed's optimizer hook;
    the script's closing barrier last."""
    out = []
    for s, keys in enumerate(steps):
        for j, (kind, size, dtype, group) in enumerate(keys):
            step = s + 1 if j >= len(keys) - tail_of_step else s
            out.append(TraceRecord(0, "collectives", len(out), kind, f"fwd:x:{dtype}:{group}", 0, 0, size, 0, step,
                                   "fwd", dtype, group))
    if barrier:
        out.append(TraceRecord(0, "collectives", len(out), "barrier", "fwd:barrier::0,1", 0, 0, 0, 0, len(steps),
                               "fwd", "", "0,1"))
    return out


def test_the_recorded_steady_state_equal_to_the_step_matches(schedule):
    step = schedule_sequence(schedule)
    n = len(step)
    assert n == 12 and step[-1] == ("all_gather", step[-1][1], "bf16", "0,1")
    warmup = step[:-1]  # a first step that differs
    m = strict_match(step, recording([warmup, step, step, step]))
    assert m.ok and m.repeats == 3 and m.covered and m.difference is None
    assert m.starts == ((n - 1, 1), (2 * n - 1, 2), (3 * n - 1, 3))
    assert format_match(m).startswith("match: the recording ends with the schedule's step of 12 collectives 3 times")


@pytest.mark.parametrize("change", ["removed", "added", "dtype", "group", "bytes", "order"])
def test_a_schedule_one_collective_off_is_rejected(schedule, change):
    step = schedule_sequence(schedule)
    rec = recording([step, step, step])
    program = schedule.program_of(0)
    ops = list(program.step)
    colls = [i for i, op in enumerate(ops) if isinstance(op, O.Collective)]
    i = colls[2]
    if change == "removed":
        del ops[i]
    elif change == "added":
        ops.insert(i, replace(ops[i], id=O.OpId(10**6)))
    elif change == "dtype":
        ops[i] = replace(ops[i], dtype=O.DType.FP32, size_bytes=ops[i].size_bytes * 2)
    elif change == "group":
        ops[i] = replace(ops[i], group=(0,))
    elif change == "bytes":
        ops[i] = replace(ops[i], size_bytes=ops[i].size_bytes + 2)
    else:
        j = colls[1]
        ops[i], ops[j] = ops[j], ops[i]
    wrong = Schedule(schedule.world_size, (Program(program.setup, tuple(ops)),), (0, 0), schedule.meta)
    expected = schedule_sequence(wrong)
    m = strict_match(expected, rec)
    assert not m.ok
    d = m.difference
    assert d is not None and d.expected != d.recorded
    assert d.position <= 2, d
    assert "differs: the schedule has" in format_match(m)


def test_the_dtype_alone_decides(schedule):
    step = schedule_sequence(schedule)
    fp32 = [(k, b, "fp16" if k == "all_gather" else dt, g) for k, b, dt, g in step]
    m = strict_match(fp32, recording([step, step, step]))
    assert not m.ok and m.repeats == 0
    d = m.difference
    assert d.position == len(step) - 1 and d.expected[2] == "fp16" and d.recorded[2] == "bf16"


def test_a_fragment_that_repeats_at_the_end_does_not_cover_the_steps(schedule):
    step = schedule_sequence(schedule)
    ag = step[-1]
    rec = recording([step, step + [ag], step + [ag]], tail_of_step=2)
    m = strict_match([ag], rec)
    assert m.repeats == 2 and not m.covered and not m.ok
    assert "do not cover the recording's last 2 steps" in format_match(m)


def test_anything_between_two_steps_breaks_the_match(schedule):
    step = schedule_sequence(schedule)
    extra = ("all_reduce", 4, "fp32", "0,1")
    m = strict_match(step, recording([step, step + [extra], step]))
    assert m.repeats == 1 and not m.ok
    d = m.difference  # the step before the last: one collective too many at its end
    assert (d.position, d.expected, d.recorded, d.recorded_step) == (len(step) - 1, step[-1], extra, 2)


def test_one_steady_step_is_not_enough(schedule):
    step = schedule_sequence(schedule)
    m = strict_match(step, recording([step[:-1], step]))
    assert m.repeats == 1 and not m.ok
    assert strict_match(step, recording([step[:-1], step]), min_steps=1).ok


def test_only_the_closing_barriers_are_ignored(schedule):
    step = schedule_sequence(schedule)
    rec = recording([step, step, step], barrier=False)
    assert strict_match(step, rec).ok
    n = len(step)
    barrier = replace(rec[0], kind="barrier", size_bytes=0, dtype="")
    warm = rec[:5] + [barrier] + rec[5:]  # a barrier in the first step, before the steady ones
    m = strict_match(step, [replace(r, op_id=i) for i, r in enumerate(warm)])
    assert m.repeats == 2 and m.ok
    between = rec[:2 * n] + [replace(barrier, step=2)] + rec[2 * n:]
    m = strict_match(step, [replace(r, op_id=i) for i, r in enumerate(between)])
    assert m.repeats == 1 and not m.ok
