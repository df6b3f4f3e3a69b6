"""The three families' module trees, as Hugging Face's eager code builds and runs them
(``commsim.models.transformer`` says what each family is): RobertaForMaskedLM (and
BERT's, the same tree under ``bert.``), GPT2LMHeadModel and LlamaForCausalLM, each
written into a ``Builder`` in hook order with the kernels of every module."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from commsim.ir.ops import ComputeKind as K
from commsim.models import bing_bert, megatron_gpt
from commsim.models.eager import Op, chain
from commsim.models.spec import ModuleKind, ParamSpec, Role

if TYPE_CHECKING:
    from commsim.models.transformer import Builder


def _roberta(bd: Builder) -> None:
    """RobertaForMaskedLM's whole module tree, in hook order (containers included)."""
    c, e = bd.cfg, bd.e
    h, t, b, s = c.hidden, bd.t, bd.b, bd.s
    hs = bd.hidden_shape
    p = "roberta" if c.family == "roberta" else "bert"
    word = f"{p}.embeddings.word_embeddings"
    # Before the embeddings (RobertaModel.forward, RobertaEmbeddings
    # create_position_ids_from_input_ids): the additive mask from the int64 attention
    # mask (cast, 1 - m, times the dtype's minimum), and the position ids (ne, int,
    # cumsum, type_as, + 0, * mask, long, + padding_idx).
    ids = (b, s)
    i64, i32, bl = 8, 4, 1
    mask_ops = (e.cast("mask.cast", (b, 1, 1, s), i64, bd.dt), e.pointwise("mask.rsub", (b, 1, 1, s), b * s),
                e.pointwise("mask.mul_min", (b, 1, 1, s), b * s))
    pos_ops = (e.cast("positions.ne", ids, i64, bl), e.cast("positions.int", ids, bl, i32),
               e.cast("positions.cumsum", ids, i32, i64), e.cast("positions.type_as", ids, i64, i32),
               e.cast("positions.add", ids, i32, i32), e.cast("positions.mul", ids, 2 * i32, i32),
               e.cast("positions.long", ids, i32, i64), e.cast("positions.add_padding", ids, i64, i64))
    with bd.container(""):
        with bd.container(p):
            with bd.container(f"{p}.embeddings"):
                # HF RobertaEmbeddings.forward: word, token_type, position, LayerNorm, dropout.
                # The word embedding's weight is the decoder's: autograd adds the
                # embedding's gradient to the decoder's, which arrived first.
                # What autograd keeps (checked like the layers': tests/models/test_hf_heads.py):
                # the position ids and token type ids (the lookups' backward reads them); the
                # LayerNorm's input and statistics, and its output when no dropout follows
                # (the first layer's input); the dropout's mask and output.
                emb_out = t * h * bd.dt
                bd.embedding(word, c.vocab, before=Op(mask_ops + pos_ops),
                             after=e.accumulate("tied_grad", (c.vocab, h)) if c.tie_embeddings else Op(),
                             saved=b * s * i64)
                # RobertaEmbeddings.forward: the buffered token type ids gathered at the
                # position ids (a new int64 tensor, which the lookup's backward keeps)
                bd.embedding(f"{p}.embeddings.token_type_embeddings", c.type_vocab,
                             before=Op((e.cast("token_types.gather", ids, 2 * i64, i64),)), saved=b * s * i64)
                bd.embedding(f"{p}.embeddings.position_embeddings", c.max_positions, before=e.add("add_token_type", hs),
                             saved=0)
                bd.norm(f"{p}.embeddings.LayerNorm", None, bias=True, before=e.add("add_position", hs),
                        saved=emb_out + 2 * t * 4 + (0 if c.p_hidden > 0 else emb_out))
                bd.dropout(f"{p}.embeddings.dropout", None, hs, c.p_hidden,
                           saved=_dropout_saved(t * h, c.p_hidden) + (emb_out if c.p_hidden > 0 else 0))
            with bd.container(f"{p}.encoder"):
                for i in range(c.layers):
                    _roberta_layer(bd, f"{p}.encoder.layer.{i}", i)
        # RobertaLMHead owns the decoder's bias (lm_head.bias; decoder.bias is the same
        # Parameter): a container with a parameter, fetched before its children. Its
        # gelu is functional (charged to the layer norm that follows it), and so is the
        # loss (RobertaForMaskedLM.forward: CrossEntropyLoss, charged to the decoder).
        # Kept: dense's output (gelu's input), gelu's output, the norm's statistics and
        # output (the decoder's input), log_softmax's output, nll_loss's total weight (a
        # scalar of the logits' dtype); the labels exist before the step.
        with bd.container("lm_head", params=(ParamSpec("lm_head.bias", (c.vocab,)),), role=Role.LM_HEAD):
            bd.linear("lm_head.dense", h, h, Role.LM_HEAD, None, bias=True, saved=t * h * bd.dt)
            bd.norm("lm_head.layer_norm", None, bias=True, before=e.unary("gelu", (t, h)),
                    saved=2 * t * h * bd.dt + 2 * t * 4)
            bd.linear("lm_head.decoder", h, c.vocab, Role.LM_HEAD, None, bias=True,
                      weight_name=f"{word}.weight" if c.tie_embeddings else None, bias_name="lm_head.bias",
                      after=e.cross_entropy("loss", t, c.vocab), saved=t * c.vocab * bd.dt + bd.dt)


