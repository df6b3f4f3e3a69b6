"""How NCCL cuts a collective into network messages, and what a per-message cost adds
(commsim/hardware/nccl_messages.py and its use in nccl.py). Exact behaviour."""

from dataclasses import replace

import pytest

from commsim.hardware.costs import SpecCostModel
from commsim.hardware.nccl_messages import (Messages, message_extra_us, network_messages, tree_chunk_bytes,
                                            tree_depth)
from commsim.hardware.specs import EFA_P4D, cluster_preset
from commsim.ir import ops as O

AR, AG, RS, BC = (O.CollectiveKind.ALL_REDUCE, O.CollectiveKind.ALL_GATHER, O.CollectiveKind.REDUCE_SCATTER,
                  O.CollectiveKind.BROADCAST)
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def test_tree_depth_is_nccls_approximation():
    assert tree_depth(16, 2) == 8  # 7 chain hops + 1 across two nodes
    assert tree_depth(8, 1) == 7
    assert tree_depth(64, 8) == 10
    assert tree_depth(256, 32) == 12


@pytest.mark.parametrize("size, chunk", [
    (1 * MiB, 32 * KiB),  # 128 KiB a channel: halved to the last floor
    (4 * MiB, 64 * KiB),  # 512 KiB a channel: 8 chunks of 64 KiB are not below depth 8
    (16 * MiB, 64 * KiB),
    (32 * MiB, 128 * KiB),  # 4 MiB a channel: 32 chunks, not below depth x 4
    (128 * MiB, 256 * KiB),  # 64 chunks of 256 KiB = depth x 8
    (256 * MiB, 512 * KiB),  # a whole step
])
def test_tree_chunk_halves_while_a_channel_has_too_few_chunks_for_the_depth(size, chunk):
    assert tree_chunk_bytes(size, 8, 8) == chunk


def test_tree_messages_are_chunks_of_each_channels_share():
    m = network_messages("tree", AR, 16 * MiB, 16, 2, 8)
    assert m == Messages(32, 2 * MiB)  # 2 MiB a channel in 64 KiB chunks


def test_ring_messages_count_every_step_and_slice():
    # 64 MiB over 64 ranks on 8 nodes: 1 MiB a rank, 128 KiB a channel in one loop,
    # cut into two 64 KiB slices; 126 steps over every link
    m = network_messages("ring", AR, 64 * MiB, 64, 8, 8)
    assert m == Messages(126 * 2, 126 * MiB / 8)
    # a chunk of 64 KiB or less is one slice (slices are at least 32 KiB)
    assert network_messages("ring", AG, 4 * MiB, 64, 8, 8).count == 63
    # beyond 2 MiB a channel the rank's share takes more loops, each a full chunk
    big = network_messages("ring", RS, 8 * GiB, 64, 8, 8)
    assert big.count == 63 * 8 * 2 and big.data_bytes == 63 * (8 * GiB / 64) / 8
    # a broadcast is one pass: the buffer once over each link
    assert network_messages("ring", BC, 64 * MiB, 64, 8, 8) == Messages(4 * 2, 8 * MiB)


def test_no_network_no_messages():
    assert network_messages("ring", AR, 64 * MiB, 8, 1, 24) == Messages(0, 0.0)
    assert network_messages("nvls_tree", AR, 64 * MiB, 16, 2, 32) == Messages(0, 0.0)


def test_extra_is_the_per_message_cost_beyond_the_efficiency():
    line = 6.25e9
    # 32 messages of 64 KiB: 31 x 14.5 us, less what the 0.85 efficiency already charges
    m = Messages(32, 2 * MiB)
    assert message_extra_us(m, 14.5, line, 0.85) == pytest.approx(31 * 14.5 - 2 * MiB / line * (1 / 0.85 - 1) * 1e6)
    # messages of the size the efficiency was measured at cost nothing more
    assert message_extra_us(Messages(256, 256 * 512 * KiB), 14.5, line, 0.853) == 0.0
    assert message_extra_us(m, 0.0, line, 0.85) == 0.0  # no per-message cost
    assert message_extra_us(Messages(1, 64 * KiB), 14.5, line, 0.85) == 0.0  # one message: in the latency


def test_p4d_mid_size_all_reduce_pays_its_messages_and_ib_does_not():
    coll = O.Collective(O.OpId(1), "c", "x", AR, 16 * MiB, O.DType.FP32, tuple(range(16)), O.ReduceOp.SUM)
    cl = cluster_preset("p4d", 2, stack="2023")
    efa = SpecCostModel(cl)
    no_msg = replace(cl, node=replace(cl.node, fabric=replace(EFA_P4D, message_ns=0)))
    with_cost, without = efa.collective(coll), SpecCostModel(no_msg).collective(coll)
    assert with_cost.algorithm == without.algorithm == "tree/Simple"
    extra = message_extra_us(Messages(32, 2 * MiB), 14.5, 6.25e9, 0.85)
    assert with_cost.latency_ns - without.latency_ns == pytest.approx(extra * 1000, abs=1)
    ib = cluster_preset("dgx-a100", 2)
    assert ib.node.fabric.message_ns == 0


def test_messages_are_counted_over_the_channels_that_run():
    # a 64 KiB all-gather over 8 p4d nodes (2023 stack: Simple only) runs on 2 of the 8
    # channels (enqueue.cc: 64 KiB < 3 x 512 threads x 64 B): each channel's ring
    # carries 512 B a step, one message of each of its 63 steps
    cl = cluster_preset("p4d", 8, stack="2023")
    m = SpecCostModel(cl)
    coll = O.Collective(O.OpId(1), "c", "x", AG, 64 * KiB, O.DType.FP32, tuple(range(64)))
    opt = {o.name: o for o in m.nccl.options(coll, m.node_of, m.link_capacity)}
    ring = opt["ring/Simple"]
    assert ring.channels == 2
    no_msg = replace(cl, node=replace(cl.node, fabric=replace(EFA_P4D, message_ns=0)))
    m0 = SpecCostModel(no_msg)
    ring0 = {o.name: o for o in m0.nccl.options(coll, m0.node_of, m0.link_capacity)}["ring/Simple"]
    extra = message_extra_us(network_messages("ring", AG, 64 * KiB, 64, 8, 2), 14.5, 6.25e9, 0.85)
    assert extra == pytest.approx(62 * 14.5 - 63 * (KiB / 2) / 6.25e9 * (1 / 0.85 - 1) * 1e6)
    assert ring.latency_us - ring0.latency_us == pytest.approx(extra)


def test_ll_and_ll128_messages_pay_nothing():
    # the early-2022 stack leaves NCCL LL and LL128 over p4d's EFA; their flags ride in the
    # data (no receive flush), so only Simple's options change with the per-message cost
    cl = cluster_preset("p4d", 8)
    no_msg = replace(cl, node=replace(cl.node, fabric=replace(EFA_P4D, message_ns=0)))
    coll = O.Collective(O.OpId(1), "c", "x", AG, 4 * MiB, O.DType.BF16, tuple(range(64)))
    with_cost, without = ({o.name: o.latency_us for o in m.nccl.options(coll, m.node_of, m.link_capacity)}
                          for m in (SpecCostModel(cl), SpecCostModel(no_msg)))
    assert {"ring/LL", "ring/LL128", "ring/Simple"} <= set(with_cost)
    assert with_cost["ring/LL"] == without["ring/LL"] and with_cost["ring/LL128"] == without["ring/LL128"]
    assert with_cost["ring/Simple"] > without["ring/Simple"]
