"""DeepSpeed's bing_bert: BERT pre-training with DeepSpeed's fused transformer kernel.

``BertForPreTrainingPreLN`` of DeepSpeedExamples' bing_bert (``nvidia/modelingpreln.py``,
NVIDIA's BERT modeling with pre-LayerNorm; that file is not on this machine, its tree is
written here from the source it derives from) with every encoder layer a
``deepspeed.ops.transformer.DeepSpeedTransformerLayer``: one module holding the whole
layer's twelve parameters, whose forward and backward are one custom autograd Function
calling DeepSpeed's CUDA layer (``csrc/transformer/ds_transformer_cuda.cpp``). This is
the model of DeepSpeed PR 1188's measurements (published-runs.md E2): under ZeRO-3 a
layer is one module, so one fetch gathers all of it, and hooks fire once per layer.

The layer's kernels are those ``BertTransformerLayer<T>::Forward`` and ``::Backward``
launch (DeepSpeed 0.5.10, identical in 0.19.8 but for the workspace's class), in order,
for the configuration E2 ran: pre-LayerNorm, ``attn_dropout_checkpoint`` and
``gelu_checkpoint`` on (the attention-probability dropout and the GELU are recomputed
in backward instead of kept), ``normalize_invertible`` off, ``stochastic_mode`` off.
Without ``stochastic_mode`` both Forward and Backward begin with
``cudaStreamSynchronize(_stream)`` (ds_transformer_cuda.cpp:177 and :337 in 0.5.10): the
host waits for the compute stream to drain before it launches the layer, every layer,
each way. The module carries that as ``sync_before_fwd`` / ``sync_before_bwd``.

Outside the encoder the modules are NVIDIA's BERT's: embeddings (word, position, token
type, LayerNorm, dropout), the final LayerNorm of the pre-LN encoder, the pooler (a
tanh Linear on the first token), and the pre-training heads. The masked-LM head keeps
only the masked positions: ``torch.nonzero`` over the labels (a device-to-host copy of
the count, so the host waits for the stream) and ``index_select`` after the head's
transform, so its decoder GEMM and loss cover ``round(0.15 * seq)`` positions per
sequence (BERT's masking rate, as create_pretraining_data.py computes it).

Memory: the layer's backward intermediates live in its workspace (cudaMalloc'd once,
outside PyTorch's caching allocator); ``grad_memory``'s chain temporaries, replayed from
the kernels' outputs, stand for it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from commsim.ir.ops import ComputeKind as K
from commsim.ir.ops import GemmShape
from commsim.models.eager import BOOL, Op, kernel
from commsim.models.spec import Kernel, ModuleKind, ParamSpec, Role

if TYPE_CHECKING:
    from commsim.models.transformer import Builder

# BERT's masked-LM rate (Devlin et al. 2019; create_pretraining_data.py masked_lm_prob)
MASKED_LM_PROB = 0.15
# DeepSpeedTransformerLayer's parameters in registration order (ops/transformer/
# transformer.py, 0.5.10 lines 488-507), by (name, shape in terms of h and ffn)
LAYER_PARAMS = ("attn_qkvw", "attn_qkvb", "attn_ow", "attn_ob", "attn_nw", "attn_nb", "inter_w", "inter_b",
                "output_w", "output_b", "norm_w", "norm_b")


def masked_positions(seq: int) -> int:
    """Positions per sequence the masked-LM head scores: create_pretraining_data.py's
    ``min(max_predictions_per_seq, max(1, round(len * masked_lm_prob)))`` for a full
    sequence (the cap, 20 at 128 and 80 at 512 in NVIDIA's scripts, is never reached)."""
    return max(1, round(seq * MASKED_LM_PROB))


def layer_params(path: str, h: int, ffn: int) -> tuple[ParamSpec, ...]:
    shapes = ((3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (ffn, h), (ffn,), (h, ffn), (h,), (h,), (h,))
    qkv, out, norm, mlp = Role.ATTENTION_QKV, Role.ATTENTION_OUT, Role.NORM, Role.MLP
    roles = (qkv, qkv, out, out, norm, norm, mlp, mlp, mlp, mlp, norm, norm)
    return tuple(ParamSpec(f"{path}.{n}", s, r) for n, s, r in zip(LAYER_PARAMS, shapes, roles))


class _Kernels:
    """The CUDA layer's launches for ``t`` tokens of ``b`` sequences of ``s``."""

    def __init__(self, bd: Builder):
        c = bd.cfg
        self.a, self.t, self.b, self.s = bd.dt, bd.t, bd.b, bd.s
        self.h, self.f, self.nh, self.hd = c.hidden, c.ffn, c.heads, c.head_dim
        self.scores = self.b * self.nh * self.s * self.s

    def pw(self, name: str, kind: K, shape: tuple[int, ...], read_bytes: int, extra_written: int = 0) -> Kernel:
        """A memory-bound kernel writing ``shape`` in the layer's dtype."""
        return kernel(name, kind, shape, self.a, read_bytes, extra_written=extra_written)

    def gemm(self, name: str, m: int, n: int, k: int, batch: int = 1) -> Kernel:
        g = GemmShape(m, n, k, batch)
        return kernel(name, K.GEMM, (batch, m, n) if batch > 1 else (m, n), self.a, batch * (m * k + k * n) * self.a,
                      flops=g.flops, gemm=g)

    def norm_fwd(self, name: str) -> Kernel:
        # fused_bias_residual_layer_norm: reads x, gamma, beta; writes y and the row
        # variance and mean (in the layer's dtype: ds_transformer_cuda.cpp's options)
        t, h, a = self.t, self.h, self.a
        return kernel(name, K.NORM, (t, h), a, (t * h + 2 * h) * a, extra_written=2 * t * a)

    def norm_bwd_fused_add(self, name: str) -> tuple[Kernel, Kernel]:
        # launch_layerNorm_backward_fused_add: LayerNormBackward1 (gamma and beta
        # gradients: reads the gradient and the norm's output), then
        # LayerNormBackward2_fused_add (the input gradient plus the residual's gradient)
        t, h, a = self.t, self.h, self.a
        k1 = kernel(f"{name}.gamma_beta", K.REDUCTION, (2, h), a, (2 * t * h + 2 * h) * a, flops=2 * t * h)
        k2 = kernel(f"{name}.input_grad", K.NORM, (t, h), a, (3 * t * h + h + 2 * t) * a)
        return k1, k2

    def linear_bwd(self, name: str, d_in: int, d_out: int) -> tuple[Kernel, ...]:
        # FeedForward::Backward: the weight gradient, the input gradient, then
        # launch_fuse_transpose_bias_kernel (the bias gradient: a column sum)
        t, a = self.t, self.a
        wg = GemmShape(d_out, d_in, t)
        dg = GemmShape(t, d_in, d_out)
        return (kernel(f"{name}.wgrad", K.GEMM, (d_out, d_in), a, t * (d_in + d_out) * a, flops=wg.flops, gemm=wg),
                kernel(f"{name}.dgrad", K.GEMM, (t, d_in), a, (t * d_out + d_in * d_out) * a, flops=dg.flops, gemm=dg),
                kernel(f"{name}.bias_grad", K.REDUCTION, (d_out,), a, t * d_out * a, flops=t * d_out))

    def forward(self) -> tuple[Kernel, ...]:
        a, t, h, f, s, bh, S = self.a, self.t, self.h, self.f, self.s, self.b * self.nh, self.scores
        th = t * h
        sc = (self.b, self.nh, s, s)
        return (
            self.norm_fwd("layer_norm"),
            self.gemm("qkv", t, 3 * h, h),
            self.pw("bias_add_transform_0213", K.ELEMENTWISE, (3, self.b, self.nh, s, self.hd), (3 * th + 3 * h) * a),
            self.gemm("attn_scores", s, s, self.hd, bh),  # the 1/sqrt(d) scale is the GEMM's alpha
            self.pw("softmax", K.SOFTMAX, sc, (S + self.b * s) * a),  # the mask is added inside it
            self.pw("attn_prob_dropout", K.DROPOUT, sc, S * a, extra_written=S * BOOL),
            self.gemm("attn_context", s, self.hd, s, bh),
            self.pw("transform4d_0213", K.ELEMENTWISE, (t, h), th * a),
            self.gemm("attn_out", t, h, h),
            # dropout(x + bias) + residual: writes the sum and the one-byte mask
            self.pw("attn_output_dropout", K.DROPOUT, (t, h), (2 * th + h) * a, extra_written=th * BOOL),
            self.norm_fwd("attn_layer_norm"),
            self.gemm("ff1", t, f, h),
            self.pw("bias_gelu", K.ELEMENTWISE, (t, f), (t * f + f) * a),
            self.gemm("ff2", t, h, f),
            self.pw("layer_output_dropout", K.DROPOUT, (t, h), (2 * th + h) * a, extra_written=th * BOOL),
        )

    def backward(self) -> tuple[Kernel, ...]:
        a, t, h, f, s, bh, S, hd = self.a, self.t, self.h, self.f, self.s, self.b * self.nh, self.scores, self.hd
        th = t * h
        sc = (self.b, self.nh, s, s)
        return (
            self.pw("layer_output_dropout_bwd", K.DROPOUT, (t, h), th * a + th * BOOL),
            self.pw("bias_gelu_recompute", K.ELEMENTWISE, (t, f), (t * f + f) * a),  # gelu_checkpoint
            *self.linear_bwd("ff2", f, h),
            self.pw("bias_gelu_bwd", K.ELEMENTWISE, (t, f), (2 * t * f + f) * a),
            *self.linear_bwd("ff1", h, f),
            *self.norm_bwd_fused_add("attn_layer_norm_bwd"),
            self.pw("attn_output_dropout_bwd", K.DROPOUT, (t, h), th * a + th * BOOL),
            *self.linear_bwd("attn_out", h, h),
            self.pw("transform_0213", K.ELEMENTWISE, (t, h), th * a),
            # attn_dropout_checkpoint: the probabilities' dropout again, from the kept mask
            self.pw("attn_prob_dropout_recompute", K.DROPOUT, sc, S * a + S * BOOL),
            # StridedBatchGemm::Backward of context = V x probs: d(V), then d(probs)
            self.gemm("attn_context.grad_v", s, hd, s, bh),
            self.gemm("attn_context.grad_probs", s, s, hd, bh),
            self.pw("attn_prob_dropout_bwd", K.DROPOUT, sc, S * a + S * BOOL),
            self.pw("softmax_bwd", K.SOFTMAX, sc, 2 * S * a),
            # of scores = K x Q: d(K), then d(Q)
            self.gemm("attn_scores.grad_k", s, hd, s, bh),
            self.gemm("attn_scores.grad_q", s, hd, s, bh),
            self.pw("transform4d_0213_qkv", K.ELEMENTWISE, (t, 3 * h), 3 * th * a),
            *self.linear_bwd("qkv", h, 3 * h),
            *self.norm_bwd_fused_add("layer_norm_bwd"),
        )

    def saved(self) -> int:
        """What DeepSpeedTransformerFunction keeps (transformer.py, 0.5.10 lines 240-275,
        pre-LN without normalize_invertible): the output (the next layer's input), the
        normalised input, q / k / v in head layout, the softmax's output, the output
        projection's input, the residual sum, the MLP's input, the first GEMM's output
        (the GELU's input: gelu_checkpoint), the three dropout masks and the two norms'
        means and variances. The probabilities after dropout and the GELU's output are
        not kept (the checkpoint flags)."""
        t, h, a = self.t, self.h, self.a
        th = t * h
        return (8 * th + self.scores + t * self.f + 4 * t) * a + (self.scores + 2 * th) * BOOL


def _append(bd: Builder, path: str, kind: ModuleKind, role: Role, block: int | None, op: Op,
            params: tuple[ParamSpec, ...] = (), saved: int = 0, sync_fwd: bool = False, sync_bwd: bool = False) -> None:
    bd.module(path, kind, role, block, op, params, saved)
    bd.modules[-1] = replace(bd.modules[-1], sync_before_fwd=sync_fwd, sync_before_bwd=sync_bwd)


def lower(bd: Builder) -> None:
    """BertForPreTrainingPreLN's module tree in hook order, with DeepSpeed's layer."""
    c, e = bd.cfg, bd.e
    h, t, b, s, a = c.hidden, bd.t, bd.b, bd.s, bd.dt
    hs = bd.hidden_shape
    m = b * masked_positions(s)
    i64 = 8
    word = "bert.embeddings.word_embeddings"
    # BertModel.forward: the extended mask (unsqueeze, .to(the parameters' dtype),
    # (1 - mask) * -10000); BertEmbeddings.forward: the position ids (arange, expanded)
    pre = (e.cast("mask.cast", (b, 1, 1, s), i64, a), e.pointwise("mask.rsub", (b, 1, 1, s), b * s),
           e.pointwise("mask.mul", (b, 1, 1, s), b * s), e.cast("positions.arange", (s,), 0, i64))
    k = _Kernels(bd)
    with bd.container(""):
        with bd.container("bert"):
            with bd.container("bert.embeddings"):
                # words + positions + token types, LayerNorm, dropout; the word embedding's
                # weight is the decoder's, whose gradient arrives first
                bd.embedding(word, c.vocab, before=Op(pre),
                             after=e.accumulate("tied_grad", (c.vocab, h)) if c.tie_embeddings else Op(), saved=0)
                bd.embedding("bert.embeddings.position_embeddings", c.max_positions, saved=0)
                bd.embedding("bert.embeddings.token_type_embeddings", c.type_vocab, saved=0)
                # the norm keeps its input (the sum, made here) and its statistics
                bd.norm("bert.embeddings.LayerNorm", None, bias=True,
                        before=e.add("add_positions", hs) + e.add("add_token_types", hs), saved=t * h * a + 2 * t * 4)
                bd.dropout("bert.embeddings.dropout", None, hs, c.p_hidden,
                           saved=(t * h if c.p_hidden > 0 else 0) + t * h * a)
            with bd.container("bert.encoder"):
                for i in range(c.layers):
                    path = f"bert.encoder.layer.{i}"
                    _append(bd, path, ModuleKind.OTHER, Role.OTHER, i, Op(k.forward(), k.backward()),
                            layer_params(path, h, c.ffn), k.saved(), sync_fwd=True, sync_bwd=True)
                # the pre-LN encoder's last norm: keeps its statistics and its output (the
                # heads' input)
                bd.norm("bert.encoder.FinalLayerNorm", None, bias=True, saved=2 * t * 4 + t * h * a)
            with bd.container("bert.pooler"):
                # the first token (a view); LinearActivation(tanh): F.linear with its bias on
                # (b, h), then tanh, which keeps its output
                _append(bd, "bert.pooler.dense_act", ModuleKind.LINEAR, Role.POOLER, None,
                        e.linear("", b, h, h, True) + e.unary("tanh", (b, h)),
                        (ParamSpec("bert.pooler.dense_act.weight", (h, h)),
                         ParamSpec("bert.pooler.dense_act.bias", (h,))), saved=b * h * a)
        with bd.container("cls"):
            with bd.container("cls.predictions", params=(ParamSpec("cls.predictions.bias", (c.vocab,)),),
                              role=Role.LM_HEAD):
                with bd.container("cls.predictions.transform"):
                    # BertForPreTrainingPreLN.forward runs torch.nonzero over the labels first:
                    # the count is copied to the host, which waits for the stream. Then
                    # LinearActivation(gelu) with its fused bias_gelu (TorchScript): F.linear
                    # without bias, one fused kernel; backward its gradient and the bias's sum
                    gelu = Op((k.pw("bias_gelu", K.ELEMENTWISE, (t, h), (t * h + h) * a),),
                              (k.pw("bias_gelu_bwd", K.ELEMENTWISE, (t, h), (2 * t * h + h) * a),
                               kernel("bias_grad", K.REDUCTION, (h,), a, t * h * a, flops=t * h)))
                    _append(bd, "cls.predictions.transform.dense_act", ModuleKind.LINEAR, Role.LM_HEAD, None,
                            e.linear("", t, h, h, False) + gelu,
                            (ParamSpec("cls.predictions.transform.dense_act.weight", (h, h)),
                             ParamSpec("cls.predictions.transform.dense_act.bias", (h,))),
                            saved=2 * t * h * a, sync_fwd=True)
                    # keeps its statistics (its input is counted by the GELU that made it;
                    # its output feeds index_select, which keeps only the indices)
                    bd.norm("cls.predictions.transform.LayerNorm", None, bias=True, saved=2 * t * 4)
                # index_select of the masked rows (backward: a zeroed (t, h) gradient and
                # index_add), the tied decoder without bias, then + the head's bias
                select = Op((kernel("index_select", K.ELEMENTWISE, (m, h), a, m * h * a + m * i64),),
                            (kernel("index_select_bwd.zero", K.ELEMENTWISE, (t, h), a, 0),
                             kernel("index_select_bwd.index_add", K.ELEMENTWISE, (m, h), a, m * h * a + m * i64)))
                bias = Op((kernel("bias_add", K.ELEMENTWISE, (m, c.vocab), a, (m * c.vocab + c.vocab) * a),),
                          (kernel("bias_grad", K.REDUCTION, (c.vocab,), a, m * c.vocab * a, flops=m * c.vocab),))
                _append(bd, "cls.predictions.decoder", ModuleKind.LINEAR, Role.LM_HEAD, None,
                        select + e.linear("", m, h, c.vocab, False) + bias,
                        (ParamSpec(f"{word}.weight" if c.tie_embeddings else "cls.predictions.decoder.weight",
                                   (c.vocab, h)),), saved=m * h * a)
            # the next-sentence head on the pooled output; then both losses (the masked
            # labels gathered by index_select, cross-entropy over the masked positions and
            # over the two classes) and their sum
            labels = Op((kernel("labels.index_select", K.ELEMENTWISE, (m,), i64, m * i64 + m * i64),))
            losses = labels + e.cross_entropy("mlm_loss", m, c.vocab) + e.cross_entropy("nsp_loss", b, 2) \
                + Op((kernel("loss_sum", K.ELEMENTWISE, (), a, 2 * a),))
            _append(bd, "cls.seq_relationship", ModuleKind.LINEAR, Role.LM_HEAD, None,
                    e.linear("", b, h, 2, True) + losses,
                    (ParamSpec("cls.seq_relationship.weight", (2, h)), ParamSpec("cls.seq_relationship.bias", (2,))),
                    saved=m * c.vocab * a + b * 2 * a + 2 * a)
    assert t == bd.t
