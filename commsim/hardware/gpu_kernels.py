"""GPU kernel and copy times from public specs, priced by kernel class.

* GEMMs (``mm``, ``addmm``, the batched ``bmm`` of attention) by shape: the main loop
  runs at the peak of the training precision times the ceiling large GEMMs reach
  (``GpuSpec.gemm_max_efficiency``: a large square GEMM's rate, from G2, G4 and this
  workplace's H100 / H200), times wave quantisation (128x128 output tiles spread over
  the SMs: a GEMM of fewer tiles than a whole number of waves leaves SMs idle), times a
  misalignment loss when a leading dimension (n or k of C[m, n] = A[m, k] B[k, n],
  row-major as PyTorch stores them) is not a multiple of 16 bytes' worth of elements
  (cuBLAS then cannot use its vectorised tensor-core kernels, G5); or slower, if reading
  its inputs from HBM takes longer. Each output tile is stored after its main loop (the
  epilogue), so writing the output adds to that time: the small-k loss, large for the
  attention-score bmm whose output, the scores, is large beside its flops (G3: 130
  TFLOPS at k = 256, against 219 for the AV bmm of the same flops). fp32 GEMMs run at
  the fp32 CUDA-core peak (PyTorch's
  ``torch.backends.cuda.matmul.allow_tf32`` is False since 1.12); precision "tf32" runs
  them on tensor cores at half the 16-bit peak. A GPU without bf16 tensor cores (V100)
  runs bf16 GEMMs at ``GpuSpec.bf16_gemm_flops_per_s`` whatever the shape.
* memory-bound kernels at the fraction of HBM bandwidth their class reaches:
  elementwise, copies, reductions, embeddings and the optimizer at ``hbm_efficiency``
  (STREAM, M1), LayerNorm at ``norm_bw_efficiency`` (M2), softmax at
  ``softmax_bw_efficiency`` (M3), dropout at ``dropout_bw_efficiency`` (G3); or at the
  fp32 CUDA-core peak if their flops take longer.
* a fused attention kernel (kind ATTENTION: SDPA's FlashAttention-2 forward or backward,
  or an older schedule's fused core): its flops at the fraction of the 16-bit peak that
  FlashAttention-2 reaches (``GpuSpec.flash_attention_efficiency``, M3), or, on a GPU
  without that figure or in fp32, at the GEMM rate of its matmul shape; or its bytes at
  ``hbm_efficiency`` if they take longer.

Every kernel pays ``GpuSpec.kernel_overhead_ns`` on the device. Host <-> device copies
cross PCIe. A kernel's price is split into its arithmetic and its memory parts
(``KernelNeeds``) so that it can be priced beside collectives that hold some of the
GPU's SMs and HBM (``sharing``).
"""

from __future__ import annotations

from math import ceil

from commsim.hardware.sharing import IDLE, GpuResources, KernelNeeds, Taken, kernel_ns
from commsim.hardware.specs import US, GpuSpec
from commsim.ir import ops as O

GEMM_TILE = 128  # cuBLAS tensor-core CTA tile edge for large bf16 GEMMs
# G5: the same SwiGLU MLP on H100 reached 272.7 TFLOPS with d_ff 10922 (not a multiple
# of 8) and 398.4 with d_ff 10944: a misaligned GEMM runs at 0.684 of an aligned one.
GEMM_MISALIGNED = 272.7 / 398.4
ALIGN_BYTES = 16
# A small cudaMemcpy across PCIe, end to end. An estimate that no item of
# published-runs.md or measurement here gives yet: bench/gpu_check.py's "host round
# trips" line measures it (a pageable one-element copy, .item() after a kernel) when a
# GPU is at hand; until then it is the one copy constant without a source.
SMALL_COPY_LATENCY_NS = 10 * US

_PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4}


