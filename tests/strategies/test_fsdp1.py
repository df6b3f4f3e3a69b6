"""The FSDP1 generator (commsim.strategies.fsdp1*): exact ops, streams, buffers and groups on
tiny models, without torch. Its collective sequences are checked against real FSDP1 in
tests/runtime/test_fsdp1_fidelity.py; here the parts a recording cannot see."""

import pytest

from commsim.api import Scenario, build_schedule, describe_model
from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from commsim.ir.validate import validate
from commsim.strategies import World, generate_fsdp1
from commsim.strategies.fsdp1 import FSDP1Lowering
from commsim.strategies.fsdp1_grads import predivide_factor
from commsim.strategies.fsdp1_config import parse_fsdp1_config
from commsim.strategies.knobs import HostCosts

ROOT, L0, L1 = "root", "roberta.encoder.layer.0", "roberta.encoder.layer.1"


def sched(cfg=None, nodes=1, gpn=2, ckpt=False, style="reentrant", dt=4):
    md = describe_model("tiny", 2, 16, dt)
    return generate_fsdp1(md, World(nodes, gpn), parse_fsdp1_config(cfg or {}), checkpointing=ckpt,
                          checkpoint_style=style)


def colls(s, rank=0):
    return [(op.phase.value, op.kind.value, op.label.split(":")[-1], op.size_bytes, op.dtype.value, op.group,
             op.stream) for op in s.program_of(rank).step if isinstance(op, O.Collective)]


def test_one_flat_parameter_a_unit_padded_as_a_whole_and_the_default_order():
    # tiny: 49984 elements a block, 77800 in the root (embeddings, LM head): each flat
    # parameter padded to a multiple of the 2 ranks as a whole (FP:1440-1480)
    fp32 = 4
    assert colls(sched()) == [
        ("fwd", "all_gather", ROOT, 77800 * fp32, "fp32", (0, 1), "unshard"),
        ("fwd", "all_gather", L0, 49984 * fp32, "fp32", (0, 1), "unshard"),
        ("fwd", "all_gather", L1, 49984 * fp32, "fp32", (0, 1), "unshard"),
        # the root's pre-backward prefetches the last block, each block the one before
        ("bwd", "all_gather", L1, 49984 * fp32, "fp32", (0, 1), "unshard"),
        ("bwd", "all_gather", L0, 49984 * fp32, "fp32", (0, 1), "unshard"),
        ("bwd", "reduce_scatter", L1, 49984 * fp32, "fp32", (0, 1), "post_backward"),
        ("bwd", "reduce_scatter", L0, 49984 * fp32, "fp32", (0, 1), "post_backward"),
        ("bwd", "reduce_scatter", ROOT, 77800 * fp32, "fp32", (0, 1), "post_backward")]
    # over 3 ranks the root's 77800 elements pad to 77802
    assert colls(sched(gpn=3))[0][3] == 77802 * fp32


def test_reentrant_checkpointing_outside_the_units_gathers_each_block_three_times():
    c = [(ph, kind[0], unit) for ph, kind, unit, *_ in colls(sched(ckpt=True))]
    assert c == [("fwd", "a", ROOT), ("fwd", "a", L0), ("fwd", "a", L1),
                 ("recompute", "a", L1), ("bwd", "a", L1), ("bwd", "r", L1),
                 ("recompute", "a", L0), ("bwd", "a", L0), ("bwd", "r", L0), ("bwd", "r", ROOT)]
    # non-reentrant: the hooks are as without checkpointing
    assert [x[:3] for x in colls(sched(ckpt=True, style="non_reentrant"))] == [x[:3] for x in colls(sched())]


def test_mixed_precision_casts_on_pre_unshard_and_reduces_in_fp32():
    s = sched({"mp_param_dtype": "bf16", "mp_reduce_dtype": "fp32"}, dt=2)
    ags = [x for x in colls(s) if x[1] == "all_gather"]
    assert {(x[3], x[4]) for x in ags} == {(77800 * 2, "bf16"), (49984 * 2, "bf16")}
    assert {x[4] for x in colls(s) if x[1] == "reduce_scatter"} == {"fp32"}
    step = list(s.program_of(0).step)
    casts = [op for op in step if isinstance(op, O.Compute) and ".cast:" in op.label]
    assert len(casts) == len(ags) and {op.stream for op in casts} == {"pre_unshard"}
    # the gradient cast to the reduce dtype before the reduce-scatter, on its stream
    assert all(op.stream == "post_backward" for op in step if isinstance(op, O.Compute) and "to_reduce_dtype" in op.label)


