"""GPU kernel and copy times from public specs: a roofline per kernel.

GEMMs (and the batched matmuls of attention) run at a fraction of the tensor-core
peak that falls for small GEMMs by wave quantisation: output tiles of 128x128 spread
over the SMs, so a GEMM of fewer tiles than SMs leaves SMs idle. Other kernels are
memory-bound at the HBM bandwidth memory-bound kernels reach, or flop-bound at the
non-tensor fp32 peak, whichever is slower. Every kernel pays a fixed device overhead.
Host <-> device copies cross PCIe.
"""

from __future__ import annotations

from math import ceil

from commsim.hardware.sharing import IDLE, GpuResources, KernelNeeds, Taken, kernel_ns
from commsim.hardware.specs import US, GpuSpec
from commsim.ir import ops as O

GEMM_TILE = 128  # cuBLAS tensor-core CTA tile edge for large bf16 GEMMs
SMALL_COPY_LATENCY_NS = 10 * US  # a small cudaMemcpy across PCIe, end to end


class GpuKernels:
    """Kernel and copy times on one GPU, for a training precision."""

    def __init__(self, gpu: GpuSpec, pcie_bw_bytes_per_s: float, precision: str = "bf16"):
        self.gpu = gpu
        self.pcie_bw = pcie_bw_bytes_per_s
        peak = gpu.peak_tensor_flops_per_s
        # fp32 training runs its GEMMs as TF32: half the bf16 tensor peak on A100/H100.
        self.gemm_peak = peak / 2 if precision == "fp32" else peak
        self.mem_bw = gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency
        self.resources = GpuResources(gpu.sm_count, self.mem_bw)

    def wave_efficiency(self, g: O.GemmShape) -> float:
        tiles = ceil(g.m / GEMM_TILE) * ceil(g.n / GEMM_TILE) * g.batch
        waves = ceil(tiles / self.gpu.sm_count)
        return tiles / (waves * self.gpu.sm_count)

    def needs(self, op: O.Compute) -> KernelNeeds:
        """The kernel's fixed cost, arithmetic and memory times alone, bytes and tiles."""
        nbytes = op.bytes_read + op.bytes_written
        mem_s = nbytes / self.mem_bw
        tiles = 0
        if op.kind in (O.ComputeKind.GEMM, O.ComputeKind.ATTENTION) and op.gemm is not None:
            eff = self.gpu.gemm_max_efficiency * self.wave_efficiency(op.gemm)
            flop_s = op.flops / (self.gemm_peak * eff)
            g = op.gemm
            tiles = ceil(g.m / GEMM_TILE) * ceil(g.n / GEMM_TILE) * g.batch
        else:
            flop_s = op.flops / self.gpu.peak_fp32_flops_per_s
        return KernelNeeds(self.gpu.kernel_overhead_ns, flop_s * 1e9, mem_s * 1e9, float(nbytes), tiles)

    def compute_ns(self, op: O.Compute, taken: Taken = IDLE) -> int:
        return kernel_ns(self.needs(op), self.resources, taken)

    def copy_ns(self, op: O.Copy) -> int:
        if op.direction is O.CopyDirection.D2D:
            return self.gpu.kernel_overhead_ns + int(2 * op.size_bytes / self.mem_bw * 1e9)
        return SMALL_COPY_LATENCY_NS + int(op.size_bytes / self.pcie_bw * 1e9)
