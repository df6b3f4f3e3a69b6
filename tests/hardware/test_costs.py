"""Cost functions from specs and from measured profiles."""

import json

import pytest

from commsim.hardware.costs import Link, LinkKind, SpecCostModel
from commsim.hardware.profile_doc import load_profile, mean_profile, profile_from_dict
from commsim.hardware.specs import NODE_PRESETS, cluster_preset
from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError


def ag(size, group):
    return O.Collective(O.OpId(1), "ag", "x", O.CollectiveKind.ALL_GATHER, size, O.DType.BF16, tuple(group))


def test_node_fabric_bandwidths_from_specs():
    efa = SpecCostModel(cluster_preset("p4d", 2))
    ib = SpecCostModel(cluster_preset("p4d", 2, "ib"))
    assert efa.nic_bw == pytest.approx(4 * 12.5e9 * 0.85)  # 4x100 Gb/s EFA at 85%
    assert ib.nic_bw == pytest.approx(8 * 25e9 * 0.96)  # 8x200 Gb/s HDR at 96%
    assert efa.nvl_bw == pytest.approx(300e9 * 0.78)


def test_collectives_go_to_the_nccl_model_with_link_capacities():
    m = SpecCostModel(cluster_preset("p4d", 2))
    plan = m.collective(ag(1 << 30, range(16)))
    assert plan.algorithm == "ring/Simple"  # details: tests/hardware/test_nccl.py
    assert dict(plan.demands)[Link(LinkKind.NIC, 0)] == pytest.approx((1 << 30) * 15 / 16)
    assert m.link_capacity(Link(LinkKind.NIC, 0)) == m.nic_bw and m.link_capacity(Link(LinkKind.NVLINK, 0)) == m.nvl_bw


def gemm(m, n, k, batch=1, dt=2):
    return O.Compute(O.OpId(1), "c", "", O.ComputeKind.GEMM, 2 * m * n * k * batch,
                     (m * k + k * n) * batch * dt, m * n * batch * dt, O.GemmShape(m, n, k, batch))


def test_gemm_main_loop_by_wave_quantisation_and_its_output_after_it():
    m = SpecCostModel(cluster_preset("p4d", 1))
    bw = 1555e9 * 0.83  # A100-40GB HBM at M1's STREAM fraction
    big = gemm(8192, 8192, 8192)
    # 64 x 64 = 4096 tiles over 108 SMs: 38 waves, 99.8% wave efficiency; G2's ceiling 256.5 / 312
    main = 2 * 8192**3 / (312e12 * (256.5 / 312) * (4096 / (38 * 108)))
    assert m.compute_ns(big) == 4000 + int((main + big.bytes_written / bw) * 1e9)
    small = gemm(256, 256, 8192)
    # 4 tiles on 108 SMs: 4/108 efficiency
    main = 2 * 256 * 256 * 8192 / (312e12 * (256.5 / 312) * 4 / 108)
    assert m.compute_ns(small) == 4000 + int((main + small.bytes_written / bw) * 1e9)
    # attention's score bmm: its output (the scores) is large beside its flops (G3)
    score, av = gemm(2048, 2048, 256, 64), gemm(2048, 256, 2048, 64)
    assert score.flops == av.flops and m.compute_ns(score) > 1.5 * m.compute_ns(av)


def test_gemm_misaligned_leading_dimension_and_precisions():
    m = SpecCostModel(cluster_preset("dgx-h100", 1))
    k = m.kernels
    aligned, odd_n, odd_m = O.GemmShape(8192, 10944, 4096), O.GemmShape(8192, 10922, 4096), O.GemmShape(10922, 8192, 4096)
    assert k.gemm_efficiency(odd_n) == pytest.approx(k.gemm_efficiency(aligned) * 272.7 / 398.4, rel=1e-2)  # G5
    assert k.gemm_efficiency(odd_m) == pytest.approx(k.gemm_efficiency(aligned), rel=1e-2)  # m is no leading dim
    g = O.GemmShape(4096, 4096, 4096)
    # fp32 matmuls on CUDA cores (no TF32 by default), TF32 at half the 16-bit tensor peak
    assert SpecCostModel(cluster_preset("p4d", 1), "fp32").kernels.gemm_rate(g) == pytest.approx(
        19.5e12 * SpecCostModel(cluster_preset("p4d", 1)).kernels.gemm_efficiency(g))
    assert SpecCostModel(cluster_preset("p4d", 1), "tf32").kernels.gemm_rate(g) == pytest.approx(
        156e12 * SpecCostModel(cluster_preset("p4d", 1)).kernels.gemm_efficiency(g))
    # V100: bf16 emulated at about 10 TFLOPS (G4), fp16 on tensor cores
    v100 = cluster_preset("p3dn", 1)
    assert SpecCostModel(v100, "bf16").kernels.gemm_rate(g) == 10e12
    assert SpecCostModel(v100, "fp16").kernels.gemm_rate(g) > 80e12
    with pytest.raises(ValueError, match="precision 'int8'"):
        SpecCostModel(v100, "int8")


