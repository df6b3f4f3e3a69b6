"""The hardware profile document (commsim-hw-profile v1) a calibration writes.

``profile_document`` assembles what the benchmarks measured into the JSON object that
``commsim.hardware.profile`` loads: rates in bytes/s and flops/s, times in ns (the
benchmarks measure seconds; they are converted here, once), the platform's memory model
and, on CPUs, its cores, time slice and rank drift.
"""

from __future__ import annotations

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
    per_op_ns: int
    alloc_latency_s: float
    alloc_s_per_byte: float
    alloc_points: list[list[float]]  # [bytes, seconds]
    first_touch_s_per_byte: float
    cpu_cores: int
    time_slice_ns: int | None
    rank_noise: dict[str, float] | None


def profile_document(m: Measured, platform: Platform, device: torch.device, world: int,
                     ranks_per_node: int) -> dict[str, Any]:
    """The profile of ``world`` ranks (``ranks_per_node`` on each node) on ``platform``."""
    precision = default_precision(platform)
    mem_total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else host_memory()
    return {
        "kind": "commsim-hw-profile", "schema_version": PROFILE_SCHEMA_VERSION,
        "description": f"{world} ranks ({ranks_per_node} per node), {platform.backend}, {describe(device)}",
        "backend": platform.backend, "ranks_per_node": ranks_per_node, "memory_bytes": int(mem_total),
        "kernel_overhead_ns": max(int(m.mem_latency_s * 1e9), m.per_op_ns),
        "issue_ns": m.issue_ns,
        "gemm": m.gemm_by_dtype[precision],
        "gemm_by_dtype": m.gemm_by_dtype,
        "default_dtype": precision,
        "gemm_shapes_by_dtype": m.gemm_shapes_by_dtype,
        "elementwise_bytes_per_s": m.mem_bytes_per_s,
        "elementwise_points": m.mem_points,
        "copy": {"d2d_bytes_per_s": m.mem_bytes_per_s / 2, "h2d_bytes_per_s": m.mem_bytes_per_s / 2,
                 "latency_ns": int(m.mem_latency_s * 1e9)},
        "collectives": m.collectives,
        "comm_slowdown": m.comm_slowdown,
        "comm_slowdown_during_compute": m.comm_slowdown_during_compute,
        "comm_latency_slowdown_during_compute": m.comm_latency_slowdown_during_compute,
        "caching_allocator": platform.caching_allocator,
        **({"cpu_cores": m.cpu_cores} if platform.inline_kernels else {}),
        **({"time_slice_ns": m.time_slice_ns} if m.time_slice_ns else {}),
        **({"rank_noise": m.rank_noise} if m.rank_noise is not None else {}),
        "alloc": {"malloc_base_ns": int(m.alloc_latency_s * 1e9), "malloc_ns_per_byte": m.alloc_s_per_byte * 1e9,
                  "free_base_ns": int(m.alloc_latency_s * 1e9), "free_ns_per_byte": 0.0, "points": m.alloc_points,
                  "first_touch_ns_per_byte": m.first_touch_s_per_byte * 1e9},
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


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{os.cpu_count()} CPU cores, torch {torch.__version__}"
