"""Transformer architectures lowered to ``ModelDescription``s with exact shapes.

Three families mirror the Hugging Face module trees that DeepSpeed's hooks walk:

* ``roberta`` / ``bert`` (``RobertaForMaskedLM``): separate query / key / value
  Linears, post-LayerNorm, GELU MLP, an LM head of dense + LayerNorm + a decoder whose
  weight is tied to the word embeddings and whose bias is its own;
* ``gpt2`` (``GPT2LMHeadModel``): fused ``c_attn`` (h x 3h), pre-LayerNorm, learned
  positions, LM head tied to ``wte`` without bias;
* ``llama`` (``LlamaForCausalLM``): RMSNorm (weight only), no biases, grouped-query
  attention (``kv_heads``), SwiGLU MLP (gate / up / down), untied LM head.

FLOPs count multiply-adds as 2 flops. A Linear of ``in -> out`` on ``T`` tokens costs
``2*T*in*out`` forward and the same again for each of its two backward gemms (input
gradient and weight gradient). Attention scores and context cost ``2*T*s*h`` each
forward (``4*T*s*h``), twice that backward: the terms of Narayanan et al. (2021).
Memory-bound kernels (norms, activations, softmax, loss) are described by the bytes
they read and write, from the tensor shapes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

from commsim.ir.errors import CommsimInputError
from commsim.ir.ops import ComputeKind, GemmShape
from commsim.models.spec import ArchInfo, Kernel, ModelDescription, ModuleKind, ModuleSpec, ParamSpec, Role

FAMILIES = ("roberta", "bert", "gpt2", "llama")


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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads


class _Builder:
    """Accumulates ModuleSpecs for one (micro-batch, sequence) in execution order."""

    def __init__(self, cfg: TransformerConfig, micro_batch: int, seq_len: int, dtype_bytes: int):
        self.cfg = cfg
        self.b = micro_batch
        self.s = seq_len
        self.t = micro_batch * seq_len  # tokens
        self.dt = dtype_bytes
        self.modules: list[ModuleSpec] = []

    @contextmanager
    def container(self, path: str, params: tuple[ParamSpec, ...] = (), role: Role = Role.NONE,
                  block: int | None = None) -> Iterator[None]:
        """A module whose children run inside it; ``encloses`` counts them."""
        index = len(self.modules)
        self.modules.append(ModuleSpec(path, ModuleKind.OTHER, role, params, block, (), ()))
        yield
        self.modules[index] = replace(self.modules[index], encloses=len(self.modules) - index - 1)

    def marker(self, path: str, block: int | None) -> None:
        """A parameter-free module whose work is negligible (dropout at p=0, rotary cache)."""
        self.modules.append(ModuleSpec(path, ModuleKind.OTHER, Role.NONE, (), block, (), ()))

    def linear(self, path: str, d_in: int, d_out: int, role: Role, block: int | None,
               bias: bool, weight_name: str | None = None, bias_name: str | None = None,
               extra: tuple[tuple[Kernel, ...], tuple[Kernel, ...]] = ((), ())) -> None:
        t, dt = self.t, self.dt
        params = [ParamSpec(weight_name or f"{path}.weight", (d_out, d_in))]
        if bias:
            params.append(ParamSpec(bias_name or f"{path}.bias", (d_out,)))
        w_bytes = d_in * d_out * dt
        fwd = (Kernel("fwd", ComputeKind.GEMM, 2 * t * d_in * d_out, t * d_in * dt + w_bytes,
                      t * d_out * dt, GemmShape(t, d_out, d_in)),)
        bwd = (
            Kernel("dgrad", ComputeKind.GEMM, 2 * t * d_in * d_out, t * d_out * dt + w_bytes,
                   t * d_in * dt, GemmShape(t, d_in, d_out)),
            Kernel("wgrad", ComputeKind.GEMM, 2 * t * d_in * d_out, t * d_out * dt + t * d_in * dt,
                   w_bytes, GemmShape(d_out, d_in, t)),
        )
        fwd, bwd = fwd + extra[0], extra[1] + bwd  # a functional op after it runs first in backward
        self.modules.append(ModuleSpec(path, ModuleKind.LINEAR, role, tuple(params), block, fwd, bwd))

    def norm(self, path: str, block: int | None, bias: bool, weight: str = "weight") -> None:
        h, t, dt = self.cfg.hidden, self.t, self.dt
        params = [ParamSpec(f"{path}.{weight}", (h,))]
        if bias:
            params.append(ParamSpec(f"{path}.bias", (h,)))
        # ~8 flops per element (mean, variance, normalise, scale, shift); memory-bound.
        fwd = (Kernel("fwd", ComputeKind.ELEMENTWISE, 8 * t * h, t * h * dt, t * h * dt),)
        bwd = (Kernel("bwd", ComputeKind.ELEMENTWISE, 16 * t * h, 2 * t * h * dt, t * h * dt),)
        self.modules.append(ModuleSpec(path, ModuleKind.NORM, Role.NORM, tuple(params), block, fwd, bwd))

    def embedding(self, path: str, rows: int, block: int | None = None) -> None:
        h, t, dt = self.cfg.hidden, self.t, self.dt
        params = (ParamSpec(f"{path}.weight", (rows, h)),)
        fwd = (Kernel("fwd", ComputeKind.EMBEDDING, 0, t * h * dt, t * h * dt),)
        # Backward zeroes a dense (rows, h) gradient and scatter-adds the token rows.
        bwd = (Kernel("bwd", ComputeKind.EMBEDDING, t * h, t * h * dt, rows * h * dt),)
        self.modules.append(ModuleSpec(path, ModuleKind.EMBEDDING, Role.EMBEDDING, params, block, fwd, bwd))

    def elementwise(self, path: str, kind: ModuleKind, block: int | None, elems_in: int, elems_out: int,
                    flops_per_elem: int = 1) -> None:
        dt = self.dt
        fwd = (Kernel("fwd", ComputeKind.ELEMENTWISE, flops_per_elem * elems_out, elems_in * dt, elems_out * dt),)
        bwd = (Kernel("bwd", ComputeKind.ELEMENTWISE, 2 * flops_per_elem * elems_out,
                      (elems_in + elems_out) * dt, elems_in * dt),)
        self.modules.append(ModuleSpec(path, kind, Role.NONE, (), block, fwd, bwd))

    def attention_core(self, path: str, block: int) -> None:
        fwd, bwd = self.attention_kernels()
        self.modules.append(ModuleSpec(path, ModuleKind.ATTENTION, Role.NONE, (), block, fwd, bwd))

    def attention_kernels(self) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
        """Scores, softmax, dropout and context of one layer (no parameters)."""
        c, b, s, t, dt = self.cfg, self.b, self.s, self.t, self.dt
        h, nh, hd, kvh = c.hidden, c.heads, c.head_dim, c.n_kv_heads
        qkv_elems = t * (h + 2 * kvh * hd)
        score_elems = b * nh * s * s
        # QK^T and AV: 2*t*s*h flops each; softmax and dropout pass over the scores.
        flops = 4 * t * s * h + 5 * score_elems
        fwd = (Kernel("fwd", ComputeKind.ATTENTION, flops,
                      (qkv_elems + 3 * score_elems) * dt, (3 * score_elems + t * h) * dt,
                      GemmShape(s, s, hd, b * nh)),)
        bwd = (Kernel("bwd", ComputeKind.ATTENTION, 2 * flops,
                      (qkv_elems + t * h + 4 * score_elems) * dt, (qkv_elems + 2 * score_elems) * dt,
                      GemmShape(s, s, hd, 2 * b * nh)),)
        return fwd, bwd


def _roberta(bd: _Builder) -> None:
    """RobertaForMaskedLM's whole module tree, in hook order (containers included)."""
    c = bd.cfg
    h, t = c.hidden, bd.t
    p = "roberta" if c.family == "roberta" else "bert"
    word = f"{p}.embeddings.word_embeddings"
    with bd.container(""):
        with bd.container(p):
            with bd.container(f"{p}.embeddings"):
                # HF RobertaEmbeddings.forward: word, token_type, position, LayerNorm, dropout
                bd.embedding(word, c.vocab)
                bd.embedding(f"{p}.embeddings.token_type_embeddings", c.type_vocab)
                bd.embedding(f"{p}.embeddings.position_embeddings", c.max_positions)
                bd.norm(f"{p}.embeddings.LayerNorm", None, bias=True)
                bd.marker(f"{p}.embeddings.dropout", None)
            with bd.container(f"{p}.encoder"):
                for i in range(c.layers):
                    L = f"{p}.encoder.layer.{i}"
                    with bd.container(L, block=i):
                        with bd.container(f"{L}.attention", block=i):
                            with bd.container(f"{L}.attention.self", block=i):
                                for name in ("query", "key", "value"):
                                    bd.linear(f"{L}.attention.self.{name}", h, h, Role.ATTENTION_QKV, i, bias=True)
                                # scores, softmax, dropout and context run around the
                                # dropout submodule: its hook is where that work happens
                                bd.attention_core(f"{L}.attention.self.dropout", i)
                            with bd.container(f"{L}.attention.output", block=i):
                                bd.linear(f"{L}.attention.output.dense", h, h, Role.ATTENTION_OUT, i, bias=True)
                                bd.marker(f"{L}.attention.output.dropout", i)
                                bd.norm(f"{L}.attention.output.LayerNorm", i, bias=True)
                        with bd.container(f"{L}.intermediate", block=i):
                            bd.linear(f"{L}.intermediate.dense", h, c.ffn, Role.MLP, i, bias=True)
                            bd.elementwise(f"{L}.intermediate.intermediate_act_fn", ModuleKind.ACTIVATION, i,
                                           t * c.ffn, t * c.ffn, 8)
                        with bd.container(f"{L}.output", block=i):
                            bd.linear(f"{L}.output.dense", c.ffn, h, Role.MLP, i, bias=True)
                            bd.marker(f"{L}.output.dropout", i)
                            bd.norm(f"{L}.output.LayerNorm", i, bias=True)
        # RobertaLMHead owns the decoder's bias (lm_head.bias; decoder.bias is the same
        # Parameter): a container with a parameter, fetched before its children. Its
        # gelu is functional (counted with the dense layer), and so is the loss (counted
        # with the decoder).
        with bd.container("lm_head", params=(ParamSpec("lm_head.bias", (c.vocab,)),), role=Role.LM_HEAD):
            bd.linear("lm_head.dense", h, h, Role.LM_HEAD, None, bias=True,
                      extra=_elementwise_kernels(bd, t * h, t * h, 8, "gelu"))
            bd.norm("lm_head.layer_norm", None, bias=True)
            bd.linear("lm_head.decoder", h, c.vocab, Role.LM_HEAD, None, bias=True,
                      weight_name=f"{word}.weight" if c.tie_embeddings else None, bias_name="lm_head.bias",
                      extra=_elementwise_kernels(bd, t * c.vocab, t * c.vocab, 5, "loss"))


