"""A hardware profile's JSON document (``commsim calibrate`` writes it) read into a
``commsim.hardware.profile.HardwareProfile``, with one-line errors naming the file and field.

Format (JSON), schema version 2::

    {"kind": "commsim-hw-profile", "schema_version": 2, "description": "...",
     "backend": "gloo",                 # the torch.distributed backend measured
     "devices": ["CPU: AMD EPYC"],      # every rank's device name, each once
     "world_size": 2, "ranks_per_node": 2, "nodes": 1,
     "memory_bytes": 8589934592,
     "kernel_overhead_ns": 20000,
     "gemm": [[flops, flops_per_s], ...],          # ascending flops
     "elementwise_bytes_per_s": 4e9,
     "copy": {"d2d_bytes_per_s": 4e9, "h2d_bytes_per_s": 4e9, "latency_ns": 2000,
              "d2h_bytes_per_s": 4e9, "d2h_latency_ns": 2000},  # d2h: optional, else h2d's
     "collectives": {"all_gather": {"intra_node": {"2": {"latency_ns": 200000, "bytes_per_s": 1e9}},
                                    "inter_node": {"4": {...}}}, ...},
     "comm_slowdown": 1.5,              # compute runs this much slower during a collective
     "comm_slowdown_during_compute": 2, # and collectives this much slower during compute (optional)
     "comm_latency_slowdown_during_compute": 3,  # and their fixed latency (optional)
     "issue_ns": 20000,                 # host time to issue one device op (optional)
     "executor_host_op_ns": {"work": 2500, "sync": 2500, "alloc": 2500, "free": 800,
                             "work_record": 650, "sync_record": 1000},  # optional: see below
     "python_after_kernel": {"memory": [[bytes, ns], ...], "gemm": [[flops, ns], ...]},  # CPUs (optional): see below
     "cache": {"bytes": 33554432, "bytes_per_s": 6e10,  # CPU backends (optional): see below
               "python_cold_factor": 1.9},
     "cpu_cores": 2, "time_slice_ns": 4000000,  # CPU backends (optional): see below
     "rank_noise": {"sd": 0.1, "corr_ns": 300000000},  # ranks' speed drift (optional): see below
     "rank_stalls": {"rate_per_s": 400, "lengths_ns": [20000, ...]},  # ranks' stalls (optional): see below
     "framework_kernels": {"fp32": {"norm": {"fwd": [[bytes, seconds], ...], "bwd": [...]}, ...},
                           "bf16": {...}, "source": "..."},  # CPU backends (optional): see below
     "allocator": {"num_alloc_retries": 0, ...},  # GPUs (optional): torch.cuda.memory_stats after calibrating
     "alloc": {"malloc_base_ns": 5000, "malloc_ns_per_byte": 0.0,
               "free_base_ns": 5000, "free_ns_per_byte": 0.0,
               "points": [[bytes, seconds], ...]}}  # optional: host allocations by size

Version 1 profiles are refused with the fix (re-run ``commsim calibrate``), not read
with the new fields guessed: they do not say where their groups sat (inside a node or
across nodes) or on which devices, and on GPUs they were measured by the code this
version corrects (host<->device copies at half the memory bandwidth, every GEMM timed
with a device synchronise, contention measured as serialisation), so a GPU version-1
profile prices wrongly and has to be measured again anyway. The CPU profiles kept in
``traces/local-cpu`` were converted once (their groups were all inside one node).

Host allocations (CPU backends) are priced from ``alloc.points`` when present, piecewise
linear by size: glibc's malloc serves blocks below its mmap threshold (dynamic, up to
32 MiB on 64-bit Linux: mallopt(3), M_MMAP_THRESHOLD) from a heap whose pages are
already touched, so zeroing them costs a memset; larger blocks are fresh mmapped pages
every time and pay page faults, several times more per byte: one latency-plus-bandwidth
line through both regimes misprices both (traces/README.md has the figures). Both the
table and ``first_touch_ns_per_byte`` are wall time: in a virtual machine that reports
freed memory back to its host, the hypervisor serves part of a fresh page's fault, which
no guest clock of the thread counts (traces/README.md, "Fresh pages in wall time").
``alloc.page_report_period_ns`` and ``alloc.reported_page_extra_ns_per_byte`` (optional,
calibrate measures them where the guest reports free memory to its hypervisor): the
reporting period, and what the first write of a page the guest has reported costs beyond
a fast fresh page; a large block's pages are priced so by the share the guest has
reported since its rank freed them, which grows with their age in periods
(``sim.returned_pages``).
``alloc.unmap_ns_per_byte`` (optional): handing written pages back to the OS at a free
(munmap of a block above the threshold, or a trim of the heap), per byte, charged to
the free; profiles without it counted that in ``first_touch_ns_per_byte``.

``issue_ns`` and ``executor_host_op_ns`` (optional): the executor's own loop, where no
op is recorded (``runtime.executor_loop``): per device op, and per host op by kind
(host work, host sync, allocation, free), and what a host work's and a sync's records
hold beyond the op (``work_record``, ``sync_record``). Only a prediction for ``commsim
execute`` pays them; a framework's loop is its schedule's host ops.
``python_after_kernel`` (optional, CPUs): what the Python after a kernel that ran on the
host thread pays over its time after a tiny one, by the bytes a memory-bound kernel or
copy moved and a GEMM's flops: the kernel's data took the caches the interpreter's own
code and data were in. The executor's loop and a framework's next host op pay it alike.

``cache``: the last-level cache's size and the memory-bound kernel's rate on data in
it. A compute op's ``reuse_bytes`` (bytes the ops just before it touched) are priced
at that rate when the op's ``working_set_bytes`` fit in the rank's share of the cache
(its size over the ranks per node, which share it), the rest of its bytes from the
table: torch's single-tensor AdamW on CPUs keeps each parameter's arrays in the cache
across its eight passes. Without ``cache`` every byte is priced from the table.
Where the profile prices a framework's run, an op that states ``in_place_bytes`` (writes
over bytes it read) moves no line for ownership: its table time is scaled by moved /
(1.5 x counted) (``commsim.hardware.write_allocate``: the table's copy moves 3 bytes for
2 counted).
``cache.python_cold_factor`` (optional, CPUs): how much slower a framework's Python runs
right after a blocking collective than back to back (gloo's threads ran on the cores
meanwhile); a framework's hooks and bookkeeping (host costs timed back to back) are
priced up by it when a collective of their rank ran since its last Python
(``HardwareProfile.framework_python_ns``).

Collectives (``collectives.<kind>.<placement>.<group size>``): ``points`` are
[bytes, seconds] of back-to-back calls (CUDA events on GPUs); on CPU backends also
``call_points`` (how long the call holds the calling thread) and ``in_step_points``
(the collective as a step issues it: started together, then compute on every rank;
``runtime.calibrate_collectives``). A CPU collective followed by compute on its ranks
now and then waits about a scheduler tick for its completion: the simulator adds the
difference between the two tables to a collective whose rank computes next, not to
one followed by another collective.

``rank_stalls``: each rank's short stalls (CPU backends): how many arrive per second of
the rank's undisturbed work and how long they last (equally likely lengths, the
quantiles of the measured ones); see ``commsim.hardware.platform.RankStalls``.

``framework_kernels``: a framework's own memory-bound ATen kernels (element-wise add,
row reduction, LayerNorm, softmax, dropout, embedding; forward and backward) timed in
fp32 and bf16 by size. A prediction of a framework's run (``--runner framework``) prices
those classes' ops from it in the step's dtype (``commsim.hardware.framework_kernels``);
the executor's runs keep ``elementwise_points``, which time its stand-in kernel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from commsim.hardware.framework_kernels import framework_kernels_from_dict
from commsim.hardware.profile import PLACEMENTS, PROFILE_SCHEMA_VERSION, CollectiveFit, HardwareProfile
from commsim.ir import ops as O
from commsim.hardware.noise import mean_rank_drift
from commsim.ir.errors import CommsimInputError
from commsim.util.files import read_json


def _num(obj: dict[str, Any], key: str, where: str, positive: bool = True) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and v <= 0) or v < 0:
        raise CommsimInputError(f"{where}: field {key!r} must be a {'positive' if positive else 'non-negative'} "
                                f"number, got {v!r}")
    return float(v)


def _points(pts: Any, where: str, what: str = "[bytes, seconds]") -> tuple[tuple[float, float], ...]:
    if not isinstance(pts, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) and x >= 0 for x in p) for p in pts):
        raise CommsimInputError(f"{where} must be a list of {what} pairs")
    return tuple(sorted((float(a), float(b)) for a, b in pts))


def _gemm_points(gemm: Any, where: str) -> tuple[tuple[float, float], ...]:
    if not isinstance(gemm, list) or not gemm or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) and x > 0 for x in p) for p in gemm):
        raise CommsimInputError(f"{where} must be a non-empty list of [flops, flops_per_s] pairs")
    return tuple(sorted((float(a), float(b)) for a, b in gemm))


def profile_from_dict(obj: Any, where: str, precision: str | None = None) -> HardwareProfile:
    """``precision`` (fp32 / bf16 / fp16) picks the GEMM curve measured in that dtype."""
    if not isinstance(obj, dict) or obj.get("kind") != "commsim-hw-profile":
        raise CommsimInputError(f"{where}: not a commsim hardware profile (missing \"kind\": \"commsim-hw-profile\")")
    if obj.get("schema_version") != PROFILE_SCHEMA_VERSION:
        raise CommsimInputError(f"{where}: unsupported profile schema version {obj.get('schema_version')!r}; "
                                f"this commsim reads {PROFILE_SCHEMA_VERSION} (it records the devices, nodes and "
                                "group placements measured): re-run commsim calibrate")
    gemm_t = _gemm_points(obj.get("gemm"), f"{where}: field 'gemm'")
    by_dtype = obj.get("gemm_by_dtype", {})
    key = {"fp16": "bf16"}.get(precision or "", precision or "")  # fp16 and bf16 run alike
    if isinstance(by_dtype, dict) and key in by_dtype:
        gemm_t = _gemm_points(by_dtype[key], f"{where}: field 'gemm_by_dtype.{key}'")
    shapes: dict[tuple[int, int, int, int], float] = {}
    table = obj.get("gemm_shapes_by_dtype", {})
    if not isinstance(table, dict):
        raise CommsimInputError(f"{where}: gemm_shapes_by_dtype must be an object of dtype: [[m, n, k, batch, flops_per_s]]")
    dkey = key or str(obj.get("default_dtype", "fp32"))
    for row in table.get(dkey, []):
        if not (isinstance(row, list) and len(row) == 5 and all(isinstance(x, (int, float)) and x > 0 for x in row)):
            raise CommsimInputError(f"{where}: gemm_shapes_by_dtype.{dkey}: rows are [m, n, k, batch, flops_per_s]")
        shapes[(int(row[0]), int(row[1]), int(row[2]), int(row[3]))] = float(row[4])
    copy = obj.get("copy", {})
    alloc = obj.get("alloc", {})
    colls = _collectives(obj.get("collectives", {}), where)
    backend = obj.get("backend")
    if not isinstance(backend, str) or not backend:
        raise CommsimInputError(f"{where}: field 'backend' must name the torch.distributed backend measured "
                                "(nccl, gloo)")
    devices = obj.get("devices")
    if not isinstance(devices, list) or not devices or not all(isinstance(d, str) and d for d in devices):
        raise CommsimInputError(f"{where}: field 'devices' must be a non-empty list of device names")
    return HardwareProfile(
        description=str(obj.get("description", "")),
        backend=backend,
        devices=tuple(devices),
        world_size=_count(obj, "world_size", where),
        nodes=_count(obj, "nodes", where),
        ranks_per_node=_count(obj, "ranks_per_node", where),
        hbm_bytes=int(_num(obj, "memory_bytes", where)),
        kernel_overhead_ns=int(_num(obj, "kernel_overhead_ns", where, positive=False)),
        gemm=gemm_t,
        gemm_shapes=shapes,
        elementwise_bytes_per_s=_num(obj, "elementwise_bytes_per_s", where),
        elementwise_points=tuple(sorted((float(a), float(b)) for a, b in obj.get("elementwise_points", []))),
        d2d_bytes_per_s=_num(copy, "d2d_bytes_per_s", f"{where}: copy"),
        h2d_bytes_per_s=_num(copy, "h2d_bytes_per_s", f"{where}: copy"),
        copy_latency_ns=int(_num(copy, "latency_ns", f"{where}: copy", positive=False)),
        d2h_bytes_per_s=_num(copy, "d2h_bytes_per_s", f"{where}: copy") if "d2h_bytes_per_s" in copy else 0.0,
        d2h_latency_ns=int(_num(copy, "d2h_latency_ns", f"{where}: copy", positive=False))
        if "d2h_latency_ns" in copy else None,
        allocator=_allocator(obj.get("allocator", {}), f"{where}: allocator"),
        collectives=colls,
        comm_slowdown=_num(obj, "comm_slowdown", where),
        comm_slowdown_during_compute=_num(obj, "comm_slowdown_during_compute", where) if
        "comm_slowdown_during_compute" in obj else 1.0,
        comm_latency_slowdown_during_compute=_num(obj, "comm_latency_slowdown_during_compute", where)
        if "comm_latency_slowdown_during_compute" in obj else 1.0,
        issue_ns=int(_num(obj, "issue_ns", where, positive=False)) if "issue_ns" in obj else 0,
        executor_host_op_ns=_host_op_ns(obj.get("executor_host_op_ns"), f"{where}: executor_host_op_ns"),
        **_python_after_kernel(obj.get("python_after_kernel"), f"{where}: python_after_kernel"),
        caching_allocator=bool(obj.get("caching_allocator", obj.get("backend") == "nccl")),
        malloc_base_ns=int(_num(alloc, "malloc_base_ns", f"{where}: alloc", positive=False)),
        malloc_ns_per_byte=_num(alloc, "malloc_ns_per_byte", f"{where}: alloc", positive=False),
        free_base_ns=int(_num(alloc, "free_base_ns", f"{where}: alloc", positive=False)),
        free_ns_per_byte=_num(alloc, "free_ns_per_byte", f"{where}: alloc", positive=False),
        alloc_points=_points(alloc.get("points", []), f"{where}: alloc.points"),
        cpu_cores=int(_num(obj, "cpu_cores", where)) if obj.get("cpu_cores") is not None else None,
        time_slice_ns=int(_num(obj, "time_slice_ns", where)) if obj.get("time_slice_ns") is not None else 0,
        first_touch_ns_per_byte=_num(alloc, "first_touch_ns_per_byte", f"{where}: alloc", positive=False)
        if "first_touch_ns_per_byte" in alloc else 0.0,
        unmap_ns_per_byte=_num(alloc, "unmap_ns_per_byte", f"{where}: alloc", positive=False)
        if "unmap_ns_per_byte" in alloc else 0.0,
        page_report_period_ns=int(_num(alloc, "page_report_period_ns", f"{where}: alloc", positive=False))
        if "page_report_period_ns" in alloc else 0,
        reported_page_extra_ns_per_byte=_num(alloc, "reported_page_extra_ns_per_byte", f"{where}: alloc",
                                             positive=False) if "reported_page_extra_ns_per_byte" in alloc else 0.0,
        **_rank_noise(obj.get("rank_noise"), f"{where}: rank_noise"),
        **_rank_stalls(obj.get("rank_stalls"), f"{where}: rank_stalls"),
        **_cache(obj.get("cache"), f"{where}: cache"),
        framework_kernels=framework_kernels_from_dict(obj.get("framework_kernels"), where),
        precision=key or str(obj.get("default_dtype", "fp32")),
    )


def _count(obj: dict[str, Any], key: str, where: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CommsimInputError(f"{where}: field {key!r} must be a positive integer, got {v!r}")
    return v


def _collectives(table: Any, where: str) -> dict[str, dict[tuple[str, int], CollectiveFit]]:
    """kind -> placement -> group size -> fit, read into kind -> (placement, size) -> fit."""
    allowed = {k.value for k in O.CollectiveKind}
    if not isinstance(table, dict):
        raise CommsimInputError(f"{where}: collectives must be an object kind -> placement -> group size -> fit")
    colls: dict[str, dict[tuple[str, int], CollectiveFit]] = {}
    for kind, by_place in table.items():
        if kind not in allowed:
            raise CommsimInputError(f"{where}: collectives.{kind}: not one of {', '.join(sorted(allowed))}")
        if not isinstance(by_place, dict):
            raise CommsimInputError(f"{where}: collectives.{kind}: an object placement -> group size -> fit")
        colls[kind] = {}
        for place, sizes in by_place.items():
            if place not in PLACEMENTS or not isinstance(sizes, dict):
                raise CommsimInputError(f"{where}: collectives.{kind}.{place}: placements are {' and '.join(PLACEMENTS)},"
                                        " each an object group size -> fit")
            for p, fit in sizes.items():
                w = f"{where}: collectives.{kind}.{place}.{p}"
                if not str(p).isdigit() or int(p) < 2 or not isinstance(fit, dict):
                    raise CommsimInputError(f"{w}: group sizes are integers >= 2, each with a fit object")
                pts = {}
                for key in ("points", "call_points", "in_step_points"):
                    q = fit.get(key, [])
                    if not isinstance(q, list) or not all(isinstance(x, list) and len(x) == 2 for x in q):
                        raise CommsimInputError(f"{w}: {key} must be a list of [bytes, seconds] pairs")
                    pts[key] = tuple(sorted((float(a), float(b)) for a, b in q))
                colls[kind][(place, int(p))] = CollectiveFit(int(_num(fit, "latency_ns", w, positive=False)),
                                                             _num(fit, "bytes_per_s", w), pts["points"],
                                                             pts["call_points"], pts["in_step_points"])
    return colls


def _allocator(stats: Any, where: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(stats, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in stats.values()):
        raise CommsimInputError(f"{where}: must be an object of integer statistics (torch.cuda.memory_stats)")
    return tuple(sorted(stats.items()))


def _rank_noise(noise: Any, where: str) -> dict[str, Any]:
    if noise is None:
        return {}
    if not isinstance(noise, dict):
        raise CommsimInputError(f"{where}: must be an object {{\"sd\": >= 0, \"corr_ns\": > 0 (>= 0 when sd is 0)"
                                f", optionally \"slow_sd\" and \"slow_corr_ns\" alike}}")
    sd = _num(noise, "sd", where, positive=False)
    corr = _num(noise, "corr_ns", where, positive=bool(sd))
    out = {"rank_noise_sd": sd, "rank_noise_corr_ns": int(corr)}
    if "slow_sd" in noise or "slow_corr_ns" in noise:
        slow = _num(noise, "slow_sd", where, positive=False)
        out.update(rank_noise_slow_sd=slow, rank_noise_slow_corr_ns=int(_num(noise, "slow_corr_ns", where,
                                                                             positive=bool(slow))))
    return out


# the executor's loop per host op, by the kind of op, and inside a host work's and a
# sync's record (runtime.executor_loop)
HOST_OP_KINDS = ("work", "sync", "alloc", "free", "work_record", "sync_record")


def _host_op_ns(loop: Any, where: str) -> tuple[tuple[str, int], ...]:
    if loop is None:
        return ()
    if not isinstance(loop, dict) or set(loop) - set(HOST_OP_KINDS):
        raise CommsimInputError(f"{where}: must be an object with fields among {', '.join(HOST_OP_KINDS)} "
                                "(ns, >= 0)")
    return tuple((k, int(_num(loop, k, where, positive=False))) for k in HOST_OP_KINDS if k in loop)


def _python_after_kernel(doc: Any, where: str) -> dict[str, Any]:
    if doc is None:
        return {}
    if not isinstance(doc, dict) or set(doc) - {"memory", "gemm"}:
        raise CommsimInputError(f"{where}: must be an object with \"memory\" ([bytes, ns] pairs) and \"gemm\" "
                                "([flops, ns] pairs)")
    return {"python_after_memory_points": _points(doc.get("memory", []), f"{where}.memory", "[bytes, ns]"),
            "python_after_gemm_points": _points(doc.get("gemm", []), f"{where}.gemm", "[flops, ns]")}


def _rank_stalls(stalls: Any, where: str) -> dict[str, Any]:
    if stalls is None:
        return {}
    lengths = stalls.get("lengths_ns") if isinstance(stalls, dict) else None
    if not isinstance(lengths, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0
                                                for x in lengths):
        raise CommsimInputError(f"{where}: must be an object {{\"rate_per_s\": >= 0, \"lengths_ns\": a list of "
                                "numbers >= 0 (non-empty when the rate is not 0)}")
    rate = _num(stalls, "rate_per_s", where, positive=False)
    if rate and not lengths:
        raise CommsimInputError(f"{where}: lengths_ns is empty while rate_per_s is {rate}; "
                                "a rate needs the stalls' lengths")
    return {"rank_stalls_rate_per_s": rate, "rank_stalls_lengths_ns": tuple(int(x) for x in lengths)}


def _cache(cache: Any, where: str) -> dict[str, Any]:
    if cache is None:
        return {}
    if not isinstance(cache, dict) or not isinstance(cache.get("bytes"), int) or isinstance(cache["bytes"], bool) \
            or cache["bytes"] < 1:
        raise CommsimInputError(f"{where}: must be an object {{\"bytes\": a positive integer, "
                                "\"bytes_per_s\": a positive number}")
    out = {"cache_bytes": cache["bytes"], "cache_bytes_per_s": _num(cache, "bytes_per_s", where)}
    if "python_cold_factor" in cache:
        factor = cache["python_cold_factor"]
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1.0 <= factor <= 100.0:
            raise CommsimInputError(f"{where}: python_cold_factor must be a number from 1 to 100 (Python's time "
                                    f"after a collective over its time back to back), got {factor!r}")
        out["python_cold_factor"] = float(factor)
    return out


def load_profile(path: str | Path, precision: str | None = None) -> HardwareProfile:
    return profile_from_dict(read_json(path, CommsimInputError), str(path), precision)


# Fields a calibration writes only when it met what they measure: the reported pages'
# (calibrate's blocks came back slow in one calibration and not in the other: "not met"
# says nothing of what a reported page costs, so the one that met them stands).
MET_ONLY = frozenset({"page_report_period_ns", "reported_page_extra_ns_per_byte"})


def _mean_field(key: str, a: Any, b: Any, where: str) -> Any:
    """One field of ``mean_profile``: the ranks' drift by its window variances
    (``noise.mean_rank_drift``), anything else number by number."""
    if key == "rank_noise" and isinstance(a, dict) and isinstance(b, dict):
        fits = []
        for doc in (a, b):
            parsed = _rank_noise(doc, where)
            fits.append([(parsed.get("rank_noise_sd", 0.0), parsed.get("rank_noise_corr_ns", 0)),
                         (parsed.get("rank_noise_slow_sd", 0.0), parsed.get("rank_noise_slow_corr_ns", 0))])
        comps = list(mean_rank_drift(*[[c for c in f if c[0] > 0] for f in fits]))
        (sd, corr), (slow_sd, slow_corr) = (comps + [(0.0, 0), (0.0, 0)])[:2]
        return {"sd": sd, "corr_ns": corr, "slow_sd": slow_sd, "slow_corr_ns": slow_corr}
    return mean_profile(a, b, where)


def mean_profile(a: Any, b: Any, where: str = "profile") -> Any:
    """The mean of two profile documents from the same calibration command (say, one
    taken right before a run and one right after, on a machine whose speed drifts):
    every number averaged (integers rounded), lists element by element, objects key
    by key; strings and booleans must agree. Measured sizes (the bytes or shapes
    that tables are keyed by) are equal in both, so they average to themselves. A
    field of ``MET_ONLY`` in one of them only is kept as it is. Any other different
    structure is an error naming the first place that differs."""
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or a is None:
        if a != b:
            raise CommsimInputError(f"{where}: {a!r} differs from {b!r}; average profiles of one calibration command")
        return a
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        m = (a + b) / 2
        return round(m) if isinstance(a, int) and isinstance(b, int) else m
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [mean_profile(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
    if isinstance(a, dict) and isinstance(b, dict) and not (a.keys() ^ b.keys()) - MET_ONLY:
        return {k: _mean_field(k, a[k], b[k], f"{where}.{k}") if k in b else a[k] for k in a} | \
            {k: b[k] for k in b.keys() - a.keys()}
    raise CommsimInputError(f"{where}: the two profiles differ in structure here; "
                            "average profiles of one calibration command")