def test_the_rate_limiter_blocks_the_host_on_a_free_two_back():
    def limiter_waits(s):
        return [op for op in s.program_of(0).step if isinstance(op, O.HostSync) and "rate limiter" in op.label]

    waits = limiter_waits(sched())
    assert waits and all(op.scope is O.SyncScope.OPS for op in waits)
    assert limiter_waits(sched({"limit_all_gathers": False})) == []


def test_shard_grad_op_keeps_the_blocks_gathered_until_their_post_backward():
    c = colls(sched({"sharding_strategy": "SHARD_GRAD_OP"}))
    assert [x[1] for x in c if x[0] == "bwd"] == ["reduce_scatter"] * 3


def test_hybrid_shard_reduces_inside_a_node_then_all_reduces_across_nodes():
    s = sched({"sharding_strategy": "HYBRID_SHARD"}, nodes=2, gpn=2)
    ars = [x for x in colls(s) if x[1] == "all_reduce"]
    assert [(x[2], x[3], x[5], x[6]) for x in ars] == [(L1, 24992 * 4, (0, 2), "all_reduce"),
                                                       (L0, 24992 * 4, (0, 2), "all_reduce"),
                                                       (ROOT, 38900 * 4, (0, 2), "all_reduce")]
    assert {x[5] for x in colls(s, rank=3) if x[1] == "all_reduce"} == {(1, 3)}
    assert {x[5] for x in colls(s, rank=3) if x[1] != "all_reduce"} == {(2, 3)}


@pytest.mark.parametrize("world, pre", [(1, 1), (2, 2), (4, 2), (6, 4), (8, 4), (16, 4), (64, 8), (96, 16)])
def test_gradient_predivide_factor(world, pre):
    assert predivide_factor(world) == pre


def test_every_buffer_is_freed_and_the_schedule_validates():
    for cfg, kw in (({}, {"ckpt": True}), ({"mp_param_dtype": "bf16", "mp_reduce_dtype": "bf16"}, {"dt": 2}),
                    ({"sharding_strategy": "HYBRID_SHARD"}, {"nodes": 2, "gpn": 2})):
        s = sched(cfg, **kw)
        assert validate(s) == []
        allocs = {op.buffer for op in s.program_of(0).step if isinstance(op, O.Alloc)}
        frees = {op.buffer for op in s.program_of(0).step if isinstance(op, O.Free)}
        assert allocs == frees


