"""Transformer architectures lowered to ``ModelDescription``s with exact shapes.

Three families mirror the Hugging Face module trees that DeepSpeed's hooks walk (their
trees are written in ``commsim.models.families``, into this module's ``Builder``):

* ``roberta`` / ``bert`` (``RobertaForMaskedLM``): separate query / key / value
  Linears, post-LayerNorm, GELU MLP, an LM head of dense + LayerNorm + a decoder whose
  weight is tied to the word embeddings and whose bias is its own;
* ``gpt2`` (``GPT2LMHeadModel``): fused ``c_attn`` (h x 3h), pre-LayerNorm, learned
  positions, LM head tied to ``wte`` without bias;
* ``llama`` (``LlamaForCausalLM``): RMSNorm (weight only), no biases, grouped-query
  attention (``kv_heads``), SwiGLU MLP (gate / up / down), untied LM head.

A fourth, ``bing_bert`` (``commsim.models.bing_bert``), is DeepSpeed's BERT pre-training
model with DeepSpeed's fused transformer kernel: each encoder layer one module whose
kernels are DeepSpeed's CUDA layer's, not Hugging Face's. A fifth, ``megatron_gpt``
(``commsim.models.megatron_gpt``), is Megatron-LM's GPT with its fused kernels (fused
causal softmax, bias-GELU and bias-dropout-add, apex's LayerNorm).

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
from commsim.models.eager import PYTORCH_1_10, Eager, Op, TorchBehaviour, chain
from commsim.models.families import LOWER
from commsim.models.spec import ArchInfo, ModelDescription, ModuleKind, ModuleSpec, ParamSpec, Role

FAMILIES = ("roberta", "bert", "gpt2", "llama", "bing_bert", "megatron_gpt")
# Activations with one kernel each way (gelu: erf; gelu_pytorch_tanh: F.gelu(approximate="tanh")),
# and gelu_new, Hugging Face's tanh formula written in Python (8 kernels forward).
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")
# Hugging Face's defaults per family: hidden / attention dropout and the activation
# (RobertaConfig / BertConfig: 0.1, 0.1, gelu; GPT2Config: resid_pdrop / attn_pdrop 0.1,
# gelu_new; LlamaConfig: no hidden dropout, attention_dropout 0.0, silu).
# How the attention core runs: "eager" (Hugging Face's matmul / softmax / matmul chain,
# the catalogue's default) or "sdpa" (F.scaled_dot_product_attention, causal, no mask:
# one fused FlashAttention kernel each way; Hugging Face's default attn_implementation
# today), for the llama family.
ATTENTIONS = ("eager", "sdpa")
FAMILY_DEFAULTS = {"roberta": (0.1, 0.1, "gelu"), "bert": (0.1, 0.1, "gelu"), "gpt2": (0.1, 0.1, "gelu_new"),
                   "llama": (0.0, 0.0, "silu"), "bing_bert": (0.1, 0.1, "gelu"),
                   # Megatron-LM's GPT: hidden and attention dropout 0.1, its bias-GELU (tanh)
                   "megatron_gpt": (0.1, 0.1, "gelu_new")}


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
    attention: str = "eager"  # one of ATTENTIONS
    # megatron_gpt: Megatron's --masked-softmax-fusion (its fused causal softmax kernel);
    # False: --no-masked-softmax-fusion, PyTorch's fp32 chain
    softmax_fusion: bool = True

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
        if self.attention not in ATTENTIONS:
            raise CommsimInputError(f"model {self.name}: attention {self.attention!r} is not one of "
                                    f"{', '.join(ATTENTIONS)}")
        if self.attention == "sdpa" and self.family != "llama":
            raise CommsimInputError(f"model {self.name}: attention 'sdpa' is modelled for the llama family only "
                                    f"(this model is {self.family}); use 'eager'")
        if self.family == "bing_bert" and (self.act != "gelu" or self.p_hidden == 0 or self.p_attention == 0
                                           or self.attention != "eager"):
            raise CommsimInputError(f"model {self.name}: the bing_bert family is DeepSpeed's transformer kernel as "
                                    f"trained: gelu, both dropouts active, its own attention")
        if not self.softmax_fusion and self.family != "megatron_gpt":
            raise CommsimInputError(f"model {self.name}: masked_softmax_fusion is Megatron-LM's option (the "
                                    f"megatron_gpt family), not {self.family}'s")
        if self.family == "megatron_gpt" and (self.act != "gelu_new" or self.attention != "eager"):
            raise CommsimInputError(f"model {self.name}: the megatron_gpt family is Megatron-LM's GPT as its "
                                    f"fused kernels run it: its bias-GELU (gelu_new's tanh formula), its own "
                                    f"attention")
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


class Builder:
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
               params: tuple[ParamSpec, ...] = (), saved: int | None = None) -> None:
        self.modules.append(ModuleSpec(path, kind, role, params, block, op.fwd, op.bwd, saved_bytes=saved))

    def linear(self, path: str, d_in: int, d_out: int, role: Role, block: int | None, bias: bool,
               weight_name: str | None = None, bias_name: str | None = None, before: Op = Op(),
               after: Op = Op(), conv1d: bool = False, grad_copy: tuple[int, ...] | None = None,
               saved: int | None = None) -> None:
        """A Linear (``conv1d``: GPT-2's Conv1D, weight stored in x out) with the work
        charged to it ``before`` and ``after`` its GEMM."""
        shape = (d_in, d_out) if conv1d else (d_out, d_in)
        params = [ParamSpec(weight_name or f"{path}.weight", shape)]
        if bias:
            params.append(ParamSpec(bias_name or f"{path}.bias", (d_out,)))
        op = before + self.e.linear("", self.t, d_in, d_out, bias, conv1d, grad_copy) + after
        self.module(path, ModuleKind.LINEAR, role, block, op, tuple(params), saved)

    def norm(self, path: str, block: int | None, bias: bool, before: Op = Op(), saved: int | None = None) -> None:
        """LayerNorm (``bias``) or Llama's RMSNorm (weight only)."""
        h, t = self.cfg.hidden, self.t
        params = [ParamSpec(f"{path}.weight", (h,))]
        if bias:
            params.append(ParamSpec(f"{path}.bias", (h,)))
        op = before + (self.e.layer_norm("norm", t, h) if bias else self.e.rms_norm("rms_norm", t, h))
        self.module(path, ModuleKind.NORM, Role.NORM, block, op, tuple(params), saved)

    def embedding(self, path: str, rows: int, block: int | None = None, tokens: int | None = None,
                  before: Op = Op(), after: Op = Op(), saved: int | None = None) -> None:
        h = self.cfg.hidden
        params = (ParamSpec(f"{path}.weight", (rows, h)),)
        op = before + self.e.embedding("lookup", self.t if tokens is None else tokens, rows, h) + after
        self.module(path, ModuleKind.EMBEDDING, Role.EMBEDDING, block, op, params, saved)

    def dropout(self, path: str, block: int | None, shape: tuple[int, ...], p: float, before: Op = Op(),
                after: Op = Op(), saved: int | None = None) -> None:
        """An ``nn.Dropout`` module (no kernel at p = 0) with the work charged to it."""
        self.module(path, ModuleKind.OTHER, Role.NONE, block, before + self.e.dropout("dropout", shape, p) + after,
                    saved=saved)

    def activation(self, path: str, block: int, shape: tuple[int, ...], saved: int | None = None) -> None:
        act = self.cfg.act
        op = self.e.gelu_new(act, shape) if act == "gelu_new" else self.e.unary(act, shape)
        self.module(path, ModuleKind.ACTIVATION, Role.NONE, block, op, saved=saved)

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


def describe(cfg: TransformerConfig, micro_batch: int, seq_len: int, dtype_bytes: int = 2,
             torch: TorchBehaviour = PYTORCH_1_10) -> ModelDescription:
    """The module list of ``cfg`` with kernels for ``micro_batch`` sequences of ``seq_len``,
    as Hugging Face's eager modules launch them under ``torch`` (PyTorch 1.10 by default)."""
    if micro_batch <= 0:
        raise CommsimInputError(f"micro-batch must be a positive integer, got {micro_batch}")
    if seq_len <= 0:
        raise CommsimInputError(f"sequence length must be a positive integer, got {seq_len}")
    if cfg.family in ("roberta", "bert", "gpt2", "bing_bert", "megatron_gpt") and seq_len > cfg.max_positions:
        raise CommsimInputError(
            f"model {cfg.name}: sequence length {seq_len} exceeds its {cfg.max_positions} learned positions"
        )
    if cfg.family == "bing_bert" and seq_len % 16:
        # DeepSpeedTransformerFunction pads such a sequence to a multiple of 16 with
        # random rows (transformer.py, 0.5.10 lines 180-190), which is not modelled
        raise CommsimInputError(f"model {cfg.name}: sequence length {seq_len} is not a multiple of 16, which "
                                f"DeepSpeed's transformer kernel pads to; use a multiple of 16")
    if cfg.family in ("gpt2", "llama", "megatron_gpt") and seq_len < 2:
        raise CommsimInputError(f"model {cfg.name}: a causal LM's loss needs a sequence of at least 2 tokens")
    bd = Builder(cfg, micro_batch, seq_len, dtype_bytes, torch)
    LOWER[cfg.family](bd)
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