class GpuKernels:
    """Kernel and copy times on one GPU, for a training precision."""

    def __init__(self, gpu: GpuSpec, pcie_bw_bytes_per_s: float, precision: str = "bf16"):
        if precision not in _PRECISION_BYTES:
            raise ValueError(f"precision {precision!r}: allowed: {', '.join(_PRECISION_BYTES)}")
        self.gpu = gpu
        self.pcie_bw = pcie_bw_bytes_per_s
        self.align = ALIGN_BYTES // _PRECISION_BYTES[precision]
        peak = gpu.peak_tensor_flops_per_s
        self.flat_gemm_rate: float | None = None  # a rate whatever the shape
        # a fused attention kernel's rate (None: its matmul shape's GEMM rate)
        self.attention_rate: float | None = None
        if precision in ("bf16", "fp16") and gpu.flash_attention_efficiency is not None:
            self.attention_rate = peak * gpu.flash_attention_efficiency
        if precision == "fp32":
            self.gemm_peak = gpu.peak_fp32_flops_per_s
        elif precision == "tf32":
            self.gemm_peak = peak / 2  # TF32 tensor peak: half the 16-bit one (A100, H100 datasheets)
        else:
            self.gemm_peak = peak
            if precision == "bf16" and gpu.bf16_gemm_flops_per_s is not None:
                self.flat_gemm_rate = gpu.bf16_gemm_flops_per_s
        bw = gpu.hbm_bw_bytes_per_s
        self.mem_bw = bw * gpu.hbm_efficiency
        self.class_bw = {O.ComputeKind.NORM: bw * gpu.norm_bw_efficiency,
                         O.ComputeKind.SOFTMAX: bw * gpu.softmax_bw_efficiency,
                         O.ComputeKind.DROPOUT: bw * gpu.dropout_bw_efficiency}
        self.resources = GpuResources(gpu.sm_count, self.mem_bw)

    def wave_efficiency(self, g: O.GemmShape) -> float:
        tiles = ceil(g.m / GEMM_TILE) * ceil(g.n / GEMM_TILE) * g.batch
        waves = ceil(tiles / self.gpu.sm_count)
        return tiles / (waves * self.gpu.sm_count)

    def gemm_efficiency(self, g: O.GemmShape) -> float:
        """Fraction of the GEMM peak the main loop of a matmul of shape ``g`` reaches."""
        eff = self.gpu.gemm_max_efficiency * self.wave_efficiency(g)
        # the leading dimensions of row-major A (m x k), B (k x n) and C (m x n)
        if g.n % self.align or g.k % self.align:
            eff *= GEMM_MISALIGNED
        return eff

    def gemm_rate(self, g: O.GemmShape) -> float:
        """flops/s of a matmul of shape ``g``."""
        if self.flat_gemm_rate is not None:
            return self.flat_gemm_rate
        return self.gemm_peak * self.gemm_efficiency(g)

    def needs(self, op: O.Compute) -> KernelNeeds:
        """The kernel alone: fixed cost, arithmetic and memory times (its time is the fixed
        cost plus the larger), HBM bytes and output tiles. A GEMM's epilogue (writing its
        output after the main loop) adds to both parts, as it follows either."""
        kind, nbytes = op.kind, op.bytes_read + op.bytes_written
        tiles = 0
        if kind is O.ComputeKind.GEMM and op.gemm is not None:
            write = op.bytes_written / self.mem_bw
            flop = op.flops / self.gemm_rate(op.gemm) + write
            mem = op.bytes_read / self.mem_bw + write
            tiles = self._tiles(op.gemm)
        elif kind is O.ComputeKind.ATTENTION and op.gemm is not None:
            rate = self.gemm_rate(op.gemm) if self.attention_rate is None else self.attention_rate
            flop, mem = op.flops / rate, nbytes / self.mem_bw
            tiles = self._tiles(op.gemm)
        else:
            flop = op.flops / self.gpu.peak_fp32_flops_per_s
            mem = nbytes / self.class_bw.get(kind, self.mem_bw)
        return KernelNeeds(self.gpu.kernel_overhead_ns, flop * 1e9, mem * 1e9, float(nbytes), tiles)

    def _tiles(self, g: O.GemmShape) -> int:
        """Output tiles that waves spread over the SMs (none for a shape-blind rate)."""
        if self.flat_gemm_rate is not None:
            return 0
        return ceil(g.m / GEMM_TILE) * ceil(g.n / GEMM_TILE) * g.batch

    def compute_ns(self, op: O.Compute, taken: Taken = IDLE) -> int:
        return kernel_ns(self.needs(op), self.resources, taken)

    def copy_ns(self, op: O.Copy) -> int:
        if op.direction is O.CopyDirection.D2D:
            return self.gpu.kernel_overhead_ns + int(2 * op.size_bytes / self.mem_bw * 1e9)
        return SMALL_COPY_LATENCY_NS + int(op.size_bytes / self.pcie_bw * 1e9)