def _gpt2(bd: _Builder) -> None:
    """GPT2LMHeadModel's module tree (dropouts included)."""
    c = bd.cfg
    h, t = c.hidden, bd.t
    with bd.container(""):
        with bd.container("transformer"):
            bd.embedding("transformer.wte", c.vocab)
            bd.embedding("transformer.wpe", c.max_positions)
            bd.marker("transformer.drop", None)
            for i in range(c.layers):
                L = f"transformer.h.{i}"
                with bd.container(L, block=i):
                    bd.norm(f"{L}.ln_1", i, bias=True)
                    with bd.container(f"{L}.attn", block=i):
                        bd.linear(f"{L}.attn.c_attn", h, 3 * h, Role.ATTENTION_QKV, i, bias=True)
                        bd.attention_core(f"{L}.attn.attn_dropout", i)
                        bd.linear(f"{L}.attn.c_proj", h, h, Role.ATTENTION_OUT, i, bias=True)
                        bd.marker(f"{L}.attn.resid_dropout", i)
                    bd.norm(f"{L}.ln_2", i, bias=True)
                    with bd.container(f"{L}.mlp", block=i):
                        bd.linear(f"{L}.mlp.c_fc", h, c.ffn, Role.MLP, i, bias=True)
                        bd.elementwise(f"{L}.mlp.act", ModuleKind.ACTIVATION, i, t * c.ffn, t * c.ffn, 8)
                        bd.linear(f"{L}.mlp.c_proj", c.ffn, h, Role.MLP, i, bias=True)
                        bd.marker(f"{L}.mlp.dropout", i)
            bd.norm("transformer.ln_f", None, bias=True)
        bd.linear("lm_head", h, c.vocab, Role.LM_HEAD, None, bias=False,
                  weight_name="transformer.wte.weight" if c.tie_embeddings else None,
                  extra=_elementwise_kernels(bd, t * c.vocab, t * c.vocab, 5, "loss"))


