"""What a measured profile says it measured (schema version 2), how it prices a group by
its placement, and the old version refused with the fix."""

import json

import pytest

from commsim.hardware.links import Link, LinkKind
from commsim.hardware.profile_doc import load_profile, profile_from_dict
from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from tests.hardware.test_costs import PROFILE


def _fit(latency_ns, bytes_per_s):
    return {"latency_ns": latency_ns, "bytes_per_s": bytes_per_s}


# two nodes of two GPUs: the whole job and one rank per node across nodes, each node's pair inside
GPU = {**PROFILE, "backend": "nccl", "devices": ["NVIDIA H100 80GB HBM3"], "world_size": 4, "ranks_per_node": 2,
       "nodes": 2,
       "copy": {"d2d_bytes_per_s": 1e12, "h2d_bytes_per_s": 2.5e10, "latency_ns": 9000, "d2h_bytes_per_s": 2e10},
       "collectives": {"all_gather": {"intra_node": {"2": _fit(10_000, 1e11)},
                                      "inter_node": {"2": _fit(30_000, 1e10), "4": _fit(40_000, 8e9)}}}}


def ag(size, group):
    return O.Collective(O.OpId(1), "ag", "x", O.CollectiveKind.ALL_GATHER, size, O.DType.BF16, group)


def test_a_profile_records_what_it_measured():
    p = profile_from_dict(GPU, "gpu.json")
    assert (p.backend, p.devices, p.world_size, p.ranks_per_node, p.nodes) == \
        ("nccl", ("NVIDIA H100 80GB HBM3",), 4, 2, 2)
    assert p.groups_measured == (("inter_node", 2), ("inter_node", 4), ("intra_node", 2))
    assert (p.placement((0, 1)), p.placement((1, 2)), p.placement((0, 2))) == ("intra_node", "inter_node",
                                                                               "inter_node")


def test_a_group_is_priced_from_its_own_placement():
    """Two ranks of one node and two ranks on two nodes are different groups: NVLink
    against the network."""
    p = profile_from_dict(GPU, "gpu.json")
    inside, across = p.collective(ag(10**9, (0, 1))), p.collective(ag(10**9, (0, 2)))
    assert (inside.latency_ns, inside.algorithm) == (10_000, "measured/intra_node/2")
    assert dict(inside.demands)[Link(LinkKind.CHANNEL, 0)] == pytest.approx(1e-2 * 1e9)  # 1 GB at 100 GB/s
    assert (across.latency_ns, across.algorithm) == (30_000, "measured/inter_node/2")
    assert p.collective(ag(10**6, (0, 1, 2, 3))).algorithm == "measured/inter_node/4"
    # a placement never measured (a prediction told to extrapolate) takes the other's fits
    one_node = profile_from_dict({**GPU, "collectives": {"all_gather": {"intra_node": {"2": _fit(10_000, 1e11)}}}},
                                 "one.json")
    assert one_node.collective(ag(10**6, (0, 2))).algorithm == "measured/intra_node/2"


def test_copies_each_way_at_their_own_rate():
    p = profile_from_dict(GPU, "gpu.json")
    h2d = O.Copy(O.OpId(1), "c", "up", O.CopyDirection.H2D, 25_000_000)
    d2h = O.Copy(O.OpId(2), "c", "down", O.CopyDirection.D2H, 20_000_000)
    assert (p.copy_ns(h2d), p.copy_ns(d2h)) == (9000 + 1_000_000, 9000 + 1_000_000)
    p = profile_from_dict({**GPU, "copy": {k: v for k, v in GPU["copy"].items() if k != "d2h_bytes_per_s"}}, "g")
    assert p.copy_ns(d2h) == 9000 + 800_000  # not measured apart: the h2d rate


def test_version_1_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**PROFILE, "schema_version": 1}))
    with pytest.raises(CommsimInputError, match=r"old.json: unsupported profile schema version 1; this commsim reads 2 "
                                                r"\(it records the devices, nodes and group placements measured\): "
                                                r"re-run commsim calibrate"):
        load_profile(path)


@pytest.mark.parametrize("change, message", [
    ({"devices": []}, r"field 'devices' must be a non-empty list of device names"),
    ({"backend": ""}, r"field 'backend' must name the torch.distributed backend measured"),
    ({"nodes": 0}, r"field 'nodes' must be a positive integer, got 0"),
    ({"world_size": 2.5}, r"field 'world_size' must be a positive integer, got 2.5"),
    ({"collectives": {"all_gather": {"2": _fit(1, 1e9)}}},
     r"collectives.all_gather.2: placements are intra_node and inter_node"),
    ({"collectives": {"all_gather": {"intra_node": {"1": _fit(1, 1e9)}}}},
     r"collectives.all_gather.intra_node.1: group sizes are integers >= 2"),
    ({"allocator": {"num_alloc_retries": "many"}}, r"allocator: must be an object of integer statistics"),
])
def test_bad_fields_are_named(change, message):
    with pytest.raises(CommsimInputError, match=r"p.json: " + message):
        profile_from_dict({**GPU, **change}, "p.json")