def test_fused_attention_at_flash_attentions_measured_rate():
    """SDPA's fused kernel: its flops at M3's FlashAttention-2 fraction of the 16-bit peak
    on A100 and H100; without that figure (V100) or in fp32, its score matmul's GEMM rate."""
    b, heads, s, hd = 2, 32, 4096, 128
    g = O.GemmShape(s, s, hd, b * heads)
    flops = 4 * b * heads * s * s * hd // 2  # causal: the half it computes
    q = b * heads * s * hd * 2
    op = O.Compute(O.OpId(1), "c", "", O.ComputeKind.ATTENTION, flops, 3 * q, q + b * heads * s * 4, g)
    a100 = SpecCostModel(cluster_preset("p4d", 1))
    assert a100.compute_ns(op) == 4000 + int(flops / (312e12 * 179.5 / 312) * 1e9)
    h100 = SpecCostModel(cluster_preset("dgx-h100", 1))
    assert h100.compute_ns(op) == 4000 + int(flops / (989e12 * 327.9 / 989) * 1e9)
    v100 = SpecCostModel(cluster_preset("p3dn", 1), "fp16")
    assert v100.compute_ns(op) == 4000 + int(flops / v100.kernels.gemm_rate(g) * 1e9)
    fp32 = SpecCostModel(cluster_preset("p4d", 1), "fp32")
    assert fp32.compute_ns(op) == 4000 + int(flops / fp32.kernels.gemm_rate(g) * 1e9)


def test_memory_bound_kernels_at_their_class_bandwidth():
    m = SpecCostModel(cluster_preset("p4d", 1))
    n = 2**28

    def t(kind):
        return m.compute_ns(O.Compute(O.OpId(1), "c", "", kind, n, n, n))

    hbm = 1555e9
    for kind, eff in ((O.ComputeKind.ELEMENTWISE, 0.83), (O.ComputeKind.REDUCTION, 0.83), (O.ComputeKind.NORM, 0.46),
                      (O.ComputeKind.SOFTMAX, 0.71), (O.ComputeKind.DROPOUT, 0.72)):
        assert t(kind) == 4000 + int(2 * n / (hbm * eff) * 1e9), kind


def test_net_switch_keeps_the_node():
    c = cluster_preset("p4d", 4, "ib")
    assert c.node.gpu == NODE_PRESETS["p4d"].gpu and c.node.fabric.kind == "ib"
    with pytest.raises(CommsimInputError, match=r"--cluster 'p6': allowed: p4d, p5"):
        cluster_preset("p6", 1)


PROFILE = {
    "kind": "commsim-hw-profile", "schema_version": 2, "description": "test", "backend": "gloo",
    "devices": ["CPU: test"], "world_size": 2, "ranks_per_node": 2, "nodes": 1,
    "memory_bytes": 1 << 33, "kernel_overhead_ns": 1000,
    "gemm": [[1e6, 1e9], [1e9, 1e10]], "elementwise_bytes_per_s": 2e9,
    "copy": {"d2d_bytes_per_s": 4e9, "h2d_bytes_per_s": 4e9, "latency_ns": 100},
    "collectives": {"all_gather": {"intra_node": {"2": {"latency_ns": 200000, "bytes_per_s": 1e9}}},
                    "reduce_scatter": {"intra_node": {"2": {"latency_ns": 250000, "bytes_per_s": 5e8}}}},
    "comm_slowdown": 1.5,
    "alloc": {"malloc_base_ns": 5000, "malloc_ns_per_byte": 0, "free_base_ns": 5000, "free_ns_per_byte": 0},
}


