"""ZeRO-1/2 (zero12.py): which precisions run the overflow check, and how a gradient
larger than the bucket is all-reduced where it straddles two ranks' partitions; the
numbers are those real DeepSpeed 0.19.8 sent on CPUs (tests/runtime/test_deepspeed_fidelity.py)."""

import pytest

from commsim.api import Scenario, build_schedule
from commsim.ir import ops as O


def collectives(stage: int, precision: dict, bucket: int, world: int = 2) -> list[tuple[str, int, str]]:
    ds = {"train_micro_batch_size_per_gpu": 2, **precision,
          "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}}
    sched = build_schedule(Scenario(model="tiny", nodes=1, gpus_per_node=world, seq=16, ds_config=ds))[0]
    return [(op.kind.value, op.size_bytes, op.dtype.value) for op in sched.program_of(0).step
            if isinstance(op, O.Collective)]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("precision,checked", [({}, False), ({"bf16": {"enabled": True}}, True),
                                               ({"fp16": {"enabled": True}}, True),
                                               ({"bf16": {"enabled": True, "check_grad_overflow": False}}, False)])
def test_the_overflow_check_runs_for_fp16_and_bf16_only(stage, precision, checked):
    tail = collectives(stage, precision, 20000)[-3:]
    dt = 4 if not precision else 2
    overflow = ("all_reduce", 1, "uint8")
    assert (overflow in tail) is checked
    assert tail[-2:] == [("all_reduce", 4, "fp32"), ("all_gather", 177768 * dt, tail[-1][2])]


def test_a_gradient_straddling_two_partitions_is_all_reduced_in_two_pieces():
    # tiny has 177768 parameters: rank 0's partition ends 88884 elements in, inside
    # layer 0's attention.output.dense.weight (4096 elements at offset 84992): 3892
    # elements on rank 0, 204 on rank 1; with a 3000-element bucket the first piece
    # alone exceeds it and is all-reduced by itself (stage 1 walks parameters in order)
    sizes = [b for k, b, _ in collectives(1, {}, 3000) if k == "all_reduce"]
    i = sizes.index(3892 * 4)
    assert sizes[i:i + 2] == [3892 * 4, 204 * 4]
    # a bucket larger than the first piece reduces the gradient whole
    sizes = [b for k, b, _ in collectives(1, {}, 4000) if k == "all_reduce"]
    assert 4096 * 4 in sizes and 3892 * 4 not in sizes


def test_the_updated_partitions_are_padded_to_twice_the_world_size():
    # stage_1_and_2.py aligns the flat buffer to nccl_start_alignment_factor (2) x world:
    # 177768 elements over 11 ranks pad to 177782 (a multiple of 22), not 177771 (of 11)
    assert [b for k, b, _ in collectives(1, {}, 20000, world=11) if k == "all_gather"] == [177782 * 4]
    assert [b for k, b, _ in collectives(2, {}, 20000, world=2) if k == "all_gather"] == [177768 * 4]
