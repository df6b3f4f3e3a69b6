"""The kernels PyTorch's eager mode launches for the calls Hugging Face's modules make.

Each function returns an ``Op``: the forward kernels of one PyTorch call (``F.linear``,
``torch.matmul``, ``softmax``, ...) and the kernels autograd runs for it in backward, in
the order they run. ``a + b`` is ``a`` then ``b``: forward in that order, backward in the
reverse (autograd's engine runs a straight chain last-in first-out). An ``Op`` with
backward kernels only stands for work autograd adds without a forward kernel: the
gradient of a tensor used twice is summed (``accumulate``), a gradient that arrives in a
layout a view cannot take is copied (``grad_copy``).

One kernel is one ATen call as the dispatcher sees it, on CUDA: dropout is the fused
``native_dropout`` (output and a one-byte mask), softmax one row-wise kernel, LayerNorm
``native_layer_norm`` (its mean and rstd in fp32, CUDA's accumulation type). Where CUDA
runs one such call as more than one launch (LayerNorm backward: input gradient, then
weight and bias gradients; ``slice_backward``: zero fill, then copy), it is one kernel
with the call's bytes. Views (view, transpose, expand, split, ...) launch nothing.

Bytes count each tensor read once and each tensor written once; a broadcast operand
counts by its own size. Flops: 2 per multiply-add in matmuls, one per output element in
other kernels (they are priced by bytes). ``TorchBehaviour`` says which PyTorch the
Linear layers follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from commsim.ir.ops import ComputeKind, GemmShape
from commsim.models.spec import Kernel

K = ComputeKind
FP32, INT64, BOOL = 4, 8, 1


@dataclass(frozen=True, slots=True)
class TorchBehaviour:
    """The PyTorch whose kernels the inventory follows.

    ``fused_linear_bias``: PyTorch 2.x runs ``F.linear`` with a bias on a contiguous 3-D
    input as one ``addmm`` (aten/src/ATen/native/Linear.cpp ``_flatten_nd_linear``; on
    CUDA the bias rides in cuBLASLt's epilogue), and GPT-2's ``Conv1D`` calls ``addmm``
    itself. PyTorch 1.x (1.10: the seed scenario's) runs ``matmul`` and then ``add_`` of
    the bias, and its CUDA ``addmm`` first copies the bias into the output, then runs
    the GEMM with beta = 1: a separate kernel either way. Backward is the same two GEMMs
    and a column sum for the bias gradient in both.
    """

    fused_linear_bias: bool = False


PYTORCH_1_10 = TorchBehaviour(fused_linear_bias=False)
PYTORCH_2 = TorchBehaviour(fused_linear_bias=True)


@dataclass(frozen=True, slots=True)
class Op:
    fwd: tuple[Kernel, ...] = ()
    bwd: tuple[Kernel, ...] = ()

    def __add__(self, other: "Op") -> "Op":
        return Op(self.fwd + other.fwd, other.bwd + self.bwd)


def chain(*ops: Op) -> Op:
    out = Op()
    for op in ops:
        out = out + op
    return out


def dtype_name(nbytes: int) -> str:
    return {1: "bool", 2: "bf16", 4: "fp32", 8: "int64"}[nbytes]


def kernel(name: str, kind: ComputeKind, shape: tuple[int, ...], out_bytes: int, read: int,
           extra_written: int = 0, flops: int | None = None, gemm: GemmShape | None = None) -> Kernel:
    """A kernel writing ``shape`` of ``out_bytes``-byte elements (plus ``extra_written``)."""
    n = prod(shape)
    return Kernel(name, kind, n if flops is None else flops, read, n * out_bytes + extra_written, gemm, shape,
                  dtype_name(out_bytes))


class Eager:
    """Op builders for activations of ``a`` bytes per element."""

    def __init__(self, a: int, torch: TorchBehaviour = PYTORCH_1_10):
        self.a = a
        self.torch = torch

    # ------------------------------------------------------------ pointwise
    def pointwise(self, name: str, shape: tuple[int, ...], *inputs: int, out: int | None = None,
                  kind: ComputeKind = K.ELEMENTWISE) -> Kernel:
        """Reads the ``inputs`` (element counts of ``a``-byte tensors), writes ``shape``."""
        return kernel(name, kind, shape, self.a if out is None else out, sum(inputs) * self.a)

    def copy(self, name: str, shape: tuple[int, ...]) -> Op:
        """``.contiguous()`` / the copy ``reshape`` makes of a tensor no view can take."""
        return Op((self.pointwise(name, shape, prod(shape)),))

    def grad_copy(self, name: str, shape: tuple[int, ...]) -> Op:
        return Op(bwd=(self.pointwise(name, shape, prod(shape)),))

    def accumulate(self, name: str, shape: tuple[int, ...]) -> Op:
        """A tensor used twice: autograd sums its second gradient into the first."""
        n = prod(shape)
        return Op(bwd=(self.pointwise(name, shape, n, n),))

    def add(self, name: str, shape: tuple[int, ...], other: int | None = None) -> Op:
        """``x + y`` (``other``: y's element count when broadcast); the gradient passes through."""
        n = prod(shape)
        return Op((self.pointwise(name, shape, n, n if other is None else other),))

    def scale(self, name: str, shape: tuple[int, ...]) -> Op:
        """Multiply (or divide) by a Python scalar; backward multiplies the gradient."""
        n = prod(shape)
        return Op((self.pointwise(name, shape, n),), (self.pointwise(f"{name}_bwd", shape, n),))

    def mul(self, name: str, shape: tuple[int, ...]) -> Op:
        """``x * y`` of two same-shape tensors that both need gradients."""
        n = prod(shape)
        return Op((self.pointwise(name, shape, n, n),),
                  (self.pointwise(f"{name}_bwd_a", shape, n, n), self.pointwise(f"{name}_bwd_b", shape, n, n)))

    def unary(self, name: str, shape: tuple[int, ...]) -> Op:
        """An activation (gelu, silu, relu): backward reads the gradient and the input."""
        n = prod(shape)
        return Op((self.pointwise(name, shape, n),), (self.pointwise(f"{name}_bwd", shape, n, n),))

    def gelu_new(self, name: str, shape: tuple[int, ...]) -> Op:
        """Hugging Face's ``NewGELUActivation`` (GPT-2's ``gelu_new``), written in Python:
        0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))): 8 kernels forward, 11
        backward (autograd of each call, the two gradients of x summed)."""
        n = prod(shape)
        p = self.pointwise
        fwd = (p(f"{name}.half_x", shape, n), p(f"{name}.pow", shape, n), p(f"{name}.mul_c", shape, n),
               p(f"{name}.add_x", shape, n, n), p(f"{name}.mul_sqrt", shape, n), p(f"{name}.tanh", shape, n),
               p(f"{name}.add_one", shape, n), p(f"{name}.mul", shape, n, n))
        bwd = (p(f"{name}.mul_bwd_a", shape, n, n), p(f"{name}.mul_bwd_b", shape, n, n),
               p(f"{name}.tanh_bwd", shape, n, n), p(f"{name}.mul_sqrt_bwd", shape, n),
               p(f"{name}.mul_c_bwd", shape, n), p(f"{name}.pow_bwd.pow", shape, n),
               p(f"{name}.pow_bwd.scale", shape, n), p(f"{name}.pow_bwd.mul", shape, n, n),
               p(f"{name}.accumulate", shape, n, n), p(f"{name}.half_x_bwd", shape, n),
               p(f"{name}.accumulate", shape, n, n))
        return Op(fwd, bwd)

    def cast(self, name: str, shape: tuple[int, ...], src: int, dst: int) -> Kernel:
        n = prod(shape)
        return kernel(name, K.ELEMENTWISE, shape, dst, n * src)

    # ------------------------------------------------------------ matmuls
    def linear(self, name: str, t: int, d_in: int, d_out: int, bias: bool, conv1d: bool = False,
               grad_copy: tuple[int, ...] | None = None) -> Op:
        """A Linear (or GPT-2's ``Conv1D``, weight stored in x out) on ``t`` tokens.

        Forward: one GEMM, with the bias in it (PyTorch 2) or a separate bias kernel
        (PyTorch 1.x: ``add_`` after ``matmul``; Conv1D's ``addmm`` copies the bias into
        the output first, then the GEMM reads it with beta = 1). Backward: the input
        gradient (dgrad), the weight gradient (wgrad) and the bias gradient (a column
        sum), in the order autograd runs them: ``AddmmBackward0`` dgrad, wgrad, bias;
        ``MmBackward0`` wgrad, dgrad; PyTorch 1.x's ``AddBackward0`` (bias) first.
        ``grad_copy``: the incoming gradient must be copied before the GEMMs (it arrives
        transposed from the attention heads and the 2-D view of it needs a copy).
        """
        a = self.a

        def nm(suffix: str) -> str:
            return f"{name}.{suffix}" if name else suffix

        w = d_in * d_out * a
        gemm_in, gemm_out = t * d_in * a, t * d_out * a
        out = (t, d_out)
        fused = bias and (self.torch.fused_linear_bias)
        fwd: list[Kernel] = []
        if bias and not fused and conv1d:
            fwd.append(kernel(nm("bias_copy"), K.ELEMENTWISE, out, a, d_out * a))
        g = GemmShape(t, d_out, d_in)
        read = gemm_in + w + (d_out * a if fused else 0) + (gemm_out if bias and not fused and conv1d else 0)
        fwd.append(kernel(name or "fwd", K.GEMM, out, a, read, flops=g.flops, gemm=g))
        if bias and not fused and not conv1d:
            fwd.append(kernel(nm("bias_add"), K.ELEMENTWISE, out, a, gemm_out + d_out * a))
        dg = GemmShape(t, d_in, d_out)
        dgrad = kernel(nm("dgrad"), K.GEMM, (t, d_in), a, gemm_out + w, flops=dg.flops, gemm=dg)
        wg = GemmShape(d_in, d_out, t) if conv1d else GemmShape(d_out, d_in, t)
        wgrad = kernel(nm("wgrad"), K.GEMM, (wg.m, wg.n), a, gemm_out + gemm_in, flops=wg.flops, gemm=wg)
        bgrad = kernel(nm("bias_grad"), K.REDUCTION, (d_out,), a, gemm_out, flops=t * d_out)
        copy = (self.pointwise(nm("grad_copy"), grad_copy, prod(grad_copy)),) if grad_copy else ()
        if not bias:
            bwd = copy + (wgrad, dgrad)
        elif fused or conv1d:  # addmm's backward
            bwd = copy + (dgrad, wgrad, bgrad)
        else:  # add_'s backward (the bias), then matmul's
            bwd = (bgrad,) + copy + (wgrad, dgrad)
        return Op(tuple(fwd), bwd)

    def bmm(self, name: str, batch: int, m: int, n: int, k: int) -> Op:
        """``torch.matmul`` of 4-D tensors, folded to a batched GEMM C = A B; backward
        (``BmmBackward0``) the gradient of B (A^T dC), then of A (dC B^T)."""
        a = self.a
        g = GemmShape(m, n, k, batch)
        fwd = kernel(name, K.GEMM, (batch, m, n), a, batch * (m * k + k * n) * a, flops=g.flops, gemm=g)
        gb = GemmShape(k, n, m, batch)
        ga = GemmShape(m, k, n, batch)
        bwd = (kernel(f"{name}.grad_b", K.GEMM, (batch, k, n), a, batch * (m * k + m * n) * a, flops=gb.flops, gemm=gb),
               kernel(f"{name}.grad_a", K.GEMM, (batch, m, k), a, batch * (m * n + k * n) * a, flops=ga.flops, gemm=ga))
        return Op((fwd,), bwd)

    def sdpa(self, name: str, b: int, heads: int, kv_heads: int, s: int, hd: int) -> Op:
        """``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` with no mask, as
        SDPA runs it in 16 bits on Ampere / Hopper: one fused FlashAttention kernel
        (``_scaled_dot_product_flash_attention``) reading q, k, v (k and v with their own
        heads: grouped queries need no repeat) and writing the output and the row
        log-sum-exp (fp32); backward one kernel reading the gradient, q, k, v, the output
        and the log-sum-exp, writing the three input gradients. Flops: the two matmuls
        (4 b heads s^2 hd) over the half a causal kernel computes; backward recomputes the
        scores and runs four more (2.5x, FlashAttention-2's count). ``gemm``: the score
        matmul's shape, whose flops the forward's equal."""
        a = self.a
        q = b * heads * s * hd
        kv = b * kv_heads * s * hd
        lse = b * heads * s * FP32
        fwd_flops = 4 * b * heads * s * s * hd // 2
        g = GemmShape(s, s, hd, b * heads)
        shape = (b, heads, s, hd)
        fwd = kernel(name, K.ATTENTION, shape, a, (q + 2 * kv) * a, extra_written=lse, flops=fwd_flops, gemm=g)
        bwd = kernel(f"{name}_bwd", K.ATTENTION, shape, a, (3 * q + 2 * kv) * a + lse, extra_written=2 * kv * a,
                     flops=fwd_flops * 5 // 2, gemm=g)
        return Op((fwd,), (bwd,))

    # ------------------------------------------------------------ row-wise kernels
    def softmax(self, name: str, shape: tuple[int, ...], elem: int | None = None) -> Op:
        """Softmax over the last dim (of ``elem``-byte elements); backward reads the
        gradient and the output."""
        e = self.a if elem is None else elem
        n = prod(shape)
        return Op((kernel(name, K.SOFTMAX, shape, e, n * e),),
                  (kernel(f"{name}_bwd", K.SOFTMAX, shape, e, 2 * n * e),))

    def dropout(self, name: str, shape: tuple[int, ...], p: float) -> Op:
        """``native_dropout``: writes the output and a one-byte mask; backward reads the
        gradient and the mask. p = 0 launches nothing (ATen returns the input)."""
        if p <= 0:
            return Op()
        n = prod(shape)
        a = self.a
        return Op((kernel(name, K.DROPOUT, shape, a, n * a, extra_written=n),),
                  (kernel(f"{name}_bwd", K.DROPOUT, shape, a, n * a + n),))

    def layer_norm(self, name: str, t: int, h: int) -> Op:
        """``native_layer_norm`` over ``h`` (weight and bias); mean and rstd per row in fp32."""
        a = self.a
        fwd = kernel(name, K.NORM, (t, h), a, t * h * a + 2 * h * a, extra_written=2 * t * FP32)
        bwd = kernel(f"{name}_bwd", K.NORM, (t, h), a, 2 * t * h * a + 2 * t * FP32 + 2 * h * a,
                     extra_written=2 * h * a)
        return Op((fwd,), (bwd,))

    def rms_norm(self, name: str, t: int, h: int) -> Op:
        """Hugging Face's ``LlamaRMSNorm``, written in Python: x.to(fp32), pow, mean, + eps,
        rsqrt, multiply, back to the input dtype, times the weight: 8 kernels forward and
        the 16 autograd runs for them backward."""
        a, n = self.a, t * h
        rows, sh = (t, 1), (t, h)
        f = FP32

        def k(nm: str, shape: tuple[int, ...], out: int, read: int, kind: ComputeKind = K.ELEMENTWISE) -> Kernel:
            return kernel(f"{name}.{nm}", kind, shape, out, read)

        fwd = (k("to_fp32", sh, f, n * a), k("pow", sh, f, n * f), k("mean", rows, f, n * f, K.REDUCTION),
               k("add_eps", rows, f, t * f), k("rsqrt", rows, f, t * f), k("mul_rstd", sh, f, n * f + t * f),
               k("to_input", sh, a, n * f), k("mul_weight", sh, a, n * a + h * a))
        bwd = (k("mul_weight_bwd", sh, a, n * a + h * a), k("weight_grad.mul", sh, a, 2 * n * a),
               k("weight_grad.sum", (h,), a, n * a, K.REDUCTION), k("to_input_bwd", sh, f, n * a),
               k("mul_rstd_bwd.rstd", sh, f, 2 * n * f), k("mul_rstd_bwd.x", sh, f, n * f + t * f),
               k("rstd_grad.sum", rows, f, n * f, K.REDUCTION), k("rsqrt_bwd.pow", rows, f, t * f),
               k("rsqrt_bwd.scale", rows, f, t * f), k("rsqrt_bwd.mul", rows, f, 2 * t * f),
               k("mean_bwd", sh, f, t * f), k("pow_bwd.pow", sh, f, n * f), k("pow_bwd.scale", sh, f, n * f),
               k("pow_bwd.mul", sh, f, 2 * n * f), k("accumulate", sh, f, 2 * n * f), k("to_fp32_bwd", sh, a, n * f))
        return Op(fwd, bwd)

    def rotary(self, name: str, shape: tuple[int, ...], s: int, hd: int) -> Op:
        """Hugging Face's ``apply_rotary_pos_emb`` on one of q / k (``shape`` b, heads, s, hd):
        x * cos + cat(-x2, x1) * sin, cos and sin of (1, 1, s, hd)."""
        n, cs = prod(shape), s * hd
        half = shape[:-1] + (shape[-1] // 2,)
        p = self.pointwise
        fwd = (p(f"{name}.mul_cos", shape, n, cs), p(f"{name}.neg", half, n // 2), p(f"{name}.cat", shape, n),
               p(f"{name}.mul_sin", shape, n, cs), p(f"{name}.add", shape, n, n))
        bwd = (p(f"{name}.mul_sin_bwd", shape, n, cs), p(f"{name}.neg_bwd", half, n // 2),
               p(f"{name}.slice_bwd", shape, n // 2), p(f"{name}.slice_bwd", shape, n // 2),
               p(f"{name}.accumulate", shape, n, n), p(f"{name}.mul_cos_bwd", shape, n, cs),
               p(f"{name}.accumulate", shape, n, n))
        return Op(fwd, bwd)

    def repeat_kv(self, name: str, b: int, kvh: int, rep: int, s: int, hd: int) -> Op:
        """Grouped-query attention's ``repeat_kv``: expand then reshape (a copy); backward
        sums the repeats."""
        src, out = b * kvh * s * hd, (b, kvh, rep, s, hd)
        return Op((self.pointwise(name, out, src),),
                  (kernel(f"{name}_bwd", K.REDUCTION, (b, kvh, 1, s, hd), self.a, src * rep * self.a),))

    # ------------------------------------------------------------ embeddings and the loss
    def embedding(self, name: str, t: int, rows: int, h: int) -> Op:
        """Gather ``t`` rows (int64 ids); backward writes the dense (rows, h) gradient."""
        a = self.a
        return Op((kernel(name, K.EMBEDDING, (t, h), a, t * h * a + t * INT64),),
                  (kernel(f"{name}_bwd", K.EMBEDDING, (rows, h), a, t * h * a + t * INT64),))

    def cross_entropy(self, name: str, rows: int, vocab: int, elem: int | None = None) -> Op:
        """``CrossEntropyLoss`` over ``rows`` logits: log_softmax, then nll_loss; backward
        nll_loss_backward (a zeroed (rows, vocab) gradient with one entry per row) and the
        log_softmax backward. The loss's own seed gradient (a one-element fill) starts it."""
        e = self.a if elem is None else elem
        n = rows * vocab
        fwd = (kernel(f"{name}.log_softmax", K.SOFTMAX, (rows, vocab), e, n * e),
               kernel(f"{name}.nll", K.REDUCTION, (), e, rows * e + rows * INT64, extra_written=e))
        bwd = (kernel(f"{name}.seed_grad", K.ELEMENTWISE, (), e, 0),
               # reads the targets, the incoming gradient and the total weight
               kernel(f"{name}.nll_bwd", K.ELEMENTWISE, (rows, vocab), e, rows * INT64 + 2 * e),
               kernel(f"{name}.log_softmax_bwd", K.SOFTMAX, (rows, vocab), e, 2 * n * e))
        return Op(fwd, bwd)