def test_profile_costs(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(PROFILE))
    p = load_profile(path)
    plan = p.collective(ag(10**6, (0, 1)))
    assert plan.latency_ns == 200000
    assert plan.demands == ((Link(LinkKind.CHANNEL, 0), 1e-3 * 1e9),)  # 1 MB at 1 GB/s = 1 ms of link time
    rs = O.Collective(O.OpId(1), "r", "x", O.CollectiveKind.REDUCE_SCATTER, 10**6, O.DType.BF16, (0, 1),
                      reduce_op=O.ReduceOp.SUM)
    assert dict(p.collective(rs).demands)[Link(LinkKind.CHANNEL, 0)] == pytest.approx(2e-3 * 1e9)  # measured per kind
    gemm = O.Compute(O.OpId(1), "c", "", O.ComputeKind.GEMM, 10**9, 0, 0)
    assert p.compute_ns(gemm) == 1000 + int(1e9 / 1e10 * 1e9)
    ar = O.Collective(O.OpId(1), "c", "x", O.CollectiveKind.ALL_REDUCE, 8, O.DType.FP64, (0, 1),
                      reduce_op=O.ReduceOp.SUM)
    with pytest.raises(CommsimInputError, match="no measurement of all_reduce; re-run commsim calibrate"):
        p.collective(ar)


def test_a_framework_run_pays_no_executor_costs(tmp_path):
    """A profile prices commsim's executor with its own per-op costs (issue, and on CPUs
    the per-op time as each kernel's fixed cost); a framework's run of the same schedule
    pays neither (its launches are the schedule's host ops). On GPUs the fixed cost is
    the device's own and stays. predict picks by --runner, framework by default."""
    from commsim.api import Scenario, predict
    from commsim.ir.schedule import Program, Schedule
    from commsim.ir.serialize import save_schedule

    path = tmp_path / "p.json"
    path.write_text(json.dumps({**PROFILE, "issue_ns": 700, "elementwise_points": [[4096, 2e-6], [1 << 20, 5e-4]]}))
    p = load_profile(path)
    f = p.run_by_framework()
    assert (p.issue_ns, p.kernel_overhead_ns) == (700, 1000) and (f.issue_ns, f.kernel_overhead_ns) == (0, 0)
    gemm = O.Compute(O.OpId(1), "c", "", O.ComputeKind.GEMM, 10**9, 0, 0)
    assert p.compute_ns(gemm) - f.compute_ns(gemm) == 1000
    gpu = tmp_path / "g.json"
    gpu.write_text(json.dumps({**PROFILE, "backend": "nccl", "issue_ns": 700}))
    g = load_profile(gpu).run_by_framework()
    assert (g.issue_ns, g.kernel_overhead_ns) == (0, 1000)
    n = 50  # small kernels back to back: the fixed costs are the difference
    step = tuple(O.Compute(O.OpId(i + 1), "compute", "k", O.ComputeKind.ELEMENTWISE, 0, 4096, 4096) for i in range(n))
    sched = tmp_path / "s.json"
    save_schedule(Schedule.uniform(2, Program((), step)), sched)
    sc = Scenario(schedule=str(sched), nodes=1, gpus_per_node=2, hw_profile=str(path), mode="symmetric")
    ex, fw = predict(sc.with_(runner="executor")), predict(sc)
    assert fw.scenario["runner"] == "framework"
    work = p.compute_ns(step[0]) - 1000  # the table's time over its smallest size
    assert work > 0 and fw.metrics.step_time_s * 1e9 == pytest.approx(n * work, abs=2)
    assert ex.metrics.step_time_s * 1e9 == pytest.approx(n * (700 + 1000 + work), abs=2)
    assert any("executor overheads (--runner executor)" in s for s in ex.sources)
    assert not any("executor overheads" in s for s in fw.sources)
    with pytest.raises(CommsimInputError, match=r"^--runner gpu: must be one of framework, executor$"):
        predict(sc.with_(runner="gpu"))


