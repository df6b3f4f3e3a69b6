"""NCCL's decisions and their costs (commsim/hardware/nccl.py, nccl_tuning.py, stacks.py):
which algorithm / protocol / channels a call gets, the bytes it puts on links, and its
latency, per software stack. Exact behaviour, not published accuracy (that is
bench/validate_published.py's)."""

import pytest

from commsim.hardware.costs import SpecCostModel
from commsim.hardware.links import Link, LinkKind
from commsim.hardware.nccl import _dtree, dtree_shape, log2i
from commsim.hardware.nccl_messages import message_extra_us, network_messages
from commsim.hardware.nccl_tuning import NCCL_2_10, NCCL_2_18
from commsim.hardware.specs import EFA_P3DN, EFA_P4D, EFA_P5, NODE_PRESETS, cluster_preset
from commsim.hardware.stacks import STACKS
from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError

AR, AG, RS = O.CollectiveKind.ALL_REDUCE, O.CollectiveKind.ALL_GATHER, O.CollectiveKind.REDUCE_SCATTER
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def coll(kind, size, ranks):
    red = O.ReduceOp.SUM if kind in (AR, RS) else None
    return O.Collective(O.OpId(1), "c", "x", kind, size, O.DType.BF16, tuple(ranks), red)


def plan(cluster, kind, size, ranks=None):
    m = SpecCostModel(cluster)
    return m.collective(coll(kind, size, range(cluster.world_size) if ranks is None else ranks))


def tuner_times(cluster, kind, size):
    m = SpecCostModel(cluster)
    return {o.name: o.tuner_us for o in m.nccl.options(coll(kind, size, range(cluster.world_size)), m.node_of,
                                                       m.link_capacity)}


# ---------------------------------------------------------------- NCCL's double binary tree


def test_double_binary_tree_follows_ncclGetDtree():
    # trees.cc's picture for 12 ranks: 0 is the root with one child (8); the mirror tree's
    # root is 11 (0's mirror), and 0 is a leaf under 1
    assert _dtree(12, 0) == ((-1, (8,)), (1, ()))
    assert _dtree(12, 8) == ((0, (4, 10)), (9, ()))
    # odd counts shift the second tree by one: 13 ranks, root 1 with child 9
    assert _dtree(13, 1) == ((2, ()), (-1, (9,)))
    assert _dtree(13, 0) == ((-1, (8,)), (9, (11,)))


def test_tree_edges_and_height_by_node_count():
    # (most edges any node has over both trees, the deeper tree's height)
    assert dtree_shape(1) == (0, 0)
    assert dtree_shape(2) == (2, 1)  # each node: one edge per tree
    assert dtree_shape(3) == (3, 2)
    assert dtree_shape(4) == (4, 2)  # an inner node in one tree, a leaf in the other
    assert dtree_shape(8) == (4, 3)
    assert dtree_shape(32) == (4, 5)
    assert [log2i(n) for n in (0, 1, 2, 3, 4, 32)] == [0, 0, 1, 1, 2, 5]


def test_tree_traffic_is_the_buffer_once_at_two_nodes_and_twice_from_three_up():
    s = GiB
    two = plan(cluster_preset("p4d", 2), AR, s)
    assert two.algorithm == "tree/Simple"
    assert dict(two.demands)[Link(LinkKind.NIC, 1)] == pytest.approx(s)  # S/2 over 2 edges, each way
    assert dict(two.demands)[Link(LinkKind.NVLINK, 0)] == pytest.approx(2 * s * 7 / 8)  # the chain, up and down
    four = SpecCostModel(cluster_preset("p4d", 4))
    opts = {o.name: o for o in four.nccl.options(coll(AR, s, range(32)), four.node_of, four.link_capacity)}
    assert dict(opts["tree/Simple"].demands)[Link(LinkKind.NIC, 3)] == pytest.approx(2 * s)
    # a ring carries 2(p-1)/p of the buffer: at 4 nodes the tree is no longer cheaper
    assert dict(opts["ring/Simple"].demands)[Link(LinkKind.NIC, 3)] == pytest.approx(2 * s * 31 / 32)
    assert plan(cluster_preset("p4d", 4), AR, 4 * GiB).algorithm == "ring/Simple"


