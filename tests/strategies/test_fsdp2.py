"""The FSDP2 generator (commsim.strategies.fsdp2*): exact ops, streams, buffers and groups
on tiny models, without torch. Its collective sequences are checked against real FSDP2 in
tests/runtime/test_fsdp2_fidelity.py; here the parts a recording cannot see."""

import itertools
import json

import pytest

from commsim.api import describe_model
from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from commsim.ir.validate import validate
from commsim.strategies import World, generate_fsdp2
from commsim.strategies.fsdp2_comm import divide_factors
from commsim.strategies.fsdp2_config import parse_fsdp_config

def sched(cfg=None, world=2, model="tiny", ckpt=True, style="reentrant", dt=4):
    md = describe_model(model, 2, 16, dt)
    return generate_fsdp2(md, World(1, world), parse_fsdp_config(cfg or {}), checkpointing=ckpt,
                          checkpoint_style=style)


def colls(s, rank=0):
    return [op for op in s.program_of(rank).step if isinstance(op, O.Collective)]


def step(s, rank=0):
    return list(s.program_of(rank).step)


def index(ops, pred, start=0):
    return next(i for i in range(start, len(ops)) if pred(ops[i]))


def test_units_are_padded_per_parameter_to_the_shard_group():
    # tiny's root unit: 77864 elements, each parameter's rows padded to a multiple of
    # the ranks (the 1-row token-type table to 2 rows); over 3 ranks 78324
    assert [op.size_bytes for op in colls(sched())][:3] == [77864 * 4, 49984 * 4, 49984 * 4]
    assert colls(sched(world=3))[0].size_bytes == 78324 * 4


def test_forward_gather_copy_in_collective_copy_out_and_the_deferred_free():
    ops = step(sched({}, ckpt=False))
    by_id = {op.id: op for op in ops}
    ag = [op for op in ops if isinstance(op, O.Collective) and op.phase is O.Phase.FORWARD]
    first = ag[1]  # block 0
    copy_in = by_id[first.deps[-1]]
    assert (first.stream, copy_in.stream, copy_in.label) == ("allgather", "ag_copy_in",
                                                             "fwd.ag:roberta.encoder.layer.0.copy_in")
    out = first.buffers[0]
    alloc = next(op for op in ops if isinstance(op, O.Alloc) and op.buffer == out)
    assert (alloc.stream, alloc.size_bytes) == ("ag_copy_in", first.size_bytes)
    copy_out = next(op for op in ops if isinstance(op, O.Copy) and first.id in op.deps)
    assert (copy_out.stream, copy_out.label) == ("compute", "fwd.ag:roberta.encoder.layer.0.copy_out")
    # forward: block 0's output is freed only after block 1's all-gather is issued, before
    # block 1's copy-out (the next copy-in may overlap this copy-out)
    free = index(ops, lambda op: isinstance(op, O.Free) and op.buffer == out)
    assert ops.index(ag[2]) < free < ops.index(next(op for op in ops if isinstance(op, O.Copy) and ag[2].id in op.deps))
    # and the next all-gather stream op waits for block 0's copy-out
    nxt = next(op for op in ops[free:] if getattr(op, "stream", None) in ("ag_copy_in", "allgather")
               and isinstance(op, (O.Copy, O.Collective, O.Compute)))
    assert copy_out.id in nxt.deps


def test_backward_gathers_free_their_output_after_their_copy_out():
    ops = step(sched({}, ckpt=False))
    bwd = [op for op in ops if isinstance(op, O.Collective) and op.kind is O.CollectiveKind.ALL_GATHER
           and op.phase is O.Phase.BACKWARD]
    assert [op.label for op in bwd] == ["bwd.ag:roberta.encoder.layer.1", "bwd.ag:roberta.encoder.layer.0"]
    for ag in bwd:
        copy_out = index(ops, lambda op, ag=ag: isinstance(op, O.Copy) and ag.id in op.deps)
        assert isinstance(ops[copy_out + 1], O.Free) and ops[copy_out + 1].buffer == ag.buffers[0]