def test_profile_collective_call_holds_the_host_by_measured_size(tmp_path):
    """call_points (CPU backends): how long the call holds the calling thread,
    interpolated by size; none measured: the call costs the host nothing here."""
    path = tmp_path / "p.json"
    rs_fit = {"latency_ns": 250000, "bytes_per_s": 5e8, "call_points": [[1 << 20, 0.002], [32 << 20, 0.032]]}
    path.write_text(json.dumps({**PROFILE, "collectives": {**PROFILE["collectives"],
                                                           "reduce_scatter": {"intra_node": {"2": rs_fit}}}}))
    p = load_profile(path)

    def rs(nbytes):
        return O.Collective(O.OpId(1), "r", "x", O.CollectiveKind.REDUCE_SCATTER, nbytes, O.DType.FP32, (0, 1),
                            reduce_op=O.ReduceOp.SUM)

    assert p.collective(rs(1 << 20)).call_ns == 2_000_000
    assert p.collective(rs((1 << 20) + (31 << 20) // 2)).call_ns == 17_000_000  # halfway: linear
    assert p.collective(ag(10**6, (0, 1))).call_ns == 0  # all-gather: not measured
    path.write_text(json.dumps({**PROFILE, "collectives": {"reduce_scatter": {"intra_node": {"2": {
        **rs_fit, "call_points": [[1, 2, 3]]}}}}}))
    with pytest.raises(CommsimInputError, match=r"collectives.reduce_scatter.intra_node.2: call_points must be a "
                                                r"list of \[bytes, seconds\] pairs"):
        load_profile(path)


def test_profile_collective_stall_is_the_in_step_table_over_the_back_to_back_one(tmp_path):
    """in_step_points (CPU backends): a collective followed by compute; its stall is what
    it takes beyond the back-to-back table, by size, never negative; without the table,
    none."""
    path = tmp_path / "p.json"
    fit = {"latency_ns": 250000, "bytes_per_s": 5e8, "points": [[4096, 0.0005], [1 << 20, 0.0015]],
           "in_step_points": [[4096, 0.0015], [1 << 20, 0.0014]]}
    path.write_text(json.dumps({**PROFILE, "collectives": {**PROFILE["collectives"],
                                                           "all_gather": {"intra_node": {"2": fit}}}}))
    p = load_profile(path)
    assert p.collective(ag(4096, (0, 1))).stall_ns == 1_000_000
    half = 4096 + ((1 << 20) - 4096) // 2  # halfway: 1.0 ms over 1.45 ms in step
    assert p.collective(ag(half, (0, 1))).stall_ns == pytest.approx(450_000, abs=1)
    assert p.collective(ag(1 << 20, (0, 1))).stall_ns == 0  # faster in step than back to back: none
    del fit["in_step_points"]
    path.write_text(json.dumps({**PROFILE, "collectives": {"all_gather": {"intra_node": {"2": fit}}}}))
    assert load_profile(path).collective(ag(4096, (0, 1))).stall_ns == 0


def test_profile_measured_gemm_shapes_take_precedence(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**PROFILE, "gemm_shapes_by_dtype": {"fp32": [[512, 8000, 512, 1, 2e10]],
                                                                   "bf16": [[512, 8000, 512, 1, 4e10]]}}))
    flops = 2 * 512 * 8000 * 512
    measured = O.Compute(O.OpId(1), "c", "", O.ComputeKind.GEMM, flops, 0, 0, O.GemmShape(512, 8000, 512, 1))
    other = O.Compute(O.OpId(1), "c", "", O.ComputeKind.GEMM, flops, 0, 0, O.GemmShape(8000, 512, 512, 1))
    p = load_profile(path, "fp32")
    assert p.compute_ns(measured) == 1000 + int(flops / 2e10 * 1e9)  # this very shape was timed
    assert p.compute_ns(other) == 1000 + int(flops / p._gemm_rate(flops) * 1e9)  # by flops
    assert load_profile(path, "bf16").compute_ns(measured) == 1000 + int(flops / 4e10 * 1e9)
    path.write_text(json.dumps({**PROFILE, "gemm_shapes_by_dtype": {"fp32": [[512, 8000, 512, 1]]}}))
    with pytest.raises(CommsimInputError, match=r"gemm_shapes_by_dtype.fp32: rows are \[m, n, k, batch, flops_per_s\]"):
        load_profile(path, "fp32")