def _llama(bd: _Builder) -> None:
    """LlamaForCausalLM's module tree."""
    c = bd.cfg
    h, t, kv = c.hidden, bd.t, c.n_kv_heads * c.head_dim
    with bd.container(""):
        with bd.container("model"):
            bd.embedding("model.embed_tokens", c.vocab)
            bd.marker("model.rotary_emb", None)
            for i in range(c.layers):
                L = f"model.layers.{i}"
                with bd.container(L, block=i):
                    bd.norm(f"{L}.input_layernorm", i, bias=False)
                    with bd.container(f"{L}.self_attn", block=i):
                        bd.linear(f"{L}.self_attn.q_proj", h, h, Role.ATTENTION_QKV, i, bias=False)
                        bd.linear(f"{L}.self_attn.k_proj", h, kv, Role.ATTENTION_QKV, i, bias=False)
                        bd.linear(f"{L}.self_attn.v_proj", h, kv, Role.ATTENTION_QKV, i, bias=False,
                                  extra=bd.attention_kernels())
                        bd.linear(f"{L}.self_attn.o_proj", h, h, Role.ATTENTION_OUT, i, bias=False)
                    bd.norm(f"{L}.post_attention_layernorm", i, bias=False)
                    with bd.container(f"{L}.mlp", block=i):
                        # down_proj(act_fn(gate_proj(x)) * up_proj(x)): gate, act, up, down.
                        bd.linear(f"{L}.mlp.gate_proj", h, c.ffn, Role.MLP, i, bias=False)
                        bd.elementwise(f"{L}.mlp.act_fn", ModuleKind.ACTIVATION, i, 2 * t * c.ffn, t * c.ffn, 6)
                        bd.linear(f"{L}.mlp.up_proj", h, c.ffn, Role.MLP, i, bias=False)
                        bd.linear(f"{L}.mlp.down_proj", c.ffn, h, Role.MLP, i, bias=False)
            bd.norm("model.norm", None, bias=False)
        bd.linear("lm_head", h, c.vocab, Role.LM_HEAD, None, bias=False,
                  weight_name="model.embed_tokens.weight" if c.tie_embeddings else None,
                  extra=_elementwise_kernels(bd, t * c.vocab, t * c.vocab, 5, "loss"))