def test_one_reduce_scatter_input_stays_in_flight():
    ops = step(sched({}, ckpt=False))
    rs = [op for op in ops if isinstance(op, O.Collective) and op.kind is O.CollectiveKind.REDUCE_SCATTER]
    assert [op.label for op in rs] == ["bwd.rs:roberta.encoder.layer.1", "bwd.rs:roberta.encoder.layer.0",
                                       "bwd.rs:root"]
    assert all(op.reduce_op is O.ReduceOp.AVG and op.stream == "reduce_scatter" for op in rs)
    # block 0's post-backward frees block 1's input, and its chunk_cat waits for that reduce-scatter
    free = index(ops, lambda op: isinstance(op, O.Free) and op.buffer == rs[0].buffers[0])
    assert ops.index(rs[0]) < free < ops.index(rs[1])
    cat = next(op for op in ops[free:] if isinstance(op, O.Copy)
               and op.label == "bwd.rs:roberta.encoder.layer.0.chunk_cat")
    assert rs[0].id in cat.deps


def test_mixed_precision_gathers_in_param_dtype_and_reduces_in_reduce_dtype():
    s = sched({"mp_param_dtype": "bf16", "mp_reduce_dtype": "fp32"}, dt=2)
    kinds = [(op.kind.value, op.dtype.value, op.size_bytes) for op in colls(s)]
    assert kinds[0] == ("all_gather", "bf16", 77864 * 2) and kinds[-1] == ("reduce_scatter", "fp32", 77864 * 4)
    ops = step(s)
    casts = [op for op in ops if isinstance(op, O.Compute) and op.label.endswith(".foreach_cast")]
    assert len(casts) == 5 and all(op.stream == "ag_copy_in" for op in casts)
    chunk = [op for op in ops if op.label.endswith(".chunk_cat")]
    assert all(isinstance(op, O.Compute) for op in chunk)  # bf16 gradients cast into the fp32 input
    # bf16 reduce: the output cast back to fp32 on the reduce-scatter stream
    s = sched({"mp_param_dtype": "bf16"}, dt=2)
    assert colls(s)[-1].dtype is O.DType.BF16
    assert sum(op.label.endswith(".to_orig_dtype") and op.stream == "reduce_scatter" for op in step(s)) == 3


def test_fp16_divides_before_and_after_and_sums():
    assert divide_factors(O.DType.FP32, 8) == (None, None, O.ReduceOp.AVG)
    assert divide_factors(O.DType.FP16, 2) == (2.0, None, O.ReduceOp.SUM)
    assert divide_factors(O.DType.FP16, 16) == (4.0, 4.0, O.ReduceOp.SUM)
    assert divide_factors(O.DType.FP16, 6) == (4.0, 1.5, O.ReduceOp.SUM)
    s = sched({"mp_param_dtype": "fp16"}, world=4, dt=2)
    labels = [op.label for op in step(s)]
    assert divide_factors(O.DType.FP16, 4) == (2.0, 2.0, O.ReduceOp.SUM)
    assert "bwd.rs:root.predivide" in labels and "bwd.rs:root.postdivide" in labels
    assert "bwd.rs:root.predivide" not in [op.label for op in step(sched({"mp_param_dtype": "bf16"}, world=4, dt=2))]
    assert all(op.reduce_op is O.ReduceOp.SUM for op in colls(s) if op.kind is O.CollectiveKind.REDUCE_SCATTER)


