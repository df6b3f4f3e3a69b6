"""The hardware profile document (commsim-hw-profile v2) a calibration writes.

``profile_document`` assembles what the benchmarks measured into the JSON object that
``commsim.hardware.profile`` loads: rates in bytes/s and flops/s, times in ns (the
benchmarks measure seconds; they are converted here, once), what was measured (the
backend, the devices, the ranks per node and the nodes; the collectives' group sizes and
placements are the keys of their table), the platform's memory model and, on CPUs, its
cores, time slice, rank drift and last-level cache; on GPUs, the copies' own rates and
the caching allocator's statistics.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from commsim.hardware.platform import Platform
from commsim.hardware.profile import PROFILE_SCHEMA_VERSION
from runtime.kernels import default_precision


@dataclass(frozen=True)
class Measured:
    """Everything one calibration measured, in the benchmarks' units (seconds)."""

    gemm_by_dtype: dict[str, list[list[float]]]  # dtype -> [flops, flops/s] points
    gemm_shapes_by_dtype: dict[str, list[list[float]]]  # dtype -> [m, n, k, batch, flops/s]
    mem_latency_s: float
    mem_bytes_per_s: float
    mem_points: list[list[float]]  # [bytes, seconds]
    collectives: dict[str, dict[str, dict[str, Any]]]
    comm_slowdown: float
    comm_slowdown_during_compute: float
    comm_latency_slowdown_during_compute: float
    issue_ns: int
    inline_kernel_ns: int  # CPUs: the executor's tiny kernel as recorded (runtime.executor_loop)
    host_op_ns: dict[str, int]  # the executor's loop per host op, by kind (runtime.executor_loop)
    cold_points: dict[str, list[list[float]]]  # CPUs: Python after a kernel, by its size (runtime.executor_loop)
    alloc_latency_s: float
    alloc_s_per_byte: float
    alloc_points: list[list[float]]  # [bytes, seconds]
    first_touch_s_per_byte: float
    unmap_s_per_byte: float  # written host pages handed back at a free (munmap)
    cpu_cores: int
    time_slice_ns: int | None
    rank_noise: dict[str, float] | None
    rank_stalls: dict[str, object] | None = None  # RankStalls' fields (CPU backends)
    devices: list[str] = dataclasses.field(default_factory=list)  # every rank's device name, each once
    nodes: int = 1
    kernel_overhead_ns: int | None = None  # GPUs: a kernel's fixed device cost (CPUs: the executor's per op)
    copies: dict[str, dict[str, Any]] | None = None  # GPUs: "h2d" / "d2h" -> latency_ns, bytes_per_s, points
    allocator: dict[str, int] | None = None  # GPUs: the caching allocator's statistics
    cache: dict[str, float] | None = None  # CPUs: the last-level cache's "bytes" and in-cache "bytes_per_s"
    host_costs: dict[str, Any] | None = None  # CPUs: a framework's launch costs on this machine (HostCosts fields)
    framework_kernels: dict[str, Any] | None = None  # CPUs: a framework's memory-bound kernels by class and dtype
    # CPUs in a VM that reports free memory: (reporting period s, a reported page's extra s a byte)
    reported_pages: tuple[float, float] | None = None