def _elementwise_kernels(bd: "_Builder", elems_in: int, elems_out: int, flops_per_elem: int,
                         name: str) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """Forward and backward kernels of a functional elementwise op (no module of its own)."""
    dt = bd.dt
    return ((Kernel(name, ComputeKind.ELEMENTWISE, flops_per_elem * elems_out, elems_in * dt, elems_out * dt),),
            (Kernel(f"{name}_bwd", ComputeKind.ELEMENTWISE, 2 * flops_per_elem * elems_out,
                    (elems_in + elems_out) * dt, elems_in * dt),))


_LOWER = {"roberta": _roberta, "bert": _roberta, "gpt2": _gpt2, "llama": _llama}


def describe(cfg: TransformerConfig, micro_batch: int, seq_len: int, dtype_bytes: int = 2) -> ModelDescription:
    """The module list of ``cfg`` with kernels for ``micro_batch`` sequences of ``seq_len``."""
    if micro_batch <= 0:
        raise CommsimInputError(f"micro-batch must be a positive integer, got {micro_batch}")
    if seq_len <= 0:
        raise CommsimInputError(f"sequence length must be a positive integer, got {seq_len}")
    if cfg.family in ("roberta", "bert", "gpt2") and seq_len > cfg.max_positions:
        raise CommsimInputError(
            f"model {cfg.name}: sequence length {seq_len} exceeds its {cfg.max_positions} learned positions"
        )
    bd = _Builder(cfg, micro_batch, seq_len, dtype_bytes)
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