def test_hsdp_shards_inside_and_all_reduces_across_replicas():
    s = sched({"hsdp_replicas": 2}, world=4)
    assert s.meta.rank_symmetric and len(s.programs) == 4
    for rank, shard, replica in ((0, (0, 1), (0, 2)), (1, (0, 1), (1, 3)), (2, (2, 3), (0, 2)), (3, (2, 3), (1, 3))):
        c = colls(s, rank)
        assert {op.group for op in c if op.kind is not O.CollectiveKind.ALL_REDUCE} == {shard}
        ar = [op for op in c if op.kind is O.CollectiveKind.ALL_REDUCE]
        assert [op.group for op in ar] == [replica] * 3
        assert [op.size_bytes for op in ar] == [49984 * 4 // 2] * 2 + [77864 * 4 // 2]
        assert all(op.stream == "all_reduce" for op in ar)


def test_reshard_to_a_smaller_group_gathers_over_it_in_backward():
    s = sched({"reshard_after_forward": 2}, world=4)
    c = colls(s, 3)
    ag = [(op.phase.value, op.group) for op in c if op.kind is O.CollectiveKind.ALL_GATHER]
    assert ag == [("fwd", (0, 1, 2, 3))] * 3 + [("bwd", (2, 3))] * 2
    ops = step(s)
    pf = [op for op in ops if getattr(op, "buffer", "").startswith("pf:")]
    # the 1/2 clone allocated at each block's post-forward, dropped at its backward copy-out
    assert [(type(op).__name__, op.buffer) for op in pf] == [
        ("Alloc", "pf:roberta.encoder.layer.0"), ("Alloc", "pf:roberta.encoder.layer.1"),
        ("Free", "pf:roberta.encoder.layer.1"), ("Free", "pf:roberta.encoder.layer.0")]
    assert pf[0].size_bytes == 49984 * 4 // 2


def test_reentrant_recompute_prefetches_again_and_drops_the_unused_gathers(tmp_path):
    # with explicit forward prefetch, the reentrant recompute of block i runs its forward
    # hooks, which gather blocks i+1, i+2 again after their reduce-scatter (as recorded
    # from torch 2.13): 7 backward all-gathers for 4 blocks; the second gathers of blocks
    # 3, 2 and 1 are never used, and the final callback waits for and frees them
    cfg = {"model_type": "roberta", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 256, "vocab_size": 1000, "max_position_embeddings": 130, "type_vocab_size": 1}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    s = sched({"forward_prefetch": 2, "backward_prefetch": 2}, model=str(p))
    s_nr = sched({"forward_prefetch": 2, "backward_prefetch": 2}, model=str(p), style="non_reentrant")
    bwd = [op.label.split(":")[1].split(".")[-1] for op in colls(s) if op.kind is O.CollectiveKind.ALL_GATHER
           and op.phase is not O.Phase.FORWARD]
    assert bwd == ["3", "2", "1", "3", "0", "2", "1"]
    unused = [op for op in step(s) if isinstance(op, O.Free) and op.label == "all-gather output (prefetched, unused)"]
    assert len(unused) == 3
    assert [op.label.split(".")[-1] for op in colls(s_nr) if op.kind is O.CollectiveKind.ALL_GATHER
            and op.phase is O.Phase.BACKWARD] == ["3", "2", "1", "0"]


def test_accumulation_without_sync_reduces_once_and_keeps_unsharded_gradients():
    s = sched({"gradient_accumulation_steps": 2, "requires_gradient_sync": False}, ckpt=False)
    rs = [op.label for op in colls(s) if op.kind is O.CollectiveKind.REDUCE_SCATTER]
    assert rs == ["mb1.bwd.rs:roberta.encoder.layer.1", "mb1.bwd.rs:roberta.encoder.layer.0", "mb1.bwd.rs:root"]
    labels = [op.label for op in step(s)]
    # micro-step 1 adds its gradients into the ones micro-step 0 kept
    assert "mb1.roberta.encoder.layer.0.attention.self.query.accumulate_grad" in labels
    s = sched({"gradient_accumulation_steps": 2, "requires_gradient_sync": False, "mp_param_dtype": "bf16",
               "mp_reduce_dtype": "fp32"}, ckpt=False, dt=2)
    labels = [op.label for op in step(s)]
    assert labels.count("mb0.root.to_reduce_dtype") == 1 and "mb1.root.accumulate_unsharded" in labels
    with_sync = sched({"gradient_accumulation_steps": 2}, ckpt=False)
    assert sum(op.kind is O.CollectiveKind.REDUCE_SCATTER for op in colls(with_sync)) == 6
    assert sum(op.label.endswith(".accumulate") for op in step(with_sync)) == 3


def test_cpu_offload_copies_shards_in_and_gradients_out():
    s = sched({"offload": True}, ckpt=False)
    prog = s.program_of(0)
    assert prog.setup == ()  # parameters, gradients and AdamW state on the host
    ops = list(prog.step)
    assert sum(isinstance(op, O.Copy) and op.direction is O.CopyDirection.H2D for op in ops) == 5
    d2h = [op for op in ops if isinstance(op, O.Copy) and op.direction is O.CopyDirection.D2H]
    assert len(d2h) == 3
    syncs = [op for op in ops if isinstance(op, O.HostSync)]
    assert sorted(d for op in syncs for d in op.deps) == sorted(op.id for op in d2h)  # finalize_backward
    assert any(isinstance(op, O.HostWork) and op.kind is O.HostKind.OPTIMIZER for op in ops)


def test_the_optimizer_steps_on_the_local_rows():
    s = sched({})
    ops = step(s)
    adam = [op for op in ops if isinstance(op, O.Compute) and op.kind is O.ComputeKind.OPTIMIZER]
    assert len(adam) == 8  # torch's AdamW: eight passes
    # rank 0's rows: tiny has 177768 parameters; rank 0 holds its half of every even split
    # and the single token-type row
    assert adam[0].flops == (177768 - 64) // 2 + 64
    frees = [op.buffer for op in ops[ops.index(adam[-1]):] if isinstance(op, O.Free)]
    assert sorted(b for b in frees if not b.startswith("optimizer")) == ["rs_out[1]", "rs_out[2]", "rs_out[3]"]


@pytest.mark.parametrize("raf,mp,hsdp,prefetch,gas_sync,offload,ckpt", [
    c for i, c in enumerate(itertools.product(
        [True, False, 2], [None, "bf16", "fp16"], [1, 2], [0, 2], [(1, True), (2, True), (2, False)],
        [False, True], [None, "reentrant", "non_reentrant"])) if i % 11 == 0])
def test_every_combination_is_a_valid_schedule(raf, mp, hsdp, prefetch, gas_sync, offload, ckpt):
    cfg = {"reshard_after_forward": raf if not (raf == 2 and hsdp == 2) else True, "mp_param_dtype": mp,
           "mp_reduce_dtype": "fp32" if mp == "bf16" else None, "hsdp_replicas": hsdp,
           "forward_prefetch": prefetch, "backward_prefetch": prefetch, "gradient_accumulation_steps": gas_sync[0],
           "requires_gradient_sync": gas_sync[1], "offload": offload}
    s = sched(cfg, world=4, ckpt=ckpt is not None, style=ckpt or "reentrant", dt=2 if mp else 4)
    assert validate(s) == []


@pytest.mark.parametrize("cfg,world,message", [
    ({"colour": 1}, 2, "fsdp_config: colour: unknown key; allowed: reshard_after_forward, "),
    ({"reshard_after_forward": 3}, 4, "reshard_after_forward: 3 must divide the shard group size 4"),
    ({"hsdp_replicas": 3}, 4, "hsdp_replicas: 3 must divide the world size 4"),
    ({"hsdp_replicas": 4}, 4, "hsdp_replicas: 4 leaves 1 rank per shard group"),
    ({"mp_param_dtype": "int8"}, 2, "mp_param_dtype: must be null or one of bf16, fp16, fp32"),
    ({"forward_prefetch": -1}, 2, "forward_prefetch: must be an integer >= 0"),
    ({"reshard_after_forward": 2, "root_reshard_after_forward": 4}, 8, "commsim models one post-forward group size"),
])
def test_bad_settings_are_refused(cfg, world, message):
    with pytest.raises(CommsimInputError, match=message.replace("(", r"\(")):
        sched(cfg, world=world)


def test_adamw_runs_foreach_on_gpus_and_single_tensor_per_parameter_on_cpus():
    """torch's AdamW default (_default_to_fused_or_foreach): foreach over every parameter
    at once on CUDA; on CPUs each parameter's eight passes in turn, each a DTensor op,
    stating what it reuses of the passes before."""
    from pathlib import Path

    from commsim.api import Scenario, _device
    from commsim.strategies.fsdp2_layout import FSDP2Layout, local_numel
    from commsim.strategies.knobs import HostCosts

    md = describe_model("tiny", 2, 16, 4)
    cfg = parse_fsdp_config({})
    by = {d: generate_fsdp2(md, World(1, 2), cfg, device=d) for d in ("cuda", "cpu")}
    adam = {d: [op for op in step(s) if isinstance(op, O.Compute) and op.kind is O.ComputeKind.OPTIMIZER]
            for d, s in by.items()}
    n = (177768 - 64) // 2 + 64  # rank 0's rows (test_the_optimizer_steps_on_the_local_rows)
    assert len(adam["cuda"]) == 8 and {op.reuse_bytes for op in adam["cuda"]} == {0}
    assert validate(by["cpu"]) == []
    assert by["cuda"].meta.setting("optimizer") == "torch" and by["cpu"].meta.setting("optimizer") == \
        "torch single-tensor"
    params = [p for u in FSDP2Layout.build(md, 2, cfg).units for p in u.params]  # the units' order
    assert len(adam["cpu"]) == 8 * len(params) == 8 * len(list(md.registered_params()))
    assert [op.label for op in adam["cpu"][::8]] == [f"optimizer.adamw:{p.name}.weight_decay" for p in params]
    assert [op.flops for op in adam["cpu"][::8]] == [local_numel(p, 2) for p in params]
    assert sum(op.flops for op in adam["cpu"][::8]) == n
    assert sum(op.reuse_bytes for op in adam["cpu"]) == 44 * n
    assert sum(op.bytes_read + op.bytes_written for op in adam["cpu"]) == \
        sum(op.bytes_read + op.bytes_written for op in adam["cuda"]) == 80 * n
    launch = HostCosts().launch_ns
    hosts = [op.duration_ns for op in step(by["cpu"]) if isinstance(op, O.HostWork) and op.phase is O.Phase.OPTIMIZER
             and op.kind is O.HostKind.LAUNCH]
    assert hosts == [launch + HostCosts().dtensor_op_ns] * len(adam["cpu"])
    with pytest.raises(CommsimInputError, match=r"^device 'tpu': allowed: cuda, cpu$"):
        generate_fsdp2(md, World(1, 2), cfg, device="tpu")
    # a gloo profile runs kernels on the host: the model lives on the CPU
    prof = Path(__file__).resolve().parents[2] / "traces" / "local-cpu" / "small_z2.profile.json"
    assert _device(Scenario(hw_profile=str(prof)), "fp32") == "cpu" and _device(Scenario(), "bf16") == "cuda"


def test_on_cpus_every_collective_blocks_the_host_until_it_is_done():
    """FSDP2 calls every collective with async_op=False: on NCCL the host runs on, on gloo
    (CPU tensors) c10d's work.wait() blocks the caller until the collective completes, so
    each one is followed at once by the host's wait for it, HSDP's all-reduce included."""
    md = describe_model("tiny", 2, 16, 4)
    for cfg, world in (({}, 2), ({"hsdp_replicas": 2}, 4)):
        by = {d: generate_fsdp2(md, World(1, world), parse_fsdp_config(cfg), device=d) for d in ("cuda", "cpu")}
        assert not any(isinstance(op, O.HostSync) and op.label.endswith("waited on the host") for op in step(by["cuda"]))
        ops = step(by["cpu"])
        for i, op in enumerate(ops):
            if isinstance(op, O.Collective):
                wait = ops[i + 1]
                assert isinstance(wait, O.HostSync) and wait.scope is O.SyncScope.OPS and wait.deps == (op.id,)
                assert wait.label == f"{op.label}: async_op=False, waited on the host"
        waits = [op for op in ops if isinstance(op, O.HostSync) and op.label.endswith("waited on the host")]
        assert len(waits) == len(colls(by["cpu"])) == len(colls(by["cuda"])) > 0
        assert validate(by["cpu"]) == []