def _causal_lm_loss(bd: Builder) -> Op:
    """transformers' ``ForCausalLMLoss`` (loss/loss_utils.py, 4.46 on; GPT-2 and Llama
    call it): the logits cast to fp32, the labels padded with one ignore_index column
    and shifted (a contiguous copy), cross-entropy in fp32 over every position (the
    padded last one of each sequence is ignored, not cut). Backward: the cross-entropy's
    kernels, then the cast back to the logits' dtype."""
    e, b, s, vocab, f = bd.e, bd.b, bd.s, bd.cfg.vocab, 4
    pad = replace(e.cast("labels.pad", (b, s + 1), 8, 8), bytes_read=b * s * 8)
    cast = Op((e.cast("logits.float", (b, s, vocab), bd.dt, f), pad, e.cast("shift_labels", (b, s), 8, 8)),
              (e.cast("logits.float_bwd", (b, s, vocab), f, bd.dt),))
    return cast + e.cross_entropy("loss", b * s, vocab, elem=f)


def _causal_lm_loss_saved(bd: Builder) -> int:
    """What the causal-LM head keeps: log_softmax's fp32 output, nll_loss's target (the
    shifted labels) and total weight (an fp32 scalar); the head's input is the final
    norm's output, counted there."""
    t = bd.b * bd.s
    return t * bd.cfg.vocab * 4 + t * 8 + 4


def _act_saved(bd: Builder) -> tuple[int, int]:
    """What autograd keeps of an MLP's first projection and of its activation: gelu,
    gelu_pytorch_tanh and silu keep their input (the projection's output), relu its
    output; the projection after keeps the activation's output. GPT-2's ``gelu_new``
    keeps x (pow's), 0.5 x, tanh's result and 1 + tanh (the last mul's operands)."""
    one = bd.t * bd.cfg.ffn * bd.dt
    act = bd.cfg.act
    if act == "relu":
        return 0, one
    if act == "gelu_new":
        return one, 4 * one
    return one, one


def _dropout_saved(elems: int, p: float) -> int:
    """A dropout's one-byte mask (native_dropout keeps it; p = 0 launches nothing)."""
    return elems if p > 0 else 0