def test_bad_profile(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**PROFILE, "comm_slowdown": -1}))
    with pytest.raises(CommsimInputError, match=r"p.json: field 'comm_slowdown' must be a positive number, got -1"):
        load_profile(path)


def test_profile_collective_slowdowns_while_computing(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(PROFILE))
    p = load_profile(path)
    assert (p.comm_slowdown_during_compute, p.comm_latency_slowdown_during_compute) == (1.0, 1.0)  # not measured
    path.write_text(json.dumps({**PROFILE, "comm_slowdown_during_compute": 1.8,
                                "comm_latency_slowdown_during_compute": 2.5}))
    p = load_profile(path)
    assert (p.comm_slowdown_during_compute, p.comm_latency_slowdown_during_compute) == (1.8, 2.5)
    path.write_text(json.dumps({**PROFILE, "comm_latency_slowdown_during_compute": 0}))
    with pytest.raises(CommsimInputError, match=r"p.json: field 'comm_latency_slowdown_during_compute' must be a "
                                                r"positive number, got 0"):
        load_profile(path)


def test_profile_rank_drift(tmp_path):
    from commsim.hardware.platform import RankDrift

    path = tmp_path / "p.json"
    path.write_text(json.dumps(PROFILE))
    p = load_profile(path)
    assert (p.rank_noise_sd, p.rank_noise_corr_ns) == (0.0, 0)  # not measured
    path.write_text(json.dumps({**PROFILE, "rank_noise": {"sd": 0.12, "corr_ns": 2.5e8}}))
    p = load_profile(path)
    assert (p.rank_noise_sd, p.rank_noise_corr_ns) == (0.12, 250_000_000)
    assert (p.rank_noise_slow_sd, p.rank_noise_slow_corr_ns) == (0.0, 0)  # an older profile: no slow component
    assert p.platform.drift == RankDrift(0.12, 250_000_000)
    path.write_text(json.dumps({**PROFILE, "rank_noise": {"sd": 0.12, "corr_ns": 2.5e8, "slow_sd": 0.05,
                                                          "slow_corr_ns": 2e9}}))
    p = load_profile(path)
    assert p.platform.drift == RankDrift(0.12, 250_000_000, 0.05, 2_000_000_000)
    path.write_text(json.dumps({**PROFILE, "rank_noise": {"sd": 0, "corr_ns": 0, "slow_sd": 0, "slow_corr_ns": 0}}))
    assert load_profile(path).rank_noise_sd == 0.0 and not load_profile(path).platform.drift  # measured: none found
    path.write_text(json.dumps({**PROFILE, "rank_noise": {"sd": 0.1, "corr_ns": 1e8, "slow_sd": 0.05}}))
    with pytest.raises(CommsimInputError,
                       match=r"p.json: rank_noise: field 'slow_corr_ns' must be a positive number, got None"):
        load_profile(path)
    path.write_text(json.dumps({**PROFILE, "rank_noise": {"sd": 0.1, "corr_ns": 0}}))
    with pytest.raises(CommsimInputError, match=r"p.json: rank_noise: field 'corr_ns' must be a positive number, got 0"):
        load_profile(path)
    path.write_text(json.dumps({**PROFILE, "rank_noise": 0.1}))
    with pytest.raises(CommsimInputError, match=r"p.json: rank_noise: must be an object"):
        load_profile(path)


