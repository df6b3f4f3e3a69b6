"""Megatron-LM's GPT with its fused kernels: the model of Megatron's own published runs.

``GPTModel`` of Megatron-LM (tensor and pipeline parallel size 1), as its 2021 GPT runs
trained it: fp16, the fused kernels on (``--masked-softmax-fusion``,
``--bias-gelu-fusion``, ``--bias-dropout-fusion``, the defaults then), apex's fused
LayerNorm, learned positions, a GELU MLP of ``ffn``, the LM head the word embeddings'
weight. The 2021 source is not on this machine; the kernels are read from its successor,
megatron-core 0.3.0 (PyPI), whose local building blocks are the same code
(``fusions/``, ``tensor_parallel/layers.py``, ``transformer/dot_product_attention.py``,
``transformer/transformer_layer.py``; file:line below), and checked on the CPU where
they run (the ATen calls of each block under a dispatch logger; the saved tensors of a
layer under ``saved_tensors_hooks``: 34 s b h + 5 b heads s^2 bytes in fp16, Korthikanti
et al. 2022's count).

One layer, forward (the tensors are [s, b, h]; t = s b tokens, B = b x heads):

* ``input_layernorm``: apex ``FusedLayerNormAffineFunction``, one kernel; backward the
  gamma / beta gradients (two launches, one kernel here) and the input gradient.
* ``query_key_value``: ``F.linear`` with its bias (the bias added by the Linear itself,
  ``skip_bias_add`` off): the GEMM and the bias add (PyTorch 1.x), or one ``addmm`` (2.x).
  The heads are views of its output; backward concatenates q, k, v's gradients.
* QK^T: ``torch.baddbmm`` into a new tensor with beta 0 and alpha 1 / (sqrt(d) x layer)
  (DPA:104-110): no copies (cuBLAS takes the strided views); backward two bmm, each
  followed by a multiply by alpha (PyTorch's derivative of baddbmm).
* ``scale_mask_softmax``: ``ScaledUpperTriangMaskedSoftmax``, one CUDA kernel that
  scales, applies the causal mask and normalises in fp16 (SM:134-175), when 16 < s <=
  2048, s % 4 == 0 and B % 4 == 0 (2048: the 2021 kernel's limit, the inline comment at
  SM:149); backward one kernel in place. Otherwise, or with the fusion off
  (``"masked_softmax_fusion": false`` in config.json, Megatron's
  ``--no-masked-softmax-fusion``), PyTorch's chain (SM:183-198): to fp32, scale,
  masked_fill, softmax, back to fp16.
* ``attention_dropout``: ``native_dropout`` (inside the model-parallel RNG tracker's fork,
  which only swaps generator state on the host).
* AV: ``torch.bmm`` on the strided value view, then the context's
  ``permute(2, 0, 1, 3).contiguous()`` copy (its gradient needs none).
* ``dense``: the GEMM without its bias (``skip_bias_add``): the bias goes to
* bias-dropout-add: ``residual + dropout(x + bias)``, a TorchScript function; on CUDA
  TorchScript's autodiff writes dropout as ``rand_like < 1 - p`` times the input
  (symbolic_script.cpp, "specialized for cuda because cuda fuser can efficiently fuse
  those operations"), so the fuser runs it as one kernel writing the sum and a one-byte
  mask; backward one kernel (the gradient times the mask) and the bias's gradient (a
  column sum); the residual's gradient passes through.
* ``post_attention_layernorm``, ``dense_h_to_4h`` (no bias), bias-GELU (one TorchScript
  kernel, tanh formula, BG:14-17; backward one kernel, BG:23-31, and the bias's column
  sum), ``dense_4h_to_h`` (no bias), the second bias-dropout-add.

Outside the layers: word plus position embeddings, the embedding dropout, a transposing
copy to [s, b, h] before the first layer and back before the final LayerNorm
(ParallelTransformer's 2021 layout change), the logits GEMM with the word embeddings'
weight (megatron-core's ``output_layer``, a module there; a function call in 2021), and
Megatron's vocab-parallel cross-entropy on the logits cast to fp32 (CE:16-126).

Module names are megatron-core's legacy (Megatron-LM) ones; the order is the hooks'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from commsim.ir.ops import ComputeKind as K
from commsim.ir.ops import GemmShape
from commsim.models.eager import BOOL, FP32, INT64, Op, chain, kernel
from commsim.models.spec import Kernel, ModuleKind, ParamSpec, Role

if TYPE_CHECKING:
    from commsim.models.transformer import Builder

# ScaledUpperTriangMaskedSoftmax's range in 2021 (megatron-core 0.3.0 fused_softmax.py:149)
FUSED_SOFTMAX_MAX_SEQ = 2048


def fused_softmax_applies(s: int, attn_batches: int) -> bool:
    """Whether FusedScaleMaskSoftmax runs its causal CUDA kernel (SM:143-162)."""
    return 16 < s <= FUSED_SOFTMAX_MAX_SEQ and s % 4 == 0 and attn_batches % 4 == 0


class _Kernels:
    def __init__(self, bd: Builder):
        c = bd.cfg
        self.a, self.t, self.b, self.s = bd.dt, bd.t, bd.b, bd.s
        self.h, self.f, self.nh, self.hd = c.hidden, c.ffn, c.heads, c.head_dim
        self.B = self.b * self.nh
        self.S = self.B * self.s * self.s  # attention-score elements
        self.fused_softmax = c.softmax_fusion and fused_softmax_applies(self.s, self.B)

    def pw(self, name: str, shape: tuple[int, ...], read_bytes: int, kind: K = K.ELEMENTWISE, out: int | None = None,
           extra_written: int = 0) -> Kernel:
        return kernel(name, kind, shape, self.a if out is None else out, read_bytes, extra_written=extra_written)

    def layer_norm(self, name: str) -> Op:
        """apex's fused LayerNorm: one kernel; backward gamma / beta (a reduction) and the
        input gradient (cuComputePartGradGammaBeta + cuComputeGradGammaBeta, cuComputeGradInput)."""
        a, t, h = self.a, self.t, self.h
        fwd = kernel(name, K.NORM, (t, h), a, t * h * a + 2 * h * a, extra_written=2 * t * FP32)
        gb = kernel(f"{name}_bwd.gamma_beta", K.REDUCTION, (2, h), a, 2 * t * h * a + 2 * t * FP32, flops=2 * t * h)
        gi = kernel(f"{name}_bwd.input_grad", K.NORM, (t, h), a, 2 * t * h * a + 2 * t * FP32 + h * a)
        return Op((fwd,), (gb, gi))

    def bias_dropout_add(self, name: str) -> Op:
        """residual + dropout(x + bias), one fused kernel; backward the gradient times the
        mask, and the bias's column sum."""
        a, t, h = self.a, self.t, self.h
        th = t * h
        fwd = self.pw(name, (t, h), (2 * th + h) * a, K.DROPOUT, extra_written=th * BOOL)
        bwd = (self.pw(f"{name}_bwd", (t, h), th * a + th * BOOL, K.DROPOUT),
               kernel(f"{name}.bias_grad", K.REDUCTION, (h,), a, th * a, flops=th))
        return Op((fwd,), bwd)

    def bias_gelu(self) -> Op:
        a, t, f = self.a, self.t, self.f
        return Op((self.pw("bias_gelu", (t, f), (t * f + f) * a),),
                  (self.pw("bias_gelu_bwd", (t, f), (2 * t * f + f) * a),
                   kernel("bias_gelu.bias_grad", K.REDUCTION, (f,), a, t * f * a, flops=t * f)))

    def scores(self) -> Op:
        """baddbmm (alpha folded in) and the softmax: fused, or PyTorch's fp32 chain."""
        a, s, hd, B, S = self.a, self.s, self.hd, self.B, self.S
        g = GemmShape(s, s, hd, B)
        qk = kernel("qk", K.GEMM, (B, s, s), a, 2 * B * s * hd * a, flops=g.flops, gemm=g)
        gq, gk = GemmShape(s, hd, s, B), GemmShape(hd, s, s, B)
        bwd = (kernel("qk.grad_a", K.GEMM, (B, s, hd), a, (S + B * s * hd) * a, flops=gq.flops, gemm=gq),
               self.pw("qk.grad_a.alpha", (B, s, hd), B * s * hd * a),
               kernel("qk.grad_b", K.GEMM, (B, hd, s), a, (S + B * s * hd) * a, flops=gk.flops, gemm=gk),
               self.pw("qk.grad_b.alpha", (B, hd, s), B * s * hd * a))
        sc = (self.b, self.nh, s, s)
        if self.fused_softmax:
            soft = Op((self.pw("softmax", sc, S * a, K.SOFTMAX),), (self.pw("softmax_bwd", sc, 2 * S * a, K.SOFTMAX),))
        else:
            soft = chain(Op((self.pw("softmax.to_fp32", sc, S * a, out=FP32),),
                            (self.pw("softmax.to_fp32_bwd", sc, S * FP32),)),
                         Op((self.pw("softmax.scale", sc, S * FP32, out=FP32),),
                            (self.pw("softmax.scale_bwd", sc, S * FP32, out=FP32),)),
                         Op((self.pw("softmax.mask", sc, S * FP32 + self.b * s * s * BOOL, out=FP32),),
                            (self.pw("softmax.mask_bwd", sc, S * FP32 + self.b * s * s * BOOL, out=FP32),)),
                         Op((self.pw("softmax", sc, S * FP32, K.SOFTMAX, out=FP32),),
                            (self.pw("softmax_bwd", sc, 2 * S * FP32, K.SOFTMAX, out=FP32),)),
                         Op((self.pw("softmax.to_input", sc, S * FP32),),
                            (self.pw("softmax.to_input_bwd", sc, S * a, out=FP32),)))
        return Op((qk,), bwd) + soft

    def context(self) -> Op:
        """AV (bmm on the strided value view) and the context's permute copy."""
        a, s, hd, B, S = self.a, self.s, self.hd, self.B, self.S
        g = GemmShape(s, hd, s, B)
        av = kernel("av", K.GEMM, (B, s, hd), a, (S + B * s * hd) * a, flops=g.flops, gemm=g)
        gv, gp = GemmShape(s, hd, s, B), GemmShape(s, s, hd, B)
        bwd = (kernel("av.grad_b", K.GEMM, (B, s, hd), a, (S + B * s * hd) * a, flops=gv.flops, gemm=gv),
               kernel("av.grad_a", K.GEMM, (B, s, s), a, 2 * B * s * hd * a, flops=gp.flops, gemm=gp))
        return Op((av,), bwd) + Op((self.pw("context_copy", (self.t, self.h), self.t * self.h * a),))

    def cross_entropy(self, vocab: int) -> Op:
        """logits.float() and _VocabParallelCrossEntropy (CE:16-126) on t rows, then the
        loss mask's sum (pretrain_gpt.py); at one tensor-parallel rank its all-reduces
        launch nothing. Backward reuses the saved softmax in place."""
        t, a = self.t, self.a
        n = t * vocab
        rows, f4 = (t, vocab), FP32
        fwd = (self.pw("logits.float", rows, n * a, out=f4),
               kernel("ce.max", K.REDUCTION, (t,), f4, n * f4, extra_written=t * INT64, flops=n),
               self.pw("ce.sub_max", rows, n * f4 + t * f4, out=f4),
               self.pw("ce.target_logit", (t,), t * f4 + 2 * t * INT64, out=f4),
               self.pw("ce.exp", rows, n * f4, out=f4),
               kernel("ce.sum", K.REDUCTION, (t,), f4, n * f4, flops=n),
               self.pw("ce.loss", (t,), 2 * t * f4, out=f4),
               self.pw("ce.softmax", rows, n * f4 + t * f4, out=f4),
               self.pw("loss_mask.mul", (t,), 2 * t * f4, out=f4),
               kernel("loss_mask.sum", K.REDUCTION, (), f4, 2 * t * f4, flops=2 * t))
        bwd = (self.pw("loss_mask.mul_bwd", (t,), t * f4, out=f4),
               self.pw("ce.target_grad", (t,), t * f4 + t * INT64, out=f4),
               self.pw("ce.grad_mul", rows, n * f4 + t * f4, out=f4),
               self.pw("logits.float_bwd", rows, n * f4))
        return Op(fwd, bwd)