def _roberta_layer(bd: Builder, L: str, i: int) -> None:
    c, e = bd.cfg, bd.e
    h, t = c.hidden, bd.t
    hs = bd.hidden_shape
    ctx = (bd.b, bd.s, c.heads, c.head_dim)
    # What autograd keeps for backward, by the module that makes it (checked against
    # saved_tensors_hooks on the real layer: tests/models/test_hf_kernels.py). The
    # projections' outputs are copied for the matmuls, whose copies are kept (q, k, v),
    # as are the softmax's output, the dropout's mask and output and the context copy
    # (the output projection's input). A LayerNorm keeps its input (the residual sum),
    # mean and rstd (fp32) and its output (the next projections' input, and the next
    # layer's). The MLP keeps what its activation and second projection need.
    a, sc = bd.dt, bd.b * c.heads * bd.s * bd.s
    attn_saved = 4 * t * h * a + sc * a + (sc * (1 + a) if c.p_attention > 0 else 0)
    norm_saved = 2 * t * h * a + 2 * t * 4
    fc_saved, act_saved = _act_saved(bd)
    with bd.container(L, block=i):
        with bd.container(f"{L}.attention", block=i):
            with bd.container(f"{L}.attention.self", block=i):
                # the layer input feeds q, k, v and the residual: each projection's input
                # gradient is summed into the residual's
                for name in ("query", "key", "value"):
                    bd.linear(f"{L}.attention.self.{name}", h, h, Role.ATTENTION_QKV, i, bias=True,
                              before=e.accumulate("input_grad_sum", hs), grad_copy=ctx, saved=0)
                # scores and softmax run between value's hooks and the dropout module's,
                # AV and the context copy after it: all charged to the dropout
                bd.dropout(f"{L}.attention.self.dropout", i, (bd.b, c.heads, bd.s, bd.s), c.p_attention,
                           before=bd.attention_scores(mask_elems=bd.b * bd.s), after=bd.attention_context(),
                           saved=attn_saved)
            with bd.container(f"{L}.attention.output", block=i):
                bd.linear(f"{L}.attention.output.dense", h, h, Role.ATTENTION_OUT, i, bias=True, saved=0)
                bd.dropout(f"{L}.attention.output.dropout", i, hs, c.p_hidden,
                           saved=_dropout_saved(t * h, c.p_hidden))
                bd.norm(f"{L}.attention.output.LayerNorm", i, bias=True, before=e.add("residual", hs),
                        saved=norm_saved)
        with bd.container(f"{L}.intermediate", block=i):
            # the attention output feeds the MLP and its residual
            bd.linear(f"{L}.intermediate.dense", h, c.ffn, Role.MLP, i, bias=True,
                      before=e.accumulate("input_grad_sum", hs), saved=fc_saved)
            bd.activation(f"{L}.intermediate.intermediate_act_fn", i, (bd.b, bd.s, c.ffn), saved=act_saved)
        with bd.container(f"{L}.output", block=i):
            bd.linear(f"{L}.output.dense", c.ffn, h, Role.MLP, i, bias=True, saved=0)
            bd.dropout(f"{L}.output.dropout", i, hs, c.p_hidden, saved=_dropout_saved(t * h, c.p_hidden))
            bd.norm(f"{L}.output.LayerNorm", i, bias=True, before=e.add("residual", hs), saved=norm_saved)
    assert t == bd.t


def _gpt2(bd: Builder) -> None:
    """GPT2LMHeadModel's module tree (dropouts included)."""
    c, e = bd.cfg, bd.e
    h, t, b, s = c.hidden, bd.t, bd.b, bd.s
    hs = bd.hidden_shape
    with bd.container(""):
        with bd.container("transformer"):
            # GPT2Model.forward: position ids (arange) before the token embedding; the
            # tied LM head's gradient arrives at wte first
            # kept (tests/models/test_hf_heads.py): the position ids (wpe's backward reads
            # them); the sum's dropout mask and output (the first block's input), or the
            # sum itself without dropout; ln_f's statistics and output (the head's input)
            bd.embedding("transformer.wte", c.vocab, before=Op((e.cast("positions.arange", (1, s), 8, 8),)),
                         after=e.accumulate("tied_grad", (c.vocab, h)) if c.tie_embeddings else Op(), saved=s * 8)
            bd.embedding("transformer.wpe", c.max_positions, tokens=s, saved=0)
            # inputs_embeds + position_embeds (positions broadcast over the batch): the
            # position gradient is the sum over the batch
            pos_sum = Op(bwd=(e.pointwise("add_positions.sum_bwd", (1, s, h), b * s * h, kind=K.REDUCTION),))
            bd.dropout("transformer.drop", None, hs, c.p_hidden, before=e.add("add_positions", hs, s * h) + pos_sum,
                       saved=_dropout_saved(t * h, c.p_hidden) + t * h * bd.dt)
            for i in range(c.layers):
                _gpt2_block(bd, f"transformer.h.{i}", i)
            bd.norm("transformer.ln_f", None, bias=True, saved=t * h * bd.dt + 2 * t * 4)
        # GPT2LMHeadModel.forward's loss: transformers' ForCausalLMLoss
        bd.linear("lm_head", h, c.vocab, Role.LM_HEAD, None, bias=False,
                  weight_name="transformer.wte.weight" if c.tie_embeddings else None,
                  after=_causal_lm_loss(bd), saved=_causal_lm_loss_saved(bd))
    assert t == bd.t