def test_profile_rank_stalls(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(PROFILE))
    assert not load_profile(path).platform.stalls  # not measured: none
    path.write_text(json.dumps({**PROFILE, "rank_stalls": {"rate_per_s": 40.0, "lengths_ns": [1000, 3000.4]}}))
    p = load_profile(path)
    assert (p.rank_stalls_rate_per_s, p.rank_stalls_lengths_ns) == (40.0, (1000, 3000))
    assert p.platform.stalls.loss == pytest.approx(40 * 2000e-9)
    path.write_text(json.dumps({**PROFILE, "rank_stalls": {"rate_per_s": 0, "lengths_ns": []}}))  # measured: none
    assert not load_profile(path).platform.stalls
    path.write_text(json.dumps({**PROFILE, "rank_stalls": {"rate_per_s": 5, "lengths_ns": []}}))
    with pytest.raises(CommsimInputError, match=r"p.json: rank_stalls: lengths_ns is empty while rate_per_s is 5"):
        load_profile(path)
    path.write_text(json.dumps({**PROFILE, "rank_stalls": {"rate_per_s": 5, "lengths_ns": [-1]}}))
    with pytest.raises(CommsimInputError, match=r"p.json: rank_stalls: must be an object"):
        load_profile(path)
    path.write_text(json.dumps({**PROFILE, "rank_stalls": {"rate_per_s": -5, "lengths_ns": [1]}}))
    with pytest.raises(CommsimInputError, match=r"p.json: rank_stalls: field 'rate_per_s'"):
        load_profile(path)


def load_profile_from(tmp_path, points):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({**PROFILE, "alloc": {**PROFILE["alloc"], "points": points}}))
    return load_profile(path)


def test_profile_host_allocations_by_measured_size(tmp_path):
    """Below glibc's mmap threshold a host allocation reuses heap pages; above it, fresh
    pages: the measured table is interpolated by size, not one line through both."""
    path = tmp_path / "p.json"
    points = [[1 << 20, 1e-4], [30 << 20, 3e-3], [34 << 20, 2e-2], [64 << 20, 4e-2]]
    path.write_text(json.dumps({**PROFILE, "alloc": {**PROFILE["alloc"], "malloc_ns_per_byte": 1.0,
                                                     "points": points}}))
    p = load_profile(path)
    assert p.host_malloc_ns(1 << 20) == 100_000
    assert p.host_malloc_ns(4 << 20) == int((1e-4 + (3e-3 - 1e-4) * 3 / 29) * 1e9)
    # each regime from its own sizes, never a line between a heap size and an mmapped one:
    # 31 MiB from the heap (the heap's segment extended), 32 MiB mmapped (the mmap's)
    assert p.host_malloc_ns(31 << 20) == int((3e-3 + (3e-3 - 1e-4) / 29) * 1e9)
    assert p.host_malloc_ns(32 << 20) == int((2e-2 - (4e-2 - 2e-2) * 2 / 30) * 1e9)
    assert p.host_malloc_ns(48 << 20) == int((2e-2 + 2e-2 * 14 / 30) * 1e9)
    assert p.host_malloc_ns(128 << 20) == int(4e-2 * 2 * 1e9)  # beyond: the largest size's cost per byte
    assert p.host_malloc_ns(1 << 10) == int(1e-4 * 1e9)  # below: the smallest's cost
    # a block of which only part is ever written (torch.empty, then partly filled):
    # above glibc's 32 MiB mmap ceiling, fixed cost + the first touch of what is written
    # (the largest size's cost per byte until calibrate measured the first touch)
    assert p.host_malloc_ns(2 << 30, touch_bytes=10 << 20) == int(1e-4 * 1e9 + 4e-2 / (64 << 20) * 1e9 * (10 << 20))
    assert p.host_malloc_ns(16 << 20, touch_bytes=1 << 20) == 100_000  # heap pages: the fixed cost only
    # one measured size in a regime: its cost per byte
    one = load_profile_from(tmp_path, [[1 << 20, 1e-4], [30 << 20, 3e-3], [64 << 20, 4e-2]])
    assert one.host_malloc_ns(40 << 20) == int(4e-2 * 40 / 64 * 1e9)
    assert p.host_malloc_ns(64 << 20, touch_bytes=64 << 20) == p.host_malloc_ns(64 << 20)  # all of it: the table
    path.write_text(json.dumps({**PROFILE, "alloc": {**PROFILE["alloc"], "points": points,
                                                     "first_touch_ns_per_byte": 0.5}}))
    assert load_profile(path).host_malloc_ns(2 << 30, touch_bytes=10 << 20) == 100_000 + 5 * 2**20
    path.write_text(json.dumps({**PROFILE}))
    assert load_profile(path).host_malloc_ns(1 << 20) == 5000  # no table: the line
    path.write_text(json.dumps({**PROFILE, "alloc": {**PROFILE["alloc"], "malloc_ns_per_byte": 1.0}}))
    p = load_profile(path)
    assert p.host_malloc_ns(2 << 30) == 5000 + (2 << 30)
    assert p.host_malloc_ns(2 << 30, touch_bytes=1 << 20) == 5000 + (1 << 20)  # over the written bytes only
    path.write_text(json.dumps({**PROFILE, "alloc": {**PROFILE["alloc"], "points": [[1, 2, 3]]}}))
    with pytest.raises(CommsimInputError, match=r"p.json: alloc.points must be a list of \[bytes, seconds\] pairs"):
        load_profile(path)