@pytest.mark.parametrize("cfg, message", [
    ({"colour": 1}, "colour: unknown"),
    ({"sharding_strategy": "ZERO3"},
     "sharding_strategy 'ZERO3': allowed: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD"),
    ({"sharding_strategy": "NO_SHARD", "gradient_accumulation_steps": 2},
     "gradient_accumulation_steps 2 with sharding_strategy NO_SHARD: not modelled"),
    ({"forward_prefetch": 1}, "forward_prefetch 1: true or false"),
    ({"cpu_offload": True}, "cpu_offload True: not modelled for FSDP1"),
    ({"mp_param_dtype": "int8"}, "mp_param_dtype 'int8': allowed"),
    ({"backward_prefetch": "EARLY"}, "backward_prefetch 'EARLY': allowed"),
    ({"limit_all_gathers": 1}, "limit_all_gathers 1: true or false"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps 0: an integer >= 1"),
    ({"no_sync": "yes"}, "no_sync 'yes': true or false"),
])
def test_bad_settings_name_the_key(cfg, message):
    with pytest.raises(CommsimInputError, match=message):
        parse_fsdp1_config(cfg, "f.json")


def test_deepspeed_settings_do_not_apply_to_fsdp1():
    with pytest.raises(CommsimInputError, match="--stage: DeepSpeed settings; --strategy fsdp1 takes its settings"):
        build_schedule(Scenario(strategy="fsdp1", stage=3, model="tiny", nodes=1, gpus_per_node=2))
    s, _, _, precision = build_schedule(Scenario(strategy="fsdp1", model="tiny", nodes=1, gpus_per_node=2, seq=16))
    assert s.meta.strategy == "fsdp1" and precision == "bf16"  # the seed's mixed precision by default


def test_a_unit_is_prefetched_only_while_its_pre_backward_hook_is_to_come(monkeypatch):
    # without checkpointing the root's pre-backward prefetches the last block and each
    # block the one before
    def unshards(s):
        return [op.label for op in s.program_of(0).step if isinstance(op, O.Collective) and ".ag:" in op.label]

    assert unshards(sched())[3:] == ["bwd.ag:" + L1, "bwd.ag:" + L0]
    # reentrant checkpointing: a block's hooks exist only from its recompute, and the
    # root's pre-backward hook has fired before any block looks back: _unshard runs for
    # the forward (3), the root's pre-backward (1) and each block's recompute and
    # pre-backward (2 x 2), never as a prefetch
    calls = []
    real = FSDP1Lowering._unshard
    monkeypatch.setattr(FSDP1Lowering, "_unshard", lambda self, h: (calls.append(h.name), real(self, h))[1])
    md = describe_model("tiny", 2, 16, 4)
    FSDP1Lowering(md, 2, 2, parse_fsdp1_config({}), HostCosts(), checkpointing=True).program()
    assert calls == [ROOT, L0, L1, ROOT, L1, L1, L0, L0]


def mem(s, rank=0):
    """(alloc|free|kernel, buffer or label, stream) of the ops that hold or add gradients."""
    out = []
    for op in s.program_of(rank).step:
        if isinstance(op, (O.Alloc, O.Free)) and ("fgrad:" in op.buffer or "sgrad" in op.buffer):
            out.append(("alloc" if isinstance(op, O.Alloc) else "free", op.buffer, op.stream))
        elif isinstance(op, O.Compute) and "accumulate" in op.label:
            out.append(("kernel", op.label, op.stream))
    return out


def test_accumulation_reduces_every_micro_step_into_one_kept_shard():
    got = [e for e in mem(sched({"gradient_accumulation_steps": 2})) if L0 in e[1]]
    # each micro-step concatenates and reduce-scatters; the second adds its shard into the
    # first's (_saved_grad_shard +=) and frees it, then its flat gradient (the order a
    # real run frees them: tests/runtime/test_fsdp1_memory.py); zero_grad frees the kept one
    assert got == [
        ("alloc", f"mb0.fgrad:{L0}", "compute"), ("alloc", f"mb0.sgrad:{L0}", "post_backward"),
        ("free", f"mb0.fgrad:{L0}", "compute"),
        ("alloc", f"mb1.fgrad:{L0}", "compute"), ("alloc", f"mb1.sgrad:{L0}", "post_backward"),
        ("kernel", f"mb1.bwd.rs:{L0}.accumulate", "post_backward"), ("free", f"mb1.sgrad:{L0}", "post_backward"),
        ("free", f"mb1.fgrad:{L0}", "compute"),
        ("free", f"mb0.sgrad:{L0}", "post_backward"),
    ]


def test_no_sync_keeps_the_unsharded_gradient_and_reduces_it_once():
    s = sched({"gradient_accumulation_steps": 3, "no_sync": True})
    got = [e for e in mem(s) if L0 in e[1]]
    # the first micro-step's flat gradient stays as .grad; later ones are added into it
    # (AccumulateGrad) and freed once the post-backward hook returns; only the last
    # micro-step reduce-scatters
    assert got == [
        ("alloc", f"mb0.fgrad:{L0}", "compute"),
        ("alloc", f"mb1.fgrad:{L0}", "compute"), ("kernel", f"mb1.bwd.accumulate_grad:{L0}", "compute"),
        ("free", f"mb1.fgrad:{L0}", "compute"),
        ("alloc", f"mb2.fgrad:{L0}", "compute"), ("kernel", f"mb2.bwd.accumulate_grad:{L0}", "compute"),
        ("alloc", f"mb2.sgrad:{L0}", "post_backward"), ("free", f"mb0.fgrad:{L0}", "compute"),
        ("free", f"mb2.fgrad:{L0}", "compute"),
        ("free", f"mb2.sgrad:{L0}", "post_backward"),
    ]
    assert [op.label for op in s.program_of(0).step if isinstance(op, O.Collective) and "rs" in op.label] == [
        f"mb2.bwd.rs:{L1}", f"mb2.bwd.rs:{L0}", "mb2.bwd.rs:root"]
    assert validate(s) == []


def test_no_sync_under_shard_grad_op_keeps_the_parameters_gathered_across_micro_steps():
    s = sched({"gradient_accumulation_steps": 2, "no_sync": True, "sharding_strategy": "SHARD_GRAD_OP"})
    full = [("alloc" if isinstance(op, O.Alloc) else "free", op.phase.value)
            for op in s.program_of(0).step if isinstance(op, (O.Alloc, O.Free)) and op.buffer == f"flat:{L0}"]
    assert full == [("alloc", "fwd"), ("free", "bwd")]  # gathered in the first forward, freed in the last backward
    assert [op.label for op in s.program_of(0).step if isinstance(op, O.Collective)][:3] == [
        "mb0.fwd.ag:root", f"mb0.fwd.ag:{L0}", f"mb0.fwd.ag:{L1}"]
    assert sum(isinstance(op, O.Collective) for op in s.program_of(0).step) == 6  # 3 gathers, 3 reductions


def test_forward_prefetch_gathers_the_next_block_before_this_ones_kernels_and_defers_its_reduction():
    md = describe_model("small", 2, 16, 4)
    s = generate_fsdp1(md, World(1, 2), parse_fsdp1_config({"forward_prefetch": True}), checkpointing=False)
    seq = []
    for op in s.program_of(0).step:
        if isinstance(op, O.Collective):
            seq.append(op.label.replace("roberta.encoder.layer.", "b"))
        elif isinstance(op, O.Compute) and op.stream == "compute" and not seq[-1].startswith("k"):
            seq.append("k")  # a run of compute kernels
    # forward: each pre-forward gathers the next block after its own wait, before its kernels
    assert seq[:9] == ["fwd.ag:root", "fwd.ag:b0", "k", "fwd.ag:b1", "k", "fwd.ag:b2", "k", "fwd.ag:b3", "k"]
    # backward: a block's reduce-scatter comes after the next block's kernels
    assert seq[9:] == ["bwd.ag:b3", "k", "bwd.ag:b2", "k", "bwd.ag:b1", "k", "bwd.rs:b3", "bwd.ag:b0", "k",
                       "bwd.rs:b2", "k", "bwd.rs:b1", "k", "bwd.rs:b0", "k", "bwd.rs:root", "k"]


def test_no_shard_all_reduces_each_units_whole_gradient_and_keeps_it_as_grad():
    s = sched({"sharding_strategy": "NO_SHARD", "mp_param_dtype": "bf16"}, gpn=4, dt=2)
    step = s.program_of(0).step
    # nothing gathered; each unit's bf16 gradient all-reduced over every rank, last block first
    assert colls(s) == [("bwd", "all_reduce", L1, 49984 * 2, "bf16", (0, 1, 2, 3), "post_backward"),
                        ("bwd", "all_reduce", L0, 49984 * 2, "bf16", (0, 1, 2, 3), "post_backward"),
                        ("bwd", "all_reduce", ROOT, 77800 * 2, "bf16", (0, 1, 2, 3), "post_backward")]
    # a bf16 copy of the whole unit made at each pre-forward and pre-backward, freed at each
    # reshard; the fp32 cast of the reduced gradient is .grad until zero_grad
    mem = [(type(op).__name__, op.buffer, op.phase.value) for op in step
           if isinstance(op, (O.Alloc, O.Free)) and op.buffer.endswith(f":{L0}")]
    assert mem == [("Alloc", f"mp_shard:{L0}", "fwd"), ("Free", f"mp_shard:{L0}", "fwd"),
                   ("Alloc", f"mp_shard:{L0}", "bwd"), ("Alloc", f"fgrad:{L0}", "bwd"),
                   ("Free", f"mp_shard:{L0}", "bwd"), ("Alloc", f"grad32:{L0}", "bwd"),
                   ("Free", f"fgrad:{L0}", "bwd"), ("Free", f"grad32:{L0}", "optimizer")]
    # the block's kernels read that copy (its parameters are views into it)
    reads = {b for op in step if isinstance(op, O.Compute) and op.label.startswith(f"{L0}.") for b in op.buffers}
    assert f"mp_shard:{L0}" in reads and f"shard:{L0}" not in reads and f"flat:{L0}" not in reads
    assert validate(s) == []