# ---------------------------------------------------------------- choices per size and stack


def test_early_2022_stack_on_two_p4d_nodes_picks_by_size():
    cl = cluster_preset("p4d", 2)  # NCCL 2.11 + aws-ofi-nccl 1.2: every protocol, no plugin latency
    assert [plan(cl, AR, s).algorithm for s in (8, 64 * KiB, MiB, 64 * MiB, GiB)] == \
        ["tree/LL", "tree/LL", "tree/LL128", "tree/LL128", "tree/Simple"]
    # (64 MiB: the tree's LL128 correction is 0.9 there, Simple's 0.7 (treeCorrectionFactor
    # index 20 in the 2.10.3 binary); at 1 GiB LL128's 120/128 wire cost decides)
    # NCCL 2.10's tuner: tree LL = 4.4 + 2 x (7 x 0.52 + 1 x 5.0) us; ring LL pays the
    # network hop (2.7 us) on all 30 steps (plus 8 bytes' worth of bandwidth: < 0.01 us)
    t = tuner_times(cl, AR, 8)
    assert t["tree/LL"] == pytest.approx(4.4 + 2 * (7 * 0.52 + 5.0), abs=0.01)
    assert t["ring/LL"] == pytest.approx(3.6 + 30 * 2.7, abs=0.01)


def test_the_plugin_leaves_p4d_simple_only_from_aws_ofi_nccl_1_7():
    for stack in ("2023", "2025"):
        cl = cluster_preset("p4d", 2, stack=stack)
        assert set(tuner_times(cl, AR, MiB)) == {"ring/Simple", "tree/Simple"}
    # its RDMA transport on p5: LL stays, LL128 goes
    assert {n.split("/")[1] for n in tuner_times(cluster_preset("p5", 2, stack="2023"), AR, MiB)} == {"LL", "Simple"}
    # NCCL's own rule on one node: LL128 on Ampere, on Hopper from 2.18
    assert "ring/LL128" in tuner_times(cluster_preset("p4d", 1), AR, MiB)
    assert "ring/LL128" not in tuner_times(cluster_preset("dgx-h100", 1, stack="early-2022"), AR, MiB)
    assert "ring/LL128" in tuner_times(cluster_preset("dgx-h100", 1, stack="2023"), AR, MiB)
    # p3dn's EFA has no GPUDirect RDMA: no LL128 across nodes, on any stack
    assert "ring/LL128" not in tuner_times(cluster_preset("p3dn", 2), AR, MiB)


def test_the_stack_changes_a_mid_size_all_gather_on_eight_p4d_nodes():
    early = plan(cluster_preset("p4d", 8), AG, MiB)
    later = plan(cluster_preset("p4d", 8, stack="2023"), AG, MiB)
    assert (early.algorithm, later.algorithm) == ("ring/LL", "ring/Simple")
    # LL: 8 data bytes per 16-byte line, so twice the bytes on the wire
    assert dict(early.demands)[Link(LinkKind.NIC, 0)] == pytest.approx(2 * MiB * 63 / 64)
    assert dict(later.demands)[Link(LinkKind.NIC, 0)] == pytest.approx(MiB * 63 / 64)


def test_nvls_on_one_hopper_node_where_the_nccl_version_has_it():
    assert plan(cluster_preset("dgx-h100", 1, stack="2023"), AR, GiB).algorithm == "nvls/Simple"
    assert plan(cluster_preset("dgx-h100", 1, stack="early-2022"), AR, GiB).algorithm == "ring/Simple"
    assert all(not n.startswith("nvls") for n in tuner_times(cluster_preset("azure-ndm-a100", 1), AR, GiB))
    assert plan(cluster_preset("p5", 2), AR, GiB).algorithm == "nvls_tree/Simple"
    # NVLS runs Simple only, and all-reduce only
    assert {n for n in tuner_times(cluster_preset("dgx-h100", 1, stack="2023"), AR, GiB) if n.startswith("nvls")} \
        == {"nvls/Simple"}
    assert all(n.startswith("ring") for n in tuner_times(cluster_preset("dgx-h100", 1, stack="2023"), AG, GiB))