def test_mean_of_two_calibrations():
    before = {**PROFILE, "kernel_overhead_ns": 1000, "elementwise_bytes_per_s": 2e10,
              "gemm": [[1e6, 4e10], [1e9, 6e10]], "description": "x"}
    after = {**PROFILE, "kernel_overhead_ns": 1501, "elementwise_bytes_per_s": 1e10,
             "gemm": [[1e6, 2e10], [1e9, 5e10]], "description": "x"}
    m = mean_profile(before, after)
    assert m["kernel_overhead_ns"] == 1250 and m["elementwise_bytes_per_s"] == 1.5e10
    assert m["gemm"] == [[1e6, 3e10], [1e9, 5.5e10]]  # sizes stay, rates average
    assert profile_from_dict(m, "m").kernel_overhead_ns == 1250
    with pytest.raises(CommsimInputError, match=r"profile.description: 'x' differs from 'y'"):
        mean_profile(before, {**after, "description": "y"})
    with pytest.raises(CommsimInputError, match=r"profile.gemm: the two profiles differ in structure"):
        mean_profile(before, {**after, "gemm": [[1e6, 2e10]]})
    # reported pages met by one calibration only: its figures stand; another key in one only is an error
    met = {**after, "alloc": {**PROFILE["alloc"], "page_report_period_ns": 2_000_000_000,
                              "reported_page_extra_ns_per_byte": 2.5}}
    for m in (mean_profile(before, met), mean_profile(met, before)):
        alloc = m["alloc"]
        assert alloc["page_report_period_ns"] == 2_000_000_000 and alloc["reported_page_extra_ns_per_byte"] == 2.5
        assert profile_from_dict(m, "m").reported_pages() == (2_000_000_000, 2.5)
    with pytest.raises(CommsimInputError, match=r"profile.alloc: the two profiles differ in structure"):
        mean_profile(before, {**after, "alloc": {**PROFILE["alloc"], "other": 1}})


def test_a_profile_yields_its_platform(tmp_path):
    """The backend says how kernels, memory and collective order work; the measured cores,
    time slice and drift complete it. A spec preset is a GPU platform."""
    from commsim.hardware.platform import (DEFAULT_TIME_SLICE_NS, CollectiveOrder, KernelExecution, MemoryModel,
                                           RankDrift)

    path = tmp_path / "p.json"
    path.write_text(json.dumps({**PROFILE, "backend": "gloo", "ranks_per_node": 4, "cpu_cores": 2,
                                "rank_noise": {"sd": 0.1, "corr_ns": 1e8}}))
    cpu = load_profile(path).platform
    assert (cpu.kernels, cpu.memory, cpu.collective_order) == (KernelExecution.INLINE, MemoryModel.MALLOC,
                                                               CollectiveOrder.PROGRAM)
    assert cpu.time_sliced and (cpu.cpu.cores, cpu.cpu.time_slice_ns) == (2, DEFAULT_TIME_SLICE_NS)
    assert cpu.drift == RankDrift(0.1, 100_000_000) and not cpu.malloc_syncs_device
    path.write_text(json.dumps({**PROFILE, "backend": "gloo", "ranks_per_node": 2, "cpu_cores": 2,
                                "time_slice_ns": 3_000_000}))
    assert not load_profile(path).platform.time_sliced  # a core per rank
    path.write_text(json.dumps({**PROFILE, "backend": "nccl"}))
    gpu = load_profile(path).platform
    assert (gpu.kernels, gpu.memory, gpu.cpu, bool(gpu.drift)) == (KernelExecution.QUEUED,
                                                                   MemoryModel.CACHING_ALLOCATOR, None, False)
    spec = SpecCostModel(cluster_preset("p4d", 2)).platform
    assert spec.kernels is KernelExecution.QUEUED and spec.collective_order is CollectiveOrder.STREAM