def _gpt2_block(bd: Builder, L: str, i: int) -> None:
    c, e = bd.cfg, bd.e
    h, b, s = c.hidden, bd.b, bd.s
    hs = bd.hidden_shape
    heads = (b, s, c.heads, c.head_dim)
    # What autograd keeps, by the module that makes it (as in _roberta_layer): ln_1 keeps
    # the block input (made by the previous block's last residual add, which counts it),
    # mean, rstd and its output; the score matmul keeps the q and k copies, the softmax
    # its output, the dropout its mask and output; c_proj's input side v's copy and the
    # context copy; ln_2 the residual sum, mean, rstd and its output; the last residual
    # sum is the next block's ln_1 input.
    t, a, sc = b * s, bd.dt, b * c.heads * s * s
    fc_saved, act_saved = _act_saved(bd)
    with bd.container(L, block=i):
        # the block input feeds ln_1 and the residual
        bd.norm(f"{L}.ln_1", i, bias=True, before=e.accumulate("input_grad_sum", hs), saved=t * h * a + 2 * t * 4)
        with bd.container(f"{L}.attn", block=i):
            # c_attn's output is split into q, k, v (views); backward copies the q and v
            # gradients out of their head layout and concatenates the three
            cat = Op(bwd=(e.pointwise("qkv_grad_copy", heads, b * s * h), e.pointwise("qkv_grad_copy", heads, b * s * h),
                          e.pointwise("qkv_grad_cat", (b, s, 3 * h), 3 * b * s * h)))
            bd.linear(f"{L}.attn.c_attn", h, 3 * h, Role.ATTENTION_QKV, i, bias=True, conv1d=True, after=cat, saved=0)
            bd.dropout(f"{L}.attn.attn_dropout", i, (b, c.heads, s, s), c.p_attention,
                       before=bd.attention_scores(mask_elems=b * s * s),
                       saved=2 * t * h * a + sc * a + (sc * (1 + a) if c.p_attention > 0 else 0))
            bd.linear(f"{L}.attn.c_proj", h, h, Role.ATTENTION_OUT, i, bias=True, conv1d=True,
                      before=bd.attention_context(), saved=2 * t * h * a)
            bd.dropout(f"{L}.attn.resid_dropout", i, hs, c.p_hidden, saved=_dropout_saved(t * h, c.p_hidden))
        # the residual add runs in the block between attn and ln_2; its sum feeds ln_2
        # and the second residual
        bd.norm(f"{L}.ln_2", i, bias=True, before=e.add("residual", hs) + e.accumulate("input_grad_sum", hs),
                saved=2 * t * h * a + 2 * t * 4)
        with bd.container(f"{L}.mlp", block=i):
            bd.linear(f"{L}.mlp.c_fc", h, c.ffn, Role.MLP, i, bias=True, conv1d=True, saved=fc_saved)
            bd.activation(f"{L}.mlp.act", i, (b, s, c.ffn), saved=act_saved)
            bd.linear(f"{L}.mlp.c_proj", c.ffn, h, Role.MLP, i, bias=True, conv1d=True, saved=0)
            # the block's last residual add: after the mlp, charged to its last module
            bd.dropout(f"{L}.mlp.dropout", i, hs, c.p_hidden, after=e.add("residual", hs),
                       saved=_dropout_saved(t * h, c.p_hidden) + t * h * a)