def _params(path: str, *specs: tuple[str, tuple[int, ...], Role]) -> tuple[ParamSpec, ...]:
    return tuple(ParamSpec(f"{path}.{n}", shape, role) for n, shape, role in specs)


def _layer(bd: Builder, k: _Kernels, L: str, i: int) -> None:
    c, e = bd.cfg, bd.e
    h, f, a, t = c.hidden, c.ffn, bd.dt, bd.t
    th, tf = t * h, t * f
    qkv, out, mlp, norm = Role.ATTENTION_QKV, Role.ATTENTION_OUT, Role.MLP, Role.NORM
    # Saved for backward, counted by the module that makes each tensor (a producer's
    # output kept by its consumer): 34 t h + 5 B s^2 bytes + the norms' fp32 statistics.
    with bd.container(L, block=i):
        # the layer input feeds the norm and the first residual: its gradients summed;
        # the norm keeps it (made by the previous layer, counted here) and its statistics
        first = Op((k.pw("to_sbh", (t, h), th * a),), (k.pw("to_sbh_bwd", (t, h), th * a),)) if i == 0 else Op()
        bd.module(f"{L}.input_layernorm", ModuleKind.NORM, norm, i,
                  first + e.accumulate("input_grad_sum", (t, h)) + k.layer_norm("norm"),
                  _params(f"{L}.input_layernorm", ("weight", (h,), norm), ("bias", (h,), norm)),
                  saved=th * a + 2 * t * FP32)
        with bd.container(f"{L}.self_attention", block=i):
            # q, k, v are views of the output; backward concatenates their gradients
            cat = Op(bwd=(k.pw("qkv_grad_cat", (t, 3 * h), 3 * th * a),))
            bd.module(f"{L}.self_attention.query_key_value", ModuleKind.LINEAR, qkv, i,
                      e.linear("", t, h, 3 * h, True) + cat,
                      _params(f"{L}.self_attention.query_key_value", ("weight", (3 * h, h), qkv),
                              ("bias", (3 * h,), qkv)), saved=th * a)
            # the scores' operands (the projection's output) and the softmax's output
            # (fp32 on PyTorch's path)
            bd.module(f"{L}.self_attention.scale_mask_softmax", ModuleKind.OTHER, Role.NONE, i, k.scores(),
                      saved=3 * th * a + k.S * (a if k.fused_softmax else FP32))
            drop = e.dropout("dropout", (k.b, k.nh, k.s, k.s), c.p_attention)
            bd.module(f"{L}.self_attention.attention_dropout", ModuleKind.OTHER, Role.NONE, i, drop,
                      saved=k.S * (BOOL + a) if c.p_attention > 0 else 0)
            bd.module(f"{L}.self_attention.dense", ModuleKind.LINEAR, out, i,
                      k.context() + e.linear("", t, h, h, False),
                      _params(f"{L}.self_attention.dense", ("weight", (h, h), out), ("bias", (h,), out)),
                      saved=th * a)
        # bias-dropout-add, then the sum (the norm's input and the second residual)
        bd.module(f"{L}.post_attention_layernorm", ModuleKind.NORM, norm, i,
                  k.bias_dropout_add("bias_dropout_add") + e.accumulate("input_grad_sum", (t, h))
                  + k.layer_norm("norm"),
                  _params(f"{L}.post_attention_layernorm", ("weight", (h,), norm), ("bias", (h,), norm)),
                  saved=th * BOOL + th * a + 2 * t * FP32)
        with bd.container(f"{L}.mlp", block=i):
            bd.module(f"{L}.mlp.dense_h_to_4h", ModuleKind.LINEAR, mlp, i, e.linear("", t, h, f, False) + k.bias_gelu(),
                      _params(f"{L}.mlp.dense_h_to_4h", ("weight", (f, h), mlp), ("bias", (f,), mlp)),
                      saved=th * a + tf * a)
            # the layer's second bias-dropout-add, after the MLP: charged to its last module
            bd.module(f"{L}.mlp.dense_4h_to_h", ModuleKind.LINEAR, mlp, i,
                      e.linear("", t, f, h, False) + k.bias_dropout_add("bias_dropout_add"),
                      _params(f"{L}.mlp.dense_4h_to_h", ("weight", (h, f), mlp), ("bias", (h,), mlp)),
                      saved=tf * a + th * BOOL)