def test_a_frameworks_allocations_cost_only_fresh_pages(tmp_path):
    """A framework's torch.empty, written by the op that makes it, costs the first touch
    of its fresh pages (the simulator's heap finds them), at the calibrated figure; the
    executor's zero-filled allocations keep the table; GPUs have neither."""
    points = [[4 << 10, 4.6e-5], [1 << 20, 1e-4], [30 << 20, 3e-3], [34 << 20, 2e-2], [64 << 20, 4e-2]]
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**PROFILE, "alloc": {**PROFILE["alloc"], "points": points,
                                                     "first_touch_ns_per_byte": 0.25}}))
    p = load_profile(path)
    assert p.run_by_framework().fresh_page_ns_per_byte() == 0.25
    assert p.fresh_page_ns_per_byte() is None  # the executor: priced by the table
    assert p.host_malloc_ns(4 << 10) == 46_000 and p.host_malloc_ns(64 << 20) == 40_000_000
    # no first-touch figure: the largest measured size's cost per byte
    path.write_text(json.dumps({**PROFILE, "alloc": {**PROFILE["alloc"], "points": points}}))
    assert load_profile(path).run_by_framework().fresh_page_ns_per_byte() == pytest.approx(4e-2 / (64 << 20) * 1e9)
    assert SpecCostModel(cluster_preset("p4d", 2)).fresh_page_ns_per_byte() is None


def test_the_python_after_a_kernel(tmp_path):
    """CPU profiles: what the host's next Python pays after a kernel, by the bytes a
    memory-bound kernel or copy moved and a GEMM's flops; nothing where kernels are queued."""
    path = tmp_path / "p.json"
    doc = {**PROFILE, "backend": "gloo", "cpu_cores": 2,
           "python_after_kernel": {"memory": [[128, 0], [1 << 20, 3000], [64 << 20, 60000]],
                                   "gemm": [[1e8, 4000], [2e9, 80000]]},
           "executor_host_op_ns": {"work": 2700, "free": 400}}
    path.write_text(json.dumps(doc))
    p = load_profile(path)

    def mem(nbytes):
        return O.Compute(O.OpId(1), "c", "", O.ComputeKind.ELEMENTWISE, 0, nbytes // 2, nbytes // 2)

    def gemm(side):
        return O.Compute(O.OpId(1), "c", "", O.ComputeKind.GEMM, 2 * side ** 3, 0, 0, O.GemmShape(side, side, side))

    assert [p.python_after_kernel_ns(mem(n)) for n in (64, 1 << 20, 1 << 30)] == [0, 3000, 60000]
    assert p.python_after_kernel_ns(O.Copy(O.OpId(1), "c", "", O.CopyDirection.D2D, 1 << 19)) == 3000  # 2x its bytes
    assert p.python_after_kernel_ns(gemm(200)) == 640  # below the first point: from 0 (1.6e7 flops)
    assert p.python_after_kernel_ns(gemm(2000)) == 80000  # past the last: all the caches
    assert p.host_op_ns() == {"work": 2700, "free": 400}
    assert p.run_by_framework().host_op_ns() == {}  # the executor's loop only
    assert p.run_by_framework().python_after_kernel_ns(mem(1 << 20)) == 3000  # the interpreter's, any runner
    path.write_text(json.dumps({**doc, "backend": "nccl"}))
    assert load_profile(path).python_after_kernel_ns(mem(1 << 20)) == 0
    path.write_text(json.dumps({**doc, "python_after_kernel": {"memory": [[1, 2, 3]]}}))
    with pytest.raises(CommsimInputError, match=r"p.json: python_after_kernel.memory must be a list of \[bytes, ns\]"):
        load_profile(path)
    path.write_text(json.dumps({**doc, "executor_host_op_ns": {"launch": 1}}))
    with pytest.raises(CommsimInputError, match=r"p.json: executor_host_op_ns: must be an object with fields among "
                                                r"work, sync, alloc, free"):
        load_profile(path)