def test_the_stored_cpu_profiles_load():
    """traces/local-cpu's profiles (converted once to version 2) keep working."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "traces" / "local-cpu"
    paths = sorted(root.glob("*.profile.json"))
    assert len(paths) == 14
    for path in paths:
        p = load_profile(path, "fp32")
        assert p.backend == "gloo" and p.nodes == 1 and p.world_size == p.ranks_per_node in (2, 4)
        assert p.groups_measured == (("intra_node", p.world_size),)
        assert (p.cache_bytes, p.cache_bytes_per_s) == (0, 0.0)  # not measured then: every byte from the table


def test_reused_bytes_are_priced_in_the_cache_when_the_working_set_fits():
    """A CPU profile's cache: an op's reuse_bytes at the in-cache rate when its working
    set fits in a rank's share of the cache (its size over the ranks per node), every
    other byte from the memory-bound table; a profile without it prices every byte there."""
    from tests.hardware.test_costs import PROFILE

    cached = profile_from_dict({**PROFILE, "cache": {"bytes": 1 << 20, "bytes_per_s": 1e10}}, "p.json")
    plain = profile_from_dict(PROFILE, "p.json")
    assert (cached.cache_bytes, cached.cache_bytes_per_s, plain.cache_bytes, plain.cache_bytes_per_s) == \
        (1 << 20, 1e10, 0, 0.0)

    def op(reuse, ws):
        return O.Compute(O.OpId(1), "c", "adam", O.ComputeKind.OPTIMIZER, 1000, 6000, 2000, reuse_bytes=reuse,
                         working_set_bytes=ws)

    # 1000 ns per kernel; 8000 B at 2 GB/s = 4000 ns; reused 4000 B at 10 GB/s = 400 ns
    assert cached.compute_ns(op(4000, 1 << 19)) == 1000 + 2000 + 400  # 512 KiB: the share of one of 2 ranks
    assert cached.compute_ns(op(4000, (1 << 19) + 1)) == 1000 + 4000  # too large: from memory
    assert cached.compute_ns(op(0, 1000)) == plain.compute_ns(op(4000, 1000)) == 1000 + 4000
    assert cached.compute_ns(op(8000, 1000)) == 1000 + 800
    with pytest.raises(CommsimInputError, match=r"p.json: cache: must be an object \{\"bytes\": a positive integer"):
        profile_from_dict({**PROFILE, "cache": {"bytes": 0, "bytes_per_s": 1e10}}, "p.json")
    with pytest.raises(CommsimInputError, match=r"p.json: cache: field 'bytes_per_s' must be a positive number"):
        profile_from_dict({**PROFILE, "cache": {"bytes": 1 << 20}}, "p.json")


def test_in_place_writes_skip_the_read_for_ownership_in_a_frameworks_cpu_run():
    """The memory table timed copies (3 bytes moved for 2 counted): an op that states
    in-place writes, run by a framework on CPUs, moves only what it counts; the executor
    runs it as the table's copy, and a GPU writes without reading first."""
    from tests.hardware.test_costs import PROFILE

    def op(in_place):
        return O.Compute(O.OpId(1), "c", "adam", O.ComputeKind.OPTIMIZER, 1000, 6000, 2000, in_place_bytes=in_place)

    executor = profile_from_dict(PROFILE, "p.json")
    framework = executor.run_by_framework()
    gpu = profile_from_dict({**PROFILE, "backend": "nccl"}, "p.json").run_by_framework()
    # 8000 B at 2 GB/s = 4000 ns as the copy moves them; in place: 8000 of 12000 moved (a
    # framework's run has no executor kernel overhead: its launch host op prices dispatch)
    assert framework.compute_ns(op(2000)) == 4000 * 8000 // 12000
    assert framework.compute_ns(op(500)) == 4000 * 9500 // 12000  # 1500 B written fresh
    assert framework.compute_ns(op(0)) == 4000
    assert executor.compute_ns(op(2000)) == executor.compute_ns(op(0)) == gpu.compute_ns(op(2000)) == 1000 + 4000


def test_a_frameworks_python_after_a_collective_is_priced_cold():
    """``cache.python_cold_factor``: a framework's Python (timed back to back) costs that
    factor more when a collective of its rank ran since its last Python; only where the
    profile prices a framework's run, and not without the factor."""
    from tests.hardware.test_costs import PROFILE

    cache = {"bytes": 1 << 20, "bytes_per_s": 1e10}
    cold = profile_from_dict({**PROFILE, "cache": {**cache, "python_cold_factor": 2.5}}, "p.json")
    assert cold.python_cold_factor == 2.5
    fw = cold.run_by_framework()
    assert (fw.framework_python_ns(1000, True), fw.framework_python_ns(1000, False)) == (2500, 1000)
    assert cold.framework_python_ns(1000, True) == 1000  # the executor's host ops are its own
    plain = profile_from_dict({**PROFILE, "cache": cache}, "p.json").run_by_framework()
    assert plain.python_cold_factor == 1.0 and plain.framework_python_ns(1000, True) == 1000
    for bad in (0.5, "2", True, 101):
        with pytest.raises(CommsimInputError, match=r"p.json: cache: python_cold_factor must be a number from 1 to "
                                                    r"100 \(Python's time after a collective over its time back to "
                                                    r"back\), got"):
            profile_from_dict({**PROFILE, "cache": {**cache, "python_cold_factor": bad}}, "p.json")