def _llama(bd: Builder) -> None:
    """LlamaForCausalLM's module tree."""
    c, e = bd.cfg, bd.e
    h, t, b, s, hd = c.hidden, bd.t, bd.b, bd.s, c.head_dim
    with bd.container(""):
        with bd.container("model"):
            # kept (tests/models/test_hf_heads.py): nothing of the embedding (the first
            # layer's norm keeps its fp32 copy, not its input); the final norm as a
            # layer's norm
            bd.embedding("model.embed_tokens", c.vocab, saved=0)
            # LlamaModel.forward between embed_tokens and the layers, charged to the
            # rotary module: the causal mask (full, triu, arange, compare, multiply; a
            # copy per batch row once a padding mask is given) and the rotary table
            # (cast of the positions, inv_freq x positions, cat, cos, sin, scale, casts)
            # (with SDPA no mask: the kernel is told is_causal)
            mask = (e.cast("causal_mask.full", (s, s), 0, bd.dt), e.pointwise("causal_mask.triu", (s, s), s * s),
                    e.cast("causal_mask.arange", (s,), 0, 8), e.cast("causal_mask.gt", (s, s), 16, 1),
                    e.pointwise("causal_mask.mul", (s, s), s * s + s * s // bd.dt),
                    e.pointwise("causal_mask.clone", (b, 1, s, s), s * s)) if c.attention == "eager" else ()
            f = 4
            rope = (e.cast("rotary.positions", (1, 1, s), 8, f),
                    e.bmm("rotary.freqs", 1, hd // 2, s, 1).fwd[0],
                    e.cast("rotary.cat", (1, s, hd), f, f), e.cast("rotary.cos", (1, s, hd), f, f),
                    e.cast("rotary.cos_scale", (1, s, hd), f, f), e.cast("rotary.sin", (1, s, hd), f, f),
                    e.cast("rotary.sin_scale", (1, s, hd), f, f), e.cast("rotary.cos_cast", (1, s, hd), f, bd.dt),
                    e.cast("rotary.sin_cast", (1, s, hd), f, bd.dt))
            # every layer's rotary muls keep cos and sin, the same two tensors
            bd.module("model.rotary_emb", ModuleKind.OTHER, Role.NONE, None, Op(mask + rope), saved=2 * s * hd * bd.dt)
            for i in range(c.layers):
                _llama_layer(bd, f"model.layers.{i}", i)
            bd.norm("model.norm", None, bias=False, saved=t * h * 4 + t * 4 + 2 * t * h * bd.dt)
        # LlamaForCausalLM's loss: transformers' ForCausalLMLoss
        bd.linear("lm_head", h, c.vocab, Role.LM_HEAD, None, bias=False,
                  weight_name="model.embed_tokens.weight" if c.tie_embeddings else None,
                  after=_causal_lm_loss(bd), saved=_causal_lm_loss_saved(bd))
    assert t == bd.t


def _llama_layer(bd: Builder, L: str, i: int) -> None:
    c, e = bd.cfg, bd.e
    h, b, s, hd, kvh = c.hidden, bd.b, bd.s, c.head_dim, c.n_kv_heads
    hs = bd.hidden_shape
    kv = kvh * hd
    rep = c.heads // kvh
    sdpa = c.attention == "sdpa"
    # What autograd keeps for backward, by the module that makes it (checked against
    # torch.autograd.graph.saved_tensors_hooks on the real layer: tests/models/
    # test_hf_kernels.py). RMSNorm: the fp32 copy (pow and mul keep it), rsqrt's result,
    # the bf16 cast (the weight's mul keeps it) and its output (the projections keep it).
    # The projections' outputs q and k pass through rotary, whose muls keep only cos and
    # sin; SDPA keeps v, the rotated q and k, its output and the log-sum-exp; eager
    # attention keeps its matmuls' operands (q, k and v as copies or repeats), the fp32
    # softmax and its bf16 cast (or the dropout's output and mask) and the context copy.
    # The MLP keeps gate's, silu's, up's outputs and their product.
    t, a = b * s, bd.dt
    norm_saved = t * h * 4 + t * 4 + 2 * t * h * a
    scores = b * c.heads * s * s
    if sdpa:
        attn_saved = t * h * a + t * kv * a + t * h * a + b * c.heads * s * 4
    else:
        attn_saved = 4 * t * h * a + scores * (4 + a) + (scores if c.p_attention > 0 else 0)
    fc_saved, act_saved = _act_saved(bd)
    ffn_saved = t * c.ffn * a  # up's output and the product
    with bd.container(L, block=i):
        # the layer input feeds the norm and the residual
        bd.norm(f"{L}.input_layernorm", i, bias=False, before=e.accumulate("input_grad_sum", hs), saved=norm_saved)
        with bd.container(f"{L}.self_attn", block=i):
            # the normed input feeds q, k, v: backward runs v, k, q, summing k's and
            # q's input gradients into v's
            # With SDPA v's gradient comes back in v's own (transposed) layout, so its view
            # needs no copy; q's and k's pass through rotary's backward and do.
            bd.linear(f"{L}.self_attn.q_proj", h, h, Role.ATTENTION_QKV, i, bias=False,
                      before=e.accumulate("input_grad_sum", hs), grad_copy=(b, s, c.heads, hd), saved=0)
            bd.linear(f"{L}.self_attn.k_proj", h, kv, Role.ATTENTION_QKV, i, bias=False,
                      before=e.accumulate("input_grad_sum", hs), grad_copy=(b, s, kvh, hd), saved=0)
            bd.linear(f"{L}.self_attn.v_proj", h, kv, Role.ATTENTION_QKV, i, bias=False,
                      grad_copy=None if sdpa else (b, s, kvh, hd), saved=t * kv * a if sdpa else 0)
            # rotary on q and k (their outputs keep the transposed head layout), then the
            # attention, charged to o_proj. Eager: repeat_kv (a copy when grouped), the
            # score chain (Llama's softmax in fp32; no dropout kernel at attention_dropout
            # 0) and the context copy. SDPA: one fused kernel on k and v's own heads
            # (enable_gqa), whose output is laid out as the context already is.
            grouped = rep > 1
            ops = [e.rotary("rotary_q", bd.heads_shape(), s, hd), e.rotary("rotary_k", bd.heads_shape(kvh), s, hd)]
            if sdpa:
                ops.append(e.sdpa("sdpa", b, c.heads, kvh, s, hd))
            else:
                if grouped:
                    ops += [e.repeat_kv("repeat_k", b, kvh, rep, s, hd), e.repeat_kv("repeat_v", b, kvh, rep, s, hd)]
                ops += [bd.attention_scores(b * s * s, before_dropout=False, k_copy=not grouped, softmax_fp32=True),
                        bd.attention_context(v_copy=not grouped)]
            bd.linear(f"{L}.self_attn.o_proj", h, h, Role.ATTENTION_OUT, i, bias=False, before=chain(*ops),
                      saved=attn_saved)
        # the residual add between self_attn and this norm; its sum feeds the norm and
        # the second residual
        bd.norm(f"{L}.post_attention_layernorm", i, bias=False,
                before=e.add("residual", hs) + e.accumulate("input_grad_sum", hs), saved=norm_saved)
        with bd.container(f"{L}.mlp", block=i):
            # down_proj(act_fn(gate_proj(x)) * up_proj(x)): gate, act, up, then the product
            # (charged to down_proj); x feeds gate and up
            ffn = (b, s, c.ffn)
            bd.linear(f"{L}.mlp.gate_proj", h, c.ffn, Role.MLP, i, bias=False, before=e.accumulate("input_grad_sum", hs),
                      saved=fc_saved)
            bd.activation(f"{L}.mlp.act_fn", i, ffn, saved=act_saved)
            bd.linear(f"{L}.mlp.up_proj", h, c.ffn, Role.MLP, i, bias=False, saved=ffn_saved)
            # the layer's last residual add, after the mlp: charged to its last module
            bd.linear(f"{L}.mlp.down_proj", c.ffn, h, Role.MLP, i, bias=False, before=e.mul("act_mul_up", ffn),
                      after=e.add("residual", hs), saved=ffn_saved)


LOWER = {"roberta": _roberta, "bert": _roberta, "gpt2": _gpt2, "llama": _llama, "bing_bert": bing_bert.lower,
         "megatron_gpt": megatron_gpt.lower}