def profile_document(m: Measured, platform: Platform, device: torch.device, world: int,
                     ranks_per_node: int) -> dict[str, Any]:
    """The profile of ``world`` ranks (``ranks_per_node`` on each of ``m.nodes`` nodes)
    on ``platform``."""
    precision = default_precision(platform)
    mem_total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else host_memory()
    devices = m.devices or [device_name(device)]
    if m.copies is not None:  # measured: pinned, non-blocking copies on the copy engines
        h2d, d2h = m.copies["h2d"], m.copies["d2h"]
        copy = {"d2d_bytes_per_s": m.mem_bytes_per_s / 2, "h2d_bytes_per_s": h2d["bytes_per_s"],
                "d2h_bytes_per_s": d2h["bytes_per_s"], "latency_ns": h2d["latency_ns"],
                "d2h_latency_ns": d2h["latency_ns"], "h2d_points": h2d["points"], "d2h_points": d2h["points"]}
    else:
        # Host platforms: the executor's copy is the memory-bound kernel over the bytes
        # read and written (host and "device" memory are one), so a copy moves bytes at
        # half that kernel's measured rate; predictions price it from that kernel's
        # table (``elementwise_points``) where they have one.
        rate = m.mem_bytes_per_s / 2
        copy = {"d2d_bytes_per_s": rate, "h2d_bytes_per_s": rate, "d2h_bytes_per_s": rate,
                "latency_ns": int(m.mem_latency_s * 1e9)}
    # a kernel's fixed cost: on GPUs its device time alone (the host's issue is
    # ``issue_ns``, priced apart); on CPUs the larger of the memory-bound kernels' fixed
    # cost and the executor's tiny kernel as recorded (the loop between records is
    # ``issue_ns``), both on the host thread that runs it
    overhead = m.kernel_overhead_ns if m.kernel_overhead_ns is not None else \
        max(int(m.mem_latency_s * 1e9), m.inline_kernel_ns)
    return {
        "kind": "commsim-hw-profile", "schema_version": PROFILE_SCHEMA_VERSION,
        "description": f"{world} ranks ({ranks_per_node} per node, {m.nodes} node{'s' if m.nodes != 1 else ''}), "
                       f"{platform.backend}, {describe(device, devices)}",
        "backend": platform.backend, "devices": devices, "world_size": world, "ranks_per_node": ranks_per_node,
        "nodes": m.nodes, "memory_bytes": int(mem_total),
        "timing": "host_clock" if platform.inline_kernels else "cuda_events",
        "kernel_overhead_ns": overhead,
        "issue_ns": m.issue_ns,
        "executor_host_op_ns": dict(m.host_op_ns),
        **({"python_after_kernel": m.cold_points} if m.cold_points else {}),
        "gemm": m.gemm_by_dtype[precision],
        "gemm_by_dtype": m.gemm_by_dtype,
        "default_dtype": precision,
        "gemm_shapes_by_dtype": m.gemm_shapes_by_dtype,
        "elementwise_bytes_per_s": m.mem_bytes_per_s,
        "elementwise_points": m.mem_points,
        "copy": copy,
        "collectives": m.collectives,
        "comm_slowdown": m.comm_slowdown,
        "comm_slowdown_during_compute": m.comm_slowdown_during_compute,
        "comm_latency_slowdown_during_compute": m.comm_latency_slowdown_during_compute,
        "caching_allocator": platform.caching_allocator,
        **({"cpu_cores": m.cpu_cores} if platform.inline_kernels else {}),
        **({"time_slice_ns": m.time_slice_ns} if m.time_slice_ns else {}),
        **({"rank_noise": m.rank_noise} if m.rank_noise is not None else {}),
        **({"rank_stalls": m.rank_stalls} if m.rank_stalls is not None else {}),
        **({"allocator": m.allocator} if m.allocator is not None else {}),
        **({"cache": m.cache} if m.cache is not None else {}),
        **({"host_costs": m.host_costs} if m.host_costs is not None else {}),
        **({"framework_kernels": m.framework_kernels} if m.framework_kernels is not None else {}),
        "alloc": {"malloc_base_ns": int(m.alloc_latency_s * 1e9), "malloc_ns_per_byte": m.alloc_s_per_byte * 1e9,
                  "free_base_ns": int(m.alloc_latency_s * 1e9), "free_ns_per_byte": 0.0, "points": m.alloc_points,
                  "first_touch_ns_per_byte": m.first_touch_s_per_byte * 1e9,
                  "unmap_ns_per_byte": m.unmap_s_per_byte * 1e9,
                  **({"page_report_period_ns": round(m.reported_pages[0] * 1e9),
                      "reported_page_extra_ns_per_byte": m.reported_pages[1] * 1e9} if m.reported_pages else {})},
    }


def host_memory() -> int:
    """The host's memory in bytes (Linux /proc/meminfo; 16 GiB where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 << 30


def device_name(device: torch.device) -> str:
    """The device a rank runs on: the GPU's name, or the host CPU's model (Linux
    /proc/cpuinfo), as ``CPU: <model>``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "CPU: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def describe(device: torch.device, devices: list[str] | None = None) -> str:
    if device.type == "cuda":
        return ", ".join(devices or [torch.cuda.get_device_name(device)])
    return f"{os.cpu_count()} CPU cores, torch {torch.__version__}"