def test_nvls_moves_about_the_buffer_each_way_through_each_port():
    p = plan(cluster_preset("dgx-h100", 1, stack="2023"), AR, GiB)
    assert dict(p.demands)[Link(LinkKind.NVLINK, 0)] == pytest.approx(GiB * 9 / 8)


# ---------------------------------------------------------------- latency per stack


def test_plugin_reported_latency_is_per_instance_and_per_stack():
    early, mid, cur = STACKS["early-2022"], STACKS["2023"], STACKS["2025"]
    assert early.plugin_latency_us("p4d.24xlarge") == 0.0  # NCCL 2.11's net API has no latency field
    assert mid.plugin_latency_us("p4d.24xlarge") == 75.0
    assert mid.plugin_latency_us("p3dn.24xlarge") == 150.0
    assert cur.plugin_latency_us("p5.48xlarge") == 75.0
    assert not mid.tuner_on("p5.48xlarge") and cur.tuner_on("p5.48xlarge") and not cur.tuner_on("p4d.24xlarge")
    # NCCL 2.18's tuner adds it to each network hop, twice for Simple (the flush)
    t = tuner_times(cluster_preset("p4d", 2, stack="2023"), AR, 8)
    assert t["tree/Simple"] == pytest.approx(0.0 + 2 * (7 * 4.0 + 1 * (14.0 + 2 * 75.0)), abs=1e-3)


def test_each_efa_instance_has_its_own_crossing_latency():
    assert (EFA_P3DN.latency_ns, EFA_P4D.latency_ns, EFA_P5.latency_ns) == (36_000, 20_000, 23_000)
    assert NODE_PRESETS["p4d"].fabric is EFA_P4D and NODE_PRESETS["p3dn"].fabric is EFA_P3DN


def hops_us(cluster, kind, size, name):
    """The executed hop latency (us) of option ``name``: without the protocol's bandwidth shortfall."""
    m = SpecCostModel(cluster)
    o = coll(kind, size, range(cluster.world_size))
    return {x.name: x.latency_us for x in m.nccl.options(o, m.node_of, m.link_capacity)}[name]


def test_executed_latency_counts_real_crossings():
    # tree LL over two p5 nodes (NCCL 2.27 = 2.18's constants): 6.8 + 2 x (7 x 0.6 + (5.0 + 23)) us,
    # the plugin's reported 75 us nowhere: it only steers the tuner
    p5 = cluster_preset("p5", 2)
    assert plan(p5, AR, 8).algorithm == "tree/LL"
    assert hops_us(p5, AR, 8, "tree/LL") == pytest.approx(6.8 + 2 * (7 * 0.6 + 5.0 + 23.0))
    # a Simple crossing pays the fabric's latency twice: tree Simple over two p4d nodes
    p4d = cluster_preset("p4d", 2, stack="2023")
    assert plan(p4d, AR, 8).algorithm == "tree/Simple"
    assert hops_us(p4d, AR, 8, "tree/Simple") == pytest.approx(2 * (7 * 4.0 + 14.0 + 2 * 20.0))
    # a ring all-gather over 8 nodes crosses 8 boundaries on its longest path: 63 steps
    # (Simple ring at full bandwidth on all 8 channels: nothing beyond the links but the
    # 63 network messages of each channel, nccl_messages)
    r = plan(cluster_preset("p4d", 8, stack="2023"), AG, MiB)
    msgs = message_extra_us(network_messages("ring", AG, MiB, 64, 8, 8), 14.5, 6.25e9, 0.85)
    assert msgs > 0
    assert r.latency_ns == round((8.4 + 55 * 3.4 + 8 * (14.0 + 2 * 20.0) + msgs) * 1000)


