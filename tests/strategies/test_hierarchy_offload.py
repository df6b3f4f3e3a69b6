"""hpZ, MiCS and CPU optimizer offload: groups, bytes, memory and host time, exactly."""

from math import ceil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commsim.hardware.specs import cluster_preset
from commsim.hardware.costs import SpecCostModel
from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from commsim.ir.validate import validate
from commsim.models import MODEL_PRESETS, describe
from commsim.sim.engine import SimConfig, Simulator
from commsim.strategies import World, generate
from commsim.strategies.dsconfig import parse_ds_config
from commsim.strategies.knobs import HostCosts, Knobs

MD = describe(MODEL_PRESETS["tiny"], 2, 16)
NOTHING_LIVE = {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
                "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


def gen(world, stage=3, **zero):
    cfg = parse_ds_config({"bf16": {"enabled": True}, "zero_optimization": {"stage": stage, **zero}})
    return generate(MD, world, cfg, Knobs())


def colls(program, kind=None):
    return [op for op in program.step if isinstance(op, O.Collective) and (kind is None or op.kind is kind)]


def test_hpz_gathers_in_the_node_after_the_first_use_and_keeps_secondary_shards():
    s = gen(World(2, 2), zero_hpz_partition_size=2, **NOTHING_LIVE)
    assert validate(s) == []
    assert len(s.programs) == 2 and s.rank_program == (0, 0, 1, 1)
    assert s.meta.rank_symmetric is True
    p0, p1 = s.programs
    ags = colls(p0, O.CollectiveKind.ALL_GATHER)
    # rank 2's program is rank 0's over its own node group
    assert [op.group for op in colls(p1, O.CollectiveKind.ALL_GATHER)] == [
        (2, 3) if op.group == (0, 1) else op.group for op in ags]
    # one parameter per call: every parameter is released after each use, so its first
    # gather of the step runs over the world and every later one inside the node
    cfg = parse_ds_config({"bf16": {"enabled": True},
                           "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2, **NOTHING_LIVE}})
    single = generate(MD, World(2, 2), cfg, Knobs(coalesced_collectives=False)).programs[0]
    seen, first, later = set(), [], []
    for op in colls(single, O.CollectiveKind.ALL_GATHER):
        (buf,) = op.buffers
        (later if buf in seen else first).append(op.group)
        seen.add(buf)
    assert seen == {f"param:{p.name}" for p in MD.registered_params()}
    assert set(first) == {(0, 1, 2, 3)} and set(later) == {(0, 1)} and len(later) > len(first)
    # one secondary shard per parameter: 1/h of its padded full size, freed after the step
    secs = {op.buffer: op.size_bytes for op in p0.step if isinstance(op, O.Alloc) and op.buffer.startswith("sec:")}
    assert secs == {f"sec:{p.name}": ceil(p.numel / 4) * 4 // 2 * 2 for p in MD.registered_params()}
    freed = [op.buffer for op in p0.step if isinstance(op, O.Free) and op.buffer.startswith("sec:")]
    assert sorted(freed) == sorted(secs)
    # the same gathers without hpZ all run over the world, with the same bytes
    plain = colls(gen(World(2, 2), **NOTHING_LIVE).programs[0], O.CollectiveKind.ALL_GATHER)
    assert [op.size_bytes for op in plain] == [op.size_bytes for op in ags]


def test_mics_shards_inside_groups_and_all_reduces_across_replicas():
    s = gen(World(2, 2), mics_shard_size=2, reduce_bucket_size=20000, **NOTHING_LIVE)
    assert validate(s) == []
    assert len(s.programs) == 4
    p0 = s.programs[s.rank_program[0]]
    ags = colls(p0, O.CollectiveKind.ALL_GATHER)
    rss = colls(p0, O.CollectiveKind.REDUCE_SCATTER)
    ars = [op for op in colls(p0, O.CollectiveKind.ALL_REDUCE) if "replica" in op.label]
    assert {op.group for op in ags + rss} == {(0, 1)}
    # parameters sharded over 2 ranks, not 4: the gathers and reduce-scatters of plain
    # ZeRO-3 on 2 ranks, byte for byte
    two = gen(World(1, 2), reduce_bucket_size=20000, **NOTHING_LIVE).programs[0]
    assert [op.size_bytes for op in ags] == [op.size_bytes for op in colls(two, O.CollectiveKind.ALL_GATHER)]
    assert [op.size_bytes for op in rss] == [op.size_bytes for op in colls(two, O.CollectiveKind.REDUCE_SCATTER)]
    # each reduce-scatter is followed by an all-reduce of its shard across the replicas
    assert len(ars) == len(rss)
    assert [op.size_bytes for op in ars] == [op.size_bytes // 2 for op in rss]
    assert {op.group for op in ars} == {(0, 2)}
    p3 = s.programs[s.rank_program[3]]
    assert {op.group for op in colls(p3) if "replica" in op.label} == {(1, 3)}
    assert {op.group for op in colls(p3, O.CollectiveKind.REDUCE_SCATTER)} == {(2, 3)}


def test_mics_hierarchical_gather_crosses_nodes_then_gathers_in_the_node():
    s = gen(World(4, 2), mics_shard_size=4, mics_hierarchical_params_gather=True, **NOTHING_LIVE)
    assert validate(s) == []
    p0 = s.programs[s.rank_program[0]]
    ags = colls(p0, O.CollectiveKind.ALL_GATHER)
    inter = [op for op in ags if op.label.endswith(".inter")]
    intra = [op for op in ags if op.label.endswith(".intra")]
    assert len(inter) == len(intra) == len(ags) // 2
    assert {op.group for op in inter} == {(0, 2)} and {op.group for op in intra} == {(0, 1)}
    assert [op.size_bytes for op in inter] == [op.size_bytes // 2 for op in intra]
    p5 = s.programs[s.rank_program[5]]  # shard group 4-7, node 2-ranks 4,5
    assert {op.group for op in colls(p5, O.CollectiveKind.ALL_GATHER)} == {(5, 7), (4, 5)}


def test_cpu_offload_moves_optimizer_state_and_adam_to_the_host():
    costs = HostCosts(cpu_adam_ps_per_param=1500)
    cfg = parse_ds_config({"bf16": {"enabled": True},
                           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    s = generate(MD, World(1, 2), cfg, Knobs(), costs=costs)
    assert validate(s) == []
    p = s.programs[0]
    setup = {a.buffer for a in p.setup}
    assert not any(b.startswith(("fp32[", "exp_avg", "grad32[")) for b in setup)
    shard = sum(ceil(q.numel / 2) for q in MD.registered_params())
    adam = [op for op in p.step if isinstance(op, O.HostWork) and op.kind is O.HostKind.OPTIMIZER]
    assert sum(op.duration_ns for op in adam) == shard * 1500 // 1000
    d2h = [op for op in p.step if isinstance(op, O.Copy) and op.direction is O.CopyDirection.D2H
           and "offload" in op.label]
    assert sum(op.size_bytes for op in d2h) == shard * 4  # fp32 gradients to the host
    h2d = [op for op in p.step if isinstance(op, O.Copy) and op.direction is O.CopyDirection.H2D]
    assert sum(op.size_bytes for op in h2d) == shard * 2  # updated bf16 partition back
    assert not any(isinstance(op, O.Compute) and op.label.startswith("optimizer.adam") for op in p.step)


@pytest.mark.parametrize("stage", [1, 2])
def test_cpu_offload_in_stages_1_and_2(stage):
    cfg = parse_ds_config({"bf16": {"enabled": True},
                           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}})
    s = generate(MD, World(1, 2), cfg, Knobs())
    assert validate(s) == []
    p = s.programs[0]
    total = sum(q.numel for q in MD.registered_params())
    part = ceil(total / 2)
    assert {a.buffer for a in p.setup} <= {"params16", "ipg_bucket"}
    adam = [op for op in p.step if isinstance(op, O.HostWork) and op.kind is O.HostKind.OPTIMIZER]
    assert sum(op.duration_ns for op in adam) == part * HostCosts().cpu_adam_ps_per_param // 1000
    d2h = sum(op.size_bytes for op in p.step if isinstance(op, O.Copy) and "offload" in op.label)
    assert d2h == 4 * sum(ceil(op.size_bytes // 2 / 2) for op in colls(p, O.CollectiveKind.ALL_REDUCE)
                          if op.size_bytes > 8)


def test_symmetric_simulation_of_rank_symmetric_schedules_matches_per_rank():
    # MiCS replicas are groups with one rank per node: simulated alone (symmetric), rank
    # 0's all-reduce must share the node's NICs with its sibling groups as it does
    # when every rank is simulated.
    world = World(4, 2)
    cfg = parse_ds_config({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                           "zero_optimization": {"stage": 3, "mics_shard_size": 2}})
    md = describe(MODEL_PRESETS["small"], 2, 128)
    s = generate(md, world, cfg, Knobs())
    cost = SpecCostModel(cluster_preset("p4d", 4, "efa", 2))
    sym = Simulator(s, cost, SimConfig(mode="symmetric")).run()
    per = Simulator(s, cost, SimConfig(mode="per-rank", jitter=0.0)).run()
    assert sym.mode == "symmetric" and per.mode == "per-rank"
    assert sym.step_time_ns == pytest.approx(per.step_time_ns, rel=0.02)
    replica = [r for r in per.ranks[0].records if "replica_allreduce" in r.op.label]
    replica_sym = [r for r in sym.ranks[0].records if "replica_allreduce" in r.op.label]
    assert sum(r.end_ns - r.start_ns for r in replica_sym) == pytest.approx(
        sum(r.end_ns - r.start_ns for r in replica), rel=0.05)


def test_hierarchy_and_offload_config_errors():
    def bad(zero, match, world=World(2, 2)):
        with pytest.raises(CommsimInputError, match=match):
            gen(world, **zero)

    bad({"zero_hpz_partition_size": 3}, r"zero_hpz_partition_size: 3 must divide the world size 4")
    bad({"mics_shard_size": 3}, r"mics_shard_size: 3 must divide the world size 4")
    bad({"mics_shard_size": 6}, r"mics_shard_size: 6 spans nodes, so it must be a multiple", World(6, 4))
    with pytest.raises(CommsimInputError, match=r"offload_optimizer.device: nvme is not modelled yet"):
        parse_ds_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})
    with pytest.raises(CommsimInputError, match=r"offload_param: parameter offload is not modelled yet"):
        parse_ds_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    with pytest.raises(CommsimInputError, match=r"mics_shard_size: needs stage 3 \(stage is 2\)"):
        parse_ds_config({"zero_optimization": {"stage": 2, "mics_shard_size": 2}})
    bad({"mics_shard_size": 2, "mics_hierarchical_params_gather": True},
        r"mics_hierarchical_params_gather: the shard group \(2\) lies inside one node")
    with pytest.raises(CommsimInputError, match=r"mics_shard_size: cannot be combined with offload_optimizer"):
        parse_ds_config({"zero_optimization": {"stage": 3, "mics_shard_size": 2, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(CommsimInputError, match=r"mics_shard_size: cannot be combined with zero_hpz"):
        parse_ds_config({"zero_optimization": {"stage": 3, "mics_shard_size": 2, "zero_hpz_partition_size": 2}})
    cfg = parse_ds_config({"elasticity": {}, "zero_optimization": {"stage": 3, "mics_shard_size": 2}})
    assert cfg.warnings == (
        "ds_config: elasticity: removed in DeepSpeed 0.19.8, which refuses it (older versions accept it); ignored",
        "ds_config: zero_optimization.mics_shard_size: MiCS was removed in DeepSpeed 0.19.8, which refuses the "
        "key; commsim models MiCS as DeepSpeed 0.9-0.18 ran it",
    )


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.sampled_from([1, 2, 4]), st.data(), st.booleans(), st.booleans())
def test_hierarchical_schedules_are_valid_and_reduce_each_gradient_once(nodes, gpn, data, mics, offload):
    world = nodes * gpn
    divisors = [d for d in range(2, world + 1) if world % d == 0 and (d <= gpn or d % gpn == 0)]
    zero = {"reduce_bucket_size": data.draw(st.integers(1000, 50000)), **NOTHING_LIVE}
    size = data.draw(st.sampled_from(divisors)) if divisors else 1
    if size > 1:
        zero["mics_shard_size" if mics else "zero_hpz_partition_size"] = size
        if mics and size > gpn:
            zero["mics_hierarchical_params_gather"] = data.draw(st.booleans())
    if offload and not (mics and size > 1):
        zero["offload_optimizer"] = {"device": "cpu"}
    s = gen(World(nodes, gpn), **zero)
    assert validate(s) == []
    shard = size if (mics and size > 1) else world
    for r in range(world):
        rs = colls(s.program_of(r), O.CollectiveKind.REDUCE_SCATTER)
        assert sum(op.size_bytes for op in rs) == sum(shard * ceil(p.numel / shard) * 2 for p in MD.registered_params())
        assert all(r in op.group and len(op.group) == shard for op in rs)