def lower(bd: Builder) -> None:
    """Megatron-LM's GPTModel in hook order."""
    c, e = bd.cfg, bd.e
    h, t, a = c.hidden, bd.t, bd.dt
    k = _Kernels(bd)
    word = "language_model.embedding.word_embeddings"
    with bd.container(""):
        with bd.container("language_model"):
            with bd.container("language_model.embedding"):
                bd.embedding(word, c.vocab, after=e.accumulate("tied_grad", (c.vocab, h)) if c.tie_embeddings
                             else Op(), saved=t * INT64)
                bd.embedding("language_model.embedding.position_embeddings", c.max_positions, saved=t * INT64)
                # words + positions, then dropout (keeps its mask; its output is the
                # first layer's input, counted there)
                bd.dropout("language_model.embedding.embedding_dropout", None, (t, h), c.p_hidden,
                           before=e.add("add_positions", (t, h)), saved=t * h * BOOL if c.p_hidden > 0 else 0)
            with bd.container("language_model.encoder"):
                for i in range(c.layers):
                    _layer(bd, k, f"language_model.encoder.layers.{i}", i)
                # back to [b, s, h], then the final norm (keeps its input and statistics)
                back = Op((k.pw("to_bsh", (t, h), t * h * a),), (k.pw("to_bsh_bwd", (t, h), t * h * a),))
                bd.module("language_model.encoder.final_layernorm", ModuleKind.NORM, Role.NORM, None,
                          back + k.layer_norm("norm"),
                          _params("language_model.encoder.final_layernorm", ("weight", (h,), Role.NORM),
                                  ("bias", (h,), Role.NORM)), saved=t * h * a + 2 * t * FP32)
        # the logits with the word embeddings' weight (the final norm's output kept), the
        # fp32 cast and Megatron's cross-entropy (its fp32 softmax kept)
        bd.linear("output_layer", h, c.vocab, Role.LM_HEAD, None, bias=False,
                  weight_name=f"{word}.weight" if c.tie_embeddings else None, after=k.cross_entropy(c.vocab),
                  saved=t * h * a + t * c.vocab * FP32 + t * (BOOL + INT64))
    assert t == bd.t
