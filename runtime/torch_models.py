"""Real torch modules for the catalogue's families, with Hugging Face's module tree.

``build_model(cfg)`` returns an ``nn.Module``: for roberta / bert one whose submodule
names, parameter registration and forward order mirror ``RobertaForMaskedLM``, so that
DeepSpeed's ZeRO-3 hooks see the same tree they would see on the Hugging Face model
without needing ``transformers``, and whose dropouts have the config's probabilities
(Hugging Face's 0.1 by default, which the generators' kernel lists assume); for gpt2 / llama Hugging Face's own
``GPT2LMHeadModel`` / ``LlamaForCausalLM`` (``transformers`` required).
Used to run real DeepSpeed on CPUs (fidelity tests, local validation)
and as an example of the ``module:function`` models that ``commsim.models.torch_walk`` reads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint  # noqa: F401  (torch 1.x does not import it with torch)
from torch import nn

from commsim.models.transformer import TransformerConfig


class _SelfAttention(nn.Module):
    def __init__(self, h: int, heads: int, p: float):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        hd = h // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, hd).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        probs = self.dropout(scores.softmax(-1))
        return (probs @ v).transpose(1, 2).reshape(b, s, h)


class _SelfOutput(nn.Module):
    def __init__(self, h: int, d_in: int, p: float):
        super().__init__()
        self.dense = nn.Linear(d_in, h)
        self.LayerNorm = nn.LayerNorm(h)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class _Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self = _SelfAttention(cfg.hidden, cfg.heads, cfg.p_attention)
        self.output = _SelfOutput(cfg.hidden, cfg.hidden, cfg.p_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class _Intermediate(nn.Module):
    def __init__(self, h: int, ffn: int):
        super().__init__()
        self.dense = nn.Linear(h, ffn)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg.hidden, cfg.ffn)
        self.output = _SelfOutput(cfg.hidden, cfg.ffn, cfg.p_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attention(x)
        return self.output(self.intermediate(a), a)


class _Encoder(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.layer = nn.ModuleList(_Layer(cfg) for _ in range(cfg.layers))
        self.gradient_checkpointing = False
        self.use_reentrant = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.use_reentrant)
            else:
                x = layer(x)
        return x


class _Embeddings(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab, cfg.hidden)
        self.LayerNorm = nn.LayerNorm(cfg.hidden)
        self.dropout = nn.Dropout(cfg.p_hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) + 2  # RoBERTa's padding offset
        # HF RobertaEmbeddings.forward's order: word, token type, position
        x = self.word_embeddings(ids) + self.token_type_embeddings(torch.zeros_like(ids))
        x = x + self.position_embeddings(pos)
        return self.dropout(self.LayerNorm(x))


class _Roberta(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embeddings(ids))


class _LMHead(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.layer_norm = nn.LayerNorm(cfg.hidden)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab))
        self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(F.gelu(self.dense(x))))


class RobertaForMaskedLM(nn.Module):
    """HF ``RobertaForMaskedLM``'s module tree: tied decoder weight, lm_head.bias."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        if cfg.family not in ("roberta", "bert"):
            raise ValueError(f"{cfg.name}: RobertaForMaskedLM builds roberta/bert configs, not {cfg.family}")
        self.config = cfg
        self.roberta = _Roberta(cfg)
        self.lm_head = _LMHead(cfg)
        if cfg.tie_embeddings:
            self.lm_head.decoder.weight = self.roberta.embeddings.word_embeddings.weight

    def gradient_checkpointing_enable(self, use_reentrant: bool = True) -> None:
        """Per-layer checkpointing; reentrant by default, as Hugging Face's default."""
        self.roberta.encoder.gradient_checkpointing = True
        self.roberta.encoder.use_reentrant = use_reentrant

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(self.roberta(ids))
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def build_model(cfg: TransformerConfig) -> nn.Module:
    """The family's module: this file's RoBERTa, or Hugging Face's own GPT-2 / Llama
    (``transformers``, eager attention) with the training scripts' calling convention."""
    if cfg.family in ("gpt2", "llama"):
        return _hf_causal_lm(cfg)
    return RobertaForMaskedLM(cfg)


def import_for(cfg: TransformerConfig) -> None:
    """Import what building ``cfg``'s model needs, before DeepSpeed's ``zero.Init`` patches
    ``torch.Tensor.__new__``: importing torch._dynamo (which transformers does on first
    use) under that patch fails its polyfill signature check."""
    if cfg.family in ("gpt2", "llama"):
        import torch._dynamo  # noqa: F401
        import transformers

        transformers.GPT2LMHeadModel, transformers.LlamaForCausalLM  # resolve the lazy modules now


def _hf_causal_lm(cfg: TransformerConfig) -> nn.Module:
    """``GPT2LMHeadModel`` / ``LlamaForCausalLM`` built from a catalogue config; a subclass
    only to take ``model(ids, labels=ids)`` -> loss and ``gradient_checkpointing_enable(
    use_reentrant=...)`` as the other models do (the module tree is Hugging Face's)."""
    import transformers as T

    if cfg.family == "gpt2":
        hf = T.GPT2Config(vocab_size=cfg.vocab, n_positions=cfg.max_positions, n_embd=cfg.hidden,
                          n_layer=cfg.layers, n_head=cfg.heads, n_inner=cfg.ffn,
                          tie_word_embeddings=cfg.tie_embeddings)
        base = T.GPT2LMHeadModel
    else:
        hf = T.LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                           num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                           num_key_value_heads=cfg.kv_heads or cfg.heads, max_position_embeddings=cfg.max_positions,
                           tie_word_embeddings=cfg.tie_embeddings)
        base = T.LlamaForCausalLM
    for name, p in (("resid_pdrop", cfg.hidden_dropout), ("embd_pdrop", cfg.hidden_dropout),
                    ("attn_pdrop", cfg.attention_dropout)):
        if p is not None and hasattr(hf, name):
            setattr(hf, name, p)
    hf._attn_implementation = "eager"  # the kernels commsim's catalogue lists

    class CausalLM(base):
        def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
            out = super().forward(input_ids=ids, labels=labels)
            return out.loss if labels is not None else out.logits

        def gradient_checkpointing_enable(self, use_reentrant: bool = True) -> None:
            super().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})

    return CausalLM(hf)


def tiny() -> nn.Module:
    """The catalogue's ``tiny`` preset as a real module (a ``module:function`` example)."""
    from commsim.models.presets import MODEL_PRESETS

    return build_model(MODEL_PRESETS["tiny"])
