"""Simulator properties over generated ZeRO-3 schedules of small random models."""

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from commsim.hardware.costs import SpecCostModel
from commsim.hardware.specs import cluster_preset
from commsim.ir import ops as O
from commsim.sim.engine import SimConfig, Simulator
from commsim.strategies import World, generate
from commsim.strategies.dsconfig import parse_ds_config
from commsim.strategies.knobs import KNOB_PRESETS
from tests.strategies.test_zero3 import ZERO_KEYS, small_models


class ScaledLinks(SpecCostModel):
    def __init__(self, cluster, factor):
        super().__init__(cluster)
        self.factor = factor

    def link_capacity(self, link):
        return super().link_capacity(link) * self.factor


@st.composite
def scenarios(draw):
    md = draw(small_models())
    nodes, gpn = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    cfg = parse_ds_config({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, **draw(ZERO_KEYS)}})
    sched = generate(md, World(nodes, gpn), cfg, KNOB_PRESETS[draw(st.sampled_from(["baseline", "optimized"]))],
                     checkpointing=draw(st.booleans()))
    cluster = cluster_preset(draw(st.sampled_from(["p4d", "dgx-h100"])), nodes, draw(st.sampled_from(["efa", "ib"])),
                             gpn)
    return sched, cluster


@settings(max_examples=40, deadline=None)
@given(scenarios())
def test_step_time_bounded_below_by_compute_and_busiest_link(sc):
    sched, cluster = sc
    cost = SpecCostModel(cluster)
    res = Simulator(sched, cost, SimConfig(mode="symmetric")).run()
    prog = sched.program_of(0)
    compute = sum(cost.compute_ns(op) for op in prog.step if isinstance(op, O.Compute) and op.stream == "compute")
    link_bytes = defaultdict(float)
    for op in prog.step:
        if isinstance(op, O.Collective):
            for link, b in cost.collective(op).demands:
                if link.node == 0:
                    link_bytes[link] += b
    busiest = max((b / cost.link_capacity(l) * 1e9 for l, b in link_bytes.items()), default=0)
    assert res.step_time_ns >= compute
    assert res.step_time_ns >= int(busiest) - 1


@settings(max_examples=30, deadline=None)
@given(scenarios(), st.sampled_from([1.5, 2.0, 10.0]))
def test_more_bandwidth_never_makes_a_step_slower(sc, factor):
    sched, cluster = sc
    slow = Simulator(sched, ScaledLinks(cluster, 1.0), SimConfig(mode="symmetric")).run().step_time_ns
    fast = Simulator(sched, ScaledLinks(cluster, factor), SimConfig(mode="symmetric")).run().step_time_ns
    assert fast <= slow


@settings(max_examples=15, deadline=None)
@given(scenarios(), st.integers(0, 10**6))
def test_same_seed_same_result(sc, seed):
    sched, cluster = sc
    runs = [Simulator(sched, SpecCostModel(cluster), SimConfig(mode="per-rank", seed=seed, jitter=0.05)).run()
            for _ in range(2)]
    assert runs[0].step_time_ns == runs[1].step_time_ns
    key = [[(r.op.id, r.stream, r.start_ns, r.end_ns) for r in rr.records] for rr in runs[0].ranks.values()]
    assert key == [[(r.op.id, r.stream, r.start_ns, r.end_ns) for r in rr.records] for rr in runs[1].ranks.values()]
