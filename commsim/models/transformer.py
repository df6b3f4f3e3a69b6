"""Transformer architectures lowered to ``ModelDescription``s with exact shapes.

Three families mirror the Hugging Face module trees that DeepSpeed's hooks walk:

* ``roberta`` / ``bert`` (``RobertaForMaskedLM``): separate query / key / value
  Linears, post-LayerNorm, GELU MLP, an LM head of dense + LayerNorm + a decoder whose
  weight is tied to the word embeddings and whose bias is its own;
* ``gpt2`` (``GPT2LMHeadModel``): fused ``c_attn`` (h x 3h), pre-LayerNorm, learned
  positions, LM head tied to ``wte`` without bias;
* ``llama`` (``LlamaForCausalLM``): RMSNorm (weight only), no biases, grouped-query
  attention (``kv_heads``), SwiGLU MLP (gate / up / down), untied LM head.

Each module carries the kernels Hugging Face's eager code launches in training mode
(dropout active), one per ATen call (``commsim.models.eager``), in forward and in the
order autograd runs them in backward: the GEMMs and bias kernels of every Linear, the
attention chain (the head copies ``matmul`` makes, QK^T, scale, mask add, softmax,
dropout, AV, the context copy), dropouts, residual adds, norms, activations, embedding
lookups and the loss, and in backward their gradients, the gradient copies and the sums
of gradients of tensors used twice. The modelled code is transformers 4.1x (the seed
scenario's; Llama as 4.3x ran it) with eager attention; ``TorchBehaviour`` picks the
PyTorch (1.10 by default). tests/models/test_hf_kernels.py checks one layer of each
family against the ATen calls of the real Hugging Face layer.

Work a module's parent does between two of its children (QK^T and softmax between the
value Linear and the attention dropout, a residual add between a block's attention and
its next norm) is charged to the next child that starts inside that parent, or else to
its last child, as ``commsim.models.torch_walk`` does: kernels belong to leaf modules,
whose hooks surround them. Modules and parameters are exactly those of the HF tree.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

from commsim.ir.errors import CommsimInputError
from commsim.ir.ops import ComputeKind as K
from commsim.models.eager import PYTORCH_1_10, Eager, Op, TorchBehaviour, chain
from commsim.models.spec import ArchInfo, ModelDescription, ModuleKind, ModuleSpec, ParamSpec, Role

FAMILIES = ("roberta", "bert", "gpt2", "llama")
# Activations with one kernel each way (gelu: erf; gelu_pytorch_tanh: F.gelu(approximate="tanh")),
# and gelu_new, Hugging Face's tanh formula written in Python (8 kernels forward).
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")
# Hugging Face's defaults per family: hidden / attention dropout and the activation
# (RobertaConfig / BertConfig: 0.1, 0.1, gelu; GPT2Config: resid_pdrop / attn_pdrop 0.1,
# gelu_new; LlamaConfig: no hidden dropout, attention_dropout 0.0, silu).
FAMILY_DEFAULTS = {"roberta": (0.1, 0.1, "gelu"), "bert": (0.1, 0.1, "gelu"), "gpt2": (0.1, 0.1, "gelu_new"),
                   "llama": (0.0, 0.0, "silu")}


@dataclass(frozen=True, slots=True)
class TransformerConfig:
    name: str
    family: str  # one of FAMILIES
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    max_positions: int = 512
    kv_heads: int | None = None  # grouped-query attention; None = heads
    type_vocab: int = 1  # bert / roberta token types
    tie_embeddings: bool = True
    # None: the family's Hugging Face default (FAMILY_DEFAULTS)
    hidden_dropout: float | None = None
    attention_dropout: float | None = None
    activation: str | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise CommsimInputError(f"model {self.name}: family {self.family!r} is not one of {', '.join(FAMILIES)}")
        for field_name in ("layers", "hidden", "heads", "ffn", "vocab", "max_positions"):
            if getattr(self, field_name) <= 0:
                raise CommsimInputError(f"model {self.name}: {field_name} must be positive")
        if self.hidden % self.heads:
            raise CommsimInputError(f"model {self.name}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.kv_heads is not None and (self.kv_heads <= 0 or self.heads % self.kv_heads):
            raise CommsimInputError(f"model {self.name}: heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        for field_name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, field_name)
            if p is not None and not 0 <= p < 1:
                raise CommsimInputError(f"model {self.name}: {field_name} must be in [0, 1), got {p}")
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise CommsimInputError(f"model {self.name}: activation {self.activation!r} is not one of "
                                    f"{', '.join(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def p_hidden(self) -> float:
        return FAMILY_DEFAULTS[self.family][0] if self.hidden_dropout is None else self.hidden_dropout

    @property
    def p_attention(self) -> float:
        return FAMILY_DEFAULTS[self.family][1] if self.attention_dropout is None else self.attention_dropout

    @property
    def act(self) -> str:
        return FAMILY_DEFAULTS[self.family][2] if self.activation is None else self.activation


class _Builder:
    """Accumulates ModuleSpecs for one (micro-batch, sequence) in execution order."""

    def __init__(self, cfg: TransformerConfig, micro_batch: int, seq_len: int, dtype_bytes: int,
                 torch: TorchBehaviour):
        self.cfg = cfg
        self.b = micro_batch
        self.s = seq_len
        self.t = micro_batch * seq_len  # tokens
        self.dt = dtype_bytes
        self.e = Eager(dtype_bytes, torch)
        self.modules: list[ModuleSpec] = []

    @contextmanager
    def container(self, path: str, params: tuple[ParamSpec, ...] = (), role: Role = Role.NONE,
                  block: int | None = None) -> Iterator[None]:
        """A module whose children run inside it; ``encloses`` counts them."""
        index = len(self.modules)
        self.modules.append(ModuleSpec(path, ModuleKind.OTHER, role, params, block, (), ()))
        yield
        self.modules[index] = replace(self.modules[index], encloses=len(self.modules) - index - 1)

    def module(self, path: str, kind: ModuleKind, role: Role, block: int | None, op: Op,
               params: tuple[ParamSpec, ...] = ()) -> None:
        self.modules.append(ModuleSpec(path, kind, role, params, block, op.fwd, op.bwd))

    def linear(self, path: str, d_in: int, d_out: int, role: Role, block: int | None, bias: bool,
               weight_name: str | None = None, bias_name: str | None = None, before: Op = Op(),
               after: Op = Op(), conv1d: bool = False, grad_copy: tuple[int, ...] | None = None) -> None:
        """A Linear (``conv1d``: GPT-2's Conv1D, weight stored in x out) with the work
        charged to it ``before`` and ``after`` its GEMM."""
        shape = (d_in, d_out) if conv1d else (d_out, d_in)
        params = [ParamSpec(weight_name or f"{path}.weight", shape)]
        if bias:
            params.append(ParamSpec(bias_name or f"{path}.bias", (d_out,)))
        op = before + self.e.linear("", self.t, d_in, d_out, bias, conv1d, grad_copy) + after
        self.module(path, ModuleKind.LINEAR, role, block, op, tuple(params))

    def norm(self, path: str, block: int | None, bias: bool, before: Op = Op()) -> None:
        """LayerNorm (``bias``) or Llama's RMSNorm (weight only)."""
        h, t = self.cfg.hidden, self.t
        params = [ParamSpec(f"{path}.weight", (h,))]
        if bias:
            params.append(ParamSpec(f"{path}.bias", (h,)))
        op = before + (self.e.layer_norm("norm", t, h) if bias else self.e.rms_norm("rms_norm", t, h))
        self.module(path, ModuleKind.NORM, Role.NORM, block, op, tuple(params))

    def embedding(self, path: str, rows: int, block: int | None = None, tokens: int | None = None,
                  before: Op = Op(), after: Op = Op()) -> None:
        h = self.cfg.hidden
        params = (ParamSpec(f"{path}.weight", (rows, h)),)
        op = before + self.e.embedding("lookup", self.t if tokens is None else tokens, rows, h) + after
        self.module(path, ModuleKind.EMBEDDING, Role.EMBEDDING, block, op, params)

    def dropout(self, path: str, block: int | None, shape: tuple[int, ...], p: float, before: Op = Op(),
                after: Op = Op()) -> None:
        """An ``nn.Dropout`` module (no kernel at p = 0) with the work charged to it."""
        self.module(path, ModuleKind.OTHER, Role.NONE, block, before + self.e.dropout("dropout", shape, p) + after)

    def activation(self, path: str, block: int, shape: tuple[int, ...]) -> None:
        act = self.cfg.act
        op = self.e.gelu_new(act, shape) if act == "gelu_new" else self.e.unary(act, shape)
        self.module(path, ModuleKind.ACTIVATION, Role.NONE, block, op)

    # ------------------------------------------------------------ shapes
    @property
    def hidden_shape(self) -> tuple[int, ...]:
        return (self.b, self.s, self.cfg.hidden)

    def heads_shape(self, heads: int | None = None) -> tuple[int, ...]:
        """(b, heads, s, head_dim): q / k / v as the attention sees them."""
        c = self.cfg
        return (self.b, heads or c.heads, self.s, c.head_dim)

    def attention_scores(self, mask_elems: int, before_dropout: bool = True, q_copy: bool = True,
                         k_copy: bool = True, softmax_fp32: bool = False) -> Op:
        """QK^T up to the probabilities' dropout: ``torch.matmul`` copies q and k^T when
        their head layout (a transposed view of the projection) cannot be viewed as
        (b*heads, s, d) batches; scale; the additive mask; softmax (in fp32 for Llama:
        a cast each way); dropout (``before_dropout``: the dropout module's own kernel
        is not part of this op)."""
        c, e = self.cfg, self.e
        b, s, nh, hd = self.b, self.s, c.heads, c.head_dim
        scores = (b, nh, s, s)
        ops = []
        if q_copy:
            ops.append(e.copy("q_copy", self.heads_shape()))
        if k_copy:
            ops.append(e.copy("k_copy", (b, nh, hd, s)))
        ops += [e.bmm("qk", b * nh, s, s, hd), e.scale("scale", scores), e.add("mask", scores, mask_elems)]
        if softmax_fp32:
            to32 = e.cast("softmax.to_fp32", scores, self.dt, 4)
            back = e.cast("softmax.to_input", scores, 4, self.dt)
            ops += [Op((to32,), (e.cast("softmax.to_fp32_bwd", scores, 4, self.dt),)),
                    e.softmax("softmax", scores, 4),
                    Op((back,), (e.cast("softmax.to_input_bwd", scores, self.dt, 4),))]
        else:
            ops.append(e.softmax("softmax", scores))
        if not before_dropout:
            ops.append(e.dropout("attn_dropout", scores, c.p_attention))
        return chain(*ops)

    def attention_context(self, v_copy: bool = True) -> Op:
        """AV (copying v when its head layout is a transposed view) and the context's
        ``transpose(1, 2).contiguous()``; backward copies the context gradient back to
        (b*heads, s, d) batches for AV's gradients."""
        c, e = self.cfg, self.e
        b, s, nh, hd = self.b, self.s, c.heads, c.head_dim
        ops = [e.copy("v_copy", self.heads_shape())] if v_copy else []
        ctx = (b, s, nh, hd)
        ops += [e.bmm("av", b * nh, s, hd, s), e.copy("context_copy", ctx) + e.grad_copy("context_grad_copy", ctx)]
        return chain(*ops)


def _roberta(bd: _Builder) -> None:
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
                bd.embedding(word, c.vocab, before=Op(mask_ops + pos_ops),
                             after=e.accumulate("tied_grad", (c.vocab, h)) if c.tie_embeddings else Op())
                bd.embedding(f"{p}.embeddings.token_type_embeddings", c.type_vocab)
                bd.embedding(f"{p}.embeddings.position_embeddings", c.max_positions, before=e.add("add_token_type", hs))
                bd.norm(f"{p}.embeddings.LayerNorm", None, bias=True, before=e.add("add_position", hs))
                bd.dropout(f"{p}.embeddings.dropout", None, hs, c.p_hidden)
            with bd.container(f"{p}.encoder"):
                for i in range(c.layers):
                    _roberta_layer(bd, f"{p}.encoder.layer.{i}", i)
        # RobertaLMHead owns the decoder's bias (lm_head.bias; decoder.bias is the same
        # Parameter): a container with a parameter, fetched before its children. Its
        # gelu is functional (charged to the layer norm that follows it), and so is the
        # loss (RobertaForMaskedLM.forward: CrossEntropyLoss, charged to the decoder).
        with bd.container("lm_head", params=(ParamSpec("lm_head.bias", (c.vocab,)),), role=Role.LM_HEAD):
            bd.linear("lm_head.dense", h, h, Role.LM_HEAD, None, bias=True)
            bd.norm("lm_head.layer_norm", None, bias=True, before=e.unary("gelu", (t, h)))
            bd.linear("lm_head.decoder", h, c.vocab, Role.LM_HEAD, None, bias=True,
                      weight_name=f"{word}.weight" if c.tie_embeddings else None, bias_name="lm_head.bias",
                      after=e.cross_entropy("loss", t, c.vocab))


def _roberta_layer(bd: _Builder, L: str, i: int) -> None:
    c, e = bd.cfg, bd.e
    h, t = c.hidden, bd.t
    hs = bd.hidden_shape
    ctx = (bd.b, bd.s, c.heads, c.head_dim)
    with bd.container(L, block=i):
        with bd.container(f"{L}.attention", block=i):
            with bd.container(f"{L}.attention.self", block=i):
                # the layer input feeds q, k, v and the residual: each projection's input
                # gradient is summed into the residual's
                for name in ("query", "key", "value"):
                    bd.linear(f"{L}.attention.self.{name}", h, h, Role.ATTENTION_QKV, i, bias=True,
                              before=e.accumulate("input_grad_sum", hs), grad_copy=ctx)
                # scores and softmax run between value's hooks and the dropout module's,
                # AV and the context copy after it: all charged to the dropout
                bd.dropout(f"{L}.attention.self.dropout", i, (bd.b, c.heads, bd.s, bd.s), c.p_attention,
                           before=bd.attention_scores(mask_elems=bd.b * bd.s), after=bd.attention_context())
            with bd.container(f"{L}.attention.output", block=i):
                bd.linear(f"{L}.attention.output.dense", h, h, Role.ATTENTION_OUT, i, bias=True)
                bd.dropout(f"{L}.attention.output.dropout", i, hs, c.p_hidden)
                bd.norm(f"{L}.attention.output.LayerNorm", i, bias=True, before=e.add("residual", hs))
        with bd.container(f"{L}.intermediate", block=i):
            # the attention output feeds the MLP and its residual
            bd.linear(f"{L}.intermediate.dense", h, c.ffn, Role.MLP, i, bias=True,
                      before=e.accumulate("input_grad_sum", hs))
            bd.activation(f"{L}.intermediate.intermediate_act_fn", i, (bd.b, bd.s, c.ffn))
        with bd.container(f"{L}.output", block=i):
            bd.linear(f"{L}.output.dense", c.ffn, h, Role.MLP, i, bias=True)
            bd.dropout(f"{L}.output.dropout", i, hs, c.p_hidden)
            bd.norm(f"{L}.output.LayerNorm", i, bias=True, before=e.add("residual", hs))
    assert t == bd.t


def _gpt2(bd: _Builder) -> None:
    """GPT2LMHeadModel's module tree (dropouts included)."""
    c, e = bd.cfg, bd.e
    h, t, b, s = c.hidden, bd.t, bd.b, bd.s
    hs = bd.hidden_shape
    with bd.container(""):
        with bd.container("transformer"):
            # GPT2Model.forward: position ids (arange) before the token embedding; the
            # tied LM head's gradient arrives at wte first
            bd.embedding("transformer.wte", c.vocab, before=Op((e.cast("positions.arange", (1, s), 8, 8),)),
                         after=e.accumulate("tied_grad", (c.vocab, h)) if c.tie_embeddings else Op())
            bd.embedding("transformer.wpe", c.max_positions, tokens=s)
            # inputs_embeds + position_embeds (positions broadcast over the batch): the
            # position gradient is the sum over the batch
            pos_sum = Op(bwd=(e.pointwise("add_positions.sum_bwd", (1, s, h), b * s * h, kind=K.REDUCTION),))
            bd.dropout("transformer.drop", None, hs, c.p_hidden, before=e.add("add_positions", hs, s * h) + pos_sum)
            for i in range(c.layers):
                _gpt2_block(bd, f"transformer.h.{i}", i)
            bd.norm("transformer.ln_f", None, bias=True)
        # GPT2LMHeadModel.forward's loss: shift_logits = logits[..., :-1, :].contiguous(),
        # then CrossEntropyLoss over b*(s-1) rows; the slice's backward writes the whole
        # logits gradient
        rows = b * (s - 1)
        shift = Op((e.pointwise("shift_logits", (b, s - 1, c.vocab), rows * c.vocab),
                    e.cast("shift_labels", (b, s - 1), 8, 8)),
                   (e.pointwise("shift_logits_bwd", (b, s, c.vocab), rows * c.vocab),))
        bd.linear("lm_head", h, c.vocab, Role.LM_HEAD, None, bias=False,
                  weight_name="transformer.wte.weight" if c.tie_embeddings else None,
                  after=shift + e.cross_entropy("loss", rows, c.vocab))
    assert t == bd.t


def _gpt2_block(bd: _Builder, L: str, i: int) -> None:
    c, e = bd.cfg, bd.e
    h, b, s = c.hidden, bd.b, bd.s
    hs = bd.hidden_shape
    heads = (b, s, c.heads, c.head_dim)
    with bd.container(L, block=i):
        # the block input feeds ln_1 and the residual
        bd.norm(f"{L}.ln_1", i, bias=True, before=e.accumulate("input_grad_sum", hs))
        with bd.container(f"{L}.attn", block=i):
            # c_attn's output is split into q, k, v (views); backward copies the q and v
            # gradients out of their head layout and concatenates the three
            cat = Op(bwd=(e.pointwise("qkv_grad_copy", heads, b * s * h), e.pointwise("qkv_grad_copy", heads, b * s * h),
                          e.pointwise("qkv_grad_cat", (b, s, 3 * h), 3 * b * s * h)))
            bd.linear(f"{L}.attn.c_attn", h, 3 * h, Role.ATTENTION_QKV, i, bias=True, conv1d=True, after=cat)
            bd.dropout(f"{L}.attn.attn_dropout", i, (b, c.heads, s, s), c.p_attention,
                       before=bd.attention_scores(mask_elems=b * s * s))
            bd.linear(f"{L}.attn.c_proj", h, h, Role.ATTENTION_OUT, i, bias=True, conv1d=True,
                      before=bd.attention_context())
            bd.dropout(f"{L}.attn.resid_dropout", i, hs, c.p_hidden)
        # the residual add runs in the block between attn and ln_2; its sum feeds ln_2
        # and the second residual
        bd.norm(f"{L}.ln_2", i, bias=True, before=e.add("residual", hs) + e.accumulate("input_grad_sum", hs))
        with bd.container(f"{L}.mlp", block=i):
            bd.linear(f"{L}.mlp.c_fc", h, c.ffn, Role.MLP, i, bias=True, conv1d=True)
            bd.activation(f"{L}.mlp.act", i, (b, s, c.ffn))
            bd.linear(f"{L}.mlp.c_proj", c.ffn, h, Role.MLP, i, bias=True, conv1d=True)
            # the block's last residual add: after the mlp, charged to its last module
            bd.dropout(f"{L}.mlp.dropout", i, hs, c.p_hidden, after=e.add("residual", hs))


def _llama(bd: _Builder) -> None:
    """LlamaForCausalLM's module tree."""
    c, e = bd.cfg, bd.e
    h, t, b, s, hd = c.hidden, bd.t, bd.b, bd.s, c.head_dim
    with bd.container(""):
        with bd.container("model"):
            bd.embedding("model.embed_tokens", c.vocab)
            # LlamaModel.forward between embed_tokens and the layers, charged to the
            # rotary module: the causal mask (full, triu, arange, compare, multiply; a
            # copy per batch row once a padding mask is given) and the rotary table
            # (cast of the positions, inv_freq x positions, cat, cos, sin, scale, casts)
            mask = (e.cast("causal_mask.full", (s, s), 0, bd.dt), e.pointwise("causal_mask.triu", (s, s), s * s),
                    e.cast("causal_mask.arange", (s,), 0, 8), e.cast("causal_mask.gt", (s, s), 16, 1),
                    e.pointwise("causal_mask.mul", (s, s), s * s + s * s // bd.dt),
                    e.pointwise("causal_mask.clone", (b, 1, s, s), s * s))
            f = 4
            rope = (e.cast("rotary.positions", (1, 1, s), 8, f),
                    e.bmm("rotary.freqs", 1, hd // 2, s, 1).fwd[0],
                    e.cast("rotary.cat", (1, s, hd), f, f), e.cast("rotary.cos", (1, s, hd), f, f),
                    e.cast("rotary.cos_scale", (1, s, hd), f, f), e.cast("rotary.sin", (1, s, hd), f, f),
                    e.cast("rotary.sin_scale", (1, s, hd), f, f), e.cast("rotary.cos_cast", (1, s, hd), f, bd.dt),
                    e.cast("rotary.sin_cast", (1, s, hd), f, bd.dt))
            bd.module("model.rotary_emb", ModuleKind.OTHER, Role.NONE, None, Op(mask + rope))
            for i in range(c.layers):
                _llama_layer(bd, f"model.layers.{i}", i)
            bd.norm("model.norm", None, bias=False)
        # LlamaForCausalLM's loss: logits.float(), then the shifted logits as in GPT-2,
        # CrossEntropyLoss in fp32
        rows, f = b * (s - 1), 4
        loss = Op((e.cast("logits.float", (b, s, c.vocab), bd.dt, f),
                   e.cast("shift_logits", (b, s - 1, c.vocab), f, f), e.cast("shift_labels", (b, s - 1), 8, 8)),
                  (e.cast("shift_logits_bwd", (b, s, c.vocab), 0, f), e.cast("logits.float_bwd", (b, s, c.vocab), f,
                                                                              bd.dt)))
        # the slice's backward reads the (rows, vocab) gradient and writes the whole one
        loss = Op(loss.fwd, (replace(loss.bwd[0], bytes_read=rows * c.vocab * f), loss.bwd[1]))
        bd.linear("lm_head", h, c.vocab, Role.LM_HEAD, None, bias=False,
                  weight_name="model.embed_tokens.weight" if c.tie_embeddings else None,
                  after=loss + e.cross_entropy("loss", rows, c.vocab, elem=f))
    assert t == bd.t


def _llama_layer(bd: _Builder, L: str, i: int) -> None:
    c, e = bd.cfg, bd.e
    h, b, s, hd, kvh = c.hidden, bd.b, bd.s, c.head_dim, c.n_kv_heads
    hs = bd.hidden_shape
    kv = kvh * hd
    rep = c.heads // kvh
    with bd.container(L, block=i):
        # the layer input feeds the norm and the residual
        bd.norm(f"{L}.input_layernorm", i, bias=False, before=e.accumulate("input_grad_sum", hs))
        with bd.container(f"{L}.self_attn", block=i):
            # the normed input feeds q, k, v: backward runs v, k, q, summing k's and
            # q's input gradients into v's
            bd.linear(f"{L}.self_attn.q_proj", h, h, Role.ATTENTION_QKV, i, bias=False,
                      before=e.accumulate("input_grad_sum", hs), grad_copy=(b, s, c.heads, hd))
            bd.linear(f"{L}.self_attn.k_proj", h, kv, Role.ATTENTION_QKV, i, bias=False,
                      before=e.accumulate("input_grad_sum", hs), grad_copy=(b, s, kvh, hd))
            bd.linear(f"{L}.self_attn.v_proj", h, kv, Role.ATTENTION_QKV, i, bias=False, grad_copy=(b, s, kvh, hd))
            # rotary on q and k (their outputs keep the transposed head layout), repeat_kv
            # (a copy when grouped), then the attention (Llama's softmax in fp32; no
            # dropout kernel at attention_dropout 0), charged to o_proj
            grouped = rep > 1
            ops = [e.rotary("rotary_q", bd.heads_shape(), s, hd), e.rotary("rotary_k", bd.heads_shape(kvh), s, hd)]
            if grouped:
                ops += [e.repeat_kv("repeat_k", b, kvh, rep, s, hd), e.repeat_kv("repeat_v", b, kvh, rep, s, hd)]
            ops += [bd.attention_scores(b * s * s, before_dropout=False, k_copy=not grouped, softmax_fp32=True),
                    bd.attention_context(v_copy=not grouped)]
            bd.linear(f"{L}.self_attn.o_proj", h, h, Role.ATTENTION_OUT, i, bias=False, before=chain(*ops))
        # the residual add between self_attn and this norm; its sum feeds the norm and
        # the second residual
        bd.norm(f"{L}.post_attention_layernorm", i, bias=False,
                before=e.add("residual", hs) + e.accumulate("input_grad_sum", hs))
        with bd.container(f"{L}.mlp", block=i):
            # down_proj(act_fn(gate_proj(x)) * up_proj(x)): gate, act, up, then the product
            # (charged to down_proj); x feeds gate and up
            ffn = (b, s, c.ffn)
            bd.linear(f"{L}.mlp.gate_proj", h, c.ffn, Role.MLP, i, bias=False, before=e.accumulate("input_grad_sum", hs))
            bd.activation(f"{L}.mlp.act_fn", i, ffn)
            bd.linear(f"{L}.mlp.up_proj", h, c.ffn, Role.MLP, i, bias=False)
            # the layer's last residual add, after the mlp: charged to its last module
            bd.linear(f"{L}.mlp.down_proj", c.ffn, h, Role.MLP, i, bias=False, before=e.mul("act_mul_up", ffn),
                      after=e.add("residual", hs))


_LOWER = {"roberta": _roberta, "bert": _roberta, "gpt2": _gpt2, "llama": _llama}


def describe(cfg: TransformerConfig, micro_batch: int, seq_len: int, dtype_bytes: int = 2,
             torch: TorchBehaviour = PYTORCH_1_10) -> ModelDescription:
    """The module list of ``cfg`` with kernels for ``micro_batch`` sequences of ``seq_len``,
    as Hugging Face's eager modules launch them under ``torch`` (PyTorch 1.10 by default)."""
    if micro_batch <= 0:
        raise CommsimInputError(f"micro-batch must be a positive integer, got {micro_batch}")
    if seq_len <= 0:
        raise CommsimInputError(f"sequence length must be a positive integer, got {seq_len}")
    if cfg.family in ("roberta", "bert", "gpt2") and seq_len > cfg.max_positions:
        raise CommsimInputError(
            f"model {cfg.name}: sequence length {seq_len} exceeds its {cfg.max_positions} learned positions"
        )
    if cfg.family in ("gpt2", "llama") and seq_len < 2:
        raise CommsimInputError(f"model {cfg.name}: a causal LM's loss needs a sequence of at least 2 tokens")
    bd = _Builder(cfg, micro_batch, seq_len, dtype_bytes, torch)
    _LOWER[cfg.family](bd)
    arch = ArchInfo(layers=cfg.layers, hidden=cfg.hidden, vocab=cfg.vocab, ffn=cfg.ffn, heads=cfg.heads)
    md = ModelDescription(cfg.name, tuple(bd.modules), micro_batch, seq_len, dtype_bytes, arch)
    if cfg.family in ("roberta", "bert"):
        # RobertaEmbeddings registers word, position, token_type but runs word, token_type,
        # position: named_parameters() lists them in registration order.
        names = [p.name for p in md.unique_params()]
        p = "roberta" if cfg.family == "roberta" else "bert"
        pos, tok = f"{p}.embeddings.position_embeddings.weight", f"{p}.embeddings.token_type_embeddings.weight"
        i, j = names.index(tok), names.index(pos)
        names[i], names[j] = names[j], names[i]
        md = replace(md, param_order=tuple(names))
    return md