def test_ring_plateau_multiplies_multi_node_simple_all_reduce_latency():
    cl = cluster_preset("p4d", 4)
    m = SpecCostModel(cl)
    opt = {o.name: o for o in m.nccl.options(coll(AR, 64 * MiB, range(32)), m.node_of, m.link_capacity)}
    ring = opt["ring/Simple"]
    # NCCL 2.10 hops, 8 real crossings, then x1.4 on Ampere ("Plateau effect of ring"),
    # then EFA's per-message cost, which NCCL's model does not hold
    msgs = message_extra_us(network_messages("ring", AR, 64 * MiB, 32, 4, 8), 14.5, 6.25e9, 0.85)
    assert ring.latency_us == pytest.approx(1.4 * (8.4 + (62 - 8) * 3.4 + 8 * (9.6 + 2 * 20.0)) + msgs)


# ---------------------------------------------------------------- bandwidth model


def test_protocol_slowness_beyond_the_links_is_latency_not_bytes():
    # one A100 node, 1 KiB: LL is picked (NCCL 2.10: 3.6 + 14 x 0.47 us); its wire bytes
    # are demands, what LL's 1/4-of-bus model adds beyond them is latency
    cl = cluster_preset("p4d", 1)
    m = SpecCostModel(cl)
    p = m.collective(coll(AR, KiB, range(8)))
    assert p.algorithm == "ring/LL" and p.sms == 1  # 1 KiB < one channel's threshold
    nvl = dict(p.demands)[Link(LinkKind.NVLINK, 0)]
    assert nvl == pytest.approx(2 * KiB * 14 / 8)
    link_s = nvl / m.link_capacity(Link(LinkKind.NVLINK, 0))
    # LL ring: busbw min(87.7 GB/s, 234/4) x 8/14, on 1 of 24 channels
    bw = min(87.7e9, m.nvl_bw / 4) * 8 / 14 / 24
    assert p.latency_ns == round((3.6 + 14 * 0.47) * 1000 + (KiB / bw - link_s) * 1e9)


def test_small_messages_run_on_fewer_channels():
    cl = cluster_preset("p4d", 2, stack="2023")
    assert plan(cl, AR, 8).sms == 1
    assert plan(cl, AR, 64 * KiB).sms == 2  # Simple: 512 threads x 64 B per channel
    assert plan(cl, AR, GiB).sms == 8  # across nodes: 2 per NIC (published-runs.md X5)
    assert plan(cluster_preset("dgx-a100", 2), AR, GiB).sms == 16
    assert plan(cluster_preset("p4d", 1), AR, GiB).sms == 24


def test_tree_correction_slows_medium_trees():
    cl = cluster_preset("p4d", 2, stack="2023")
    m = SpecCostModel(cl)
    opt = {o.name: o for o in m.nccl.options(coll(AR, MiB, range(16)), m.node_of, m.link_capacity)}
    tree = opt["tree/Simple"]
    # 1 MiB: log2(2^20 / 64) = 14, factor 0.5 for Simple: 92% of the NIC, halved
    assert tree.bw_bytes_per_s == pytest.approx(0.92 * m.nic_bw * 0.5)
    assert NCCL_2_18.tree_correction["Simple"][14] == 0.5 and NCCL_2_10.tree_correction["LL128"][14] == 0.6


def test_one_rank_and_stack_presets():
    assert plan(cluster_preset("p4d", 1), AR, MiB, ranks=(3,)).algorithm == "local"
    assert cluster_preset("p4d", 2, stack="2025").node.stack is STACKS["2025"]
    assert cluster_preset("p4d", 2).node.stack is STACKS["early-2022"]  # the seed scenario's
    assert "NCCL 2.11 + aws-ofi-nccl 1.2" in cluster_preset("p4d", 2).name
    assert "aws-ofi-nccl" not in cluster_preset("p4d", 2, "ib").name
    with pytest.raises(CommsimInputError, match=r"--nccl-stack '2019': allowed: early-2022, 2023, 2025"):
        cluster_preset("p4d", 2, stack="2019")
