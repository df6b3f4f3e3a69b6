"""Read a local Hugging Face ``config.json`` into a ``TransformerConfig``.

Supported ``model_type``s: bert, roberta (and xlm-roberta), gpt2, llama (and mistral,
which shares Llama's module tree), ``bing_bert``: a BERT config.json read as
DeepSpeed's bing_bert with its transformer kernel (``commsim.models.bing_bert``), and
``megatron_gpt``: a GPT-2 config.json read as Megatron-LM's GPT with its fused kernels
(``commsim.models.megatron_gpt``); the last two are not Hugging Face types but
commsim's names for those models. The file is only read, never downloaded. Missing
or invalid fields are reported with the file and the field name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from commsim.ir.errors import CommsimInputError
from commsim.models.transformer import ACTIVATIONS, ATTENTIONS, TransformerConfig
from commsim.util.files import read_json

SUPPORTED = ("bert", "roberta", "xlm-roberta", "gpt2", "llama", "mistral", "bing_bert", "megatron_gpt")


def _get(cfg: dict[str, Any], path: Path, *keys: str, default: int | None = None) -> int:
    """The first present integer among ``keys`` (HF renamed some fields over time)."""
    for k in keys:
        v = cfg.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise CommsimInputError(f"{path}: field {k!r} must be a positive integer, got {v!r}")
        return v
    if default is None:
        raise CommsimInputError(f"{path}: missing field {' or '.join(repr(k) for k in keys)}")
    return default


def _get_bool(cfg: dict[str, Any], path: Path, key: str, default: bool) -> bool:
    v = cfg.get(key, default)
    if not isinstance(v, bool):
        raise CommsimInputError(f"{path}: field {key!r} must be true or false, got {v!r}")
    return v


def _get_prob(cfg: dict[str, Any], path: Path, key: str) -> float | None:
    """A dropout probability, or None (the family's default) when absent."""
    v = cfg.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
        raise CommsimInputError(f"{path}: field {key!r} must be a probability in [0, 1), got {v!r}")
    return float(v)


def _get_act(cfg: dict[str, Any], path: Path, key: str) -> str | None:
    v = cfg.get(key)
    if v is None:
        return None
    if v not in ACTIVATIONS:
        raise CommsimInputError(f"{path}: field {key!r}={v!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return v


def _get_attention(cfg: dict[str, Any], path: Path) -> str:
    """``attn_implementation`` (as saved by Hugging Face, also ``_attn_implementation``):
    eager when absent, the catalogue's default."""
    for key in ("attn_implementation", "_attn_implementation"):
        v = cfg.get(key)
        if v is None:
            continue
        if v not in ATTENTIONS:
            raise CommsimInputError(f"{path}: field {key!r}={v!r} is not supported; supported: {', '.join(ATTENTIONS)}")
        return v
    return "eager"


def load_hf_config(path: str | Path, name: str | None = None) -> TransformerConfig:
    path = Path(path)
    cfg = read_json(path, CommsimInputError)
    if not isinstance(cfg, dict):
        raise CommsimInputError(f"{path}: a config.json holds one JSON object")
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED:
        raise CommsimInputError(f"{path}: model_type {mtype!r} is not supported; supported: {', '.join(SUPPORTED)}")
    name = name or cfg.get("_name_or_path") or path.parent.name or path.stem
    if mtype in ("bert", "roberta", "xlm-roberta", "bing_bert"):
        return TransformerConfig(
            name=name,
            family={"bert": "bert", "bing_bert": "bing_bert"}.get(mtype, "roberta"),
            layers=_get(cfg, path, "num_hidden_layers"),
            hidden=_get(cfg, path, "hidden_size"),
            heads=_get(cfg, path, "num_attention_heads"),
            ffn=_get(cfg, path, "intermediate_size"),
            vocab=_get(cfg, path, "vocab_size"),
            max_positions=_get(cfg, path, "max_position_embeddings", default=512),
            type_vocab=_get(cfg, path, "type_vocab_size", default=2),
            tie_embeddings=_get_bool(cfg, path, "tie_word_embeddings", True),
            hidden_dropout=_get_prob(cfg, path, "hidden_dropout_prob"),
            attention_dropout=_get_prob(cfg, path, "attention_probs_dropout_prob"),
            activation=_get_act(cfg, path, "hidden_act"),
            attention=_get_attention(cfg, path),
        )
    if mtype in ("gpt2", "megatron_gpt"):
        hidden = _get(cfg, path, "n_embd", "hidden_size")
        return TransformerConfig(
            name=name,
            family=mtype,
            layers=_get(cfg, path, "n_layer", "num_hidden_layers"),
            hidden=hidden,
            heads=_get(cfg, path, "n_head", "num_attention_heads"),
            ffn=_get(cfg, path, "n_inner", default=4 * hidden),
            vocab=_get(cfg, path, "vocab_size"),
            max_positions=_get(cfg, path, "n_positions", "max_position_embeddings", default=1024),
            tie_embeddings=_get_bool(cfg, path, "tie_word_embeddings", True),
            # resid_pdrop for every hidden-state dropout (embd_pdrop is the same 0.1 in
            # GPT-2's published configs)
            hidden_dropout=_get_prob(cfg, path, "resid_pdrop"),
            attention_dropout=_get_prob(cfg, path, "attn_pdrop"),
            activation=_get_act(cfg, path, "activation_function"),
            attention=_get_attention(cfg, path),
            # Megatron's --masked-softmax-fusion (default on)
            softmax_fusion=_get_bool(cfg, path, "masked_softmax_fusion", True) if mtype == "megatron_gpt" else True,
        )
    heads = _get(cfg, path, "num_attention_heads")
    for unsupported in ("attention_bias", "mlp_bias"):
        if cfg.get(unsupported):
            raise CommsimInputError(f"{path}: field {unsupported!r}=true is not supported (Llama without biases only)")
    return TransformerConfig(
        name=name,
        family="llama",
        layers=_get(cfg, path, "num_hidden_layers"),
        hidden=_get(cfg, path, "hidden_size"),
        heads=heads,
        kv_heads=_get(cfg, path, "num_key_value_heads", default=heads),
        ffn=_get(cfg, path, "intermediate_size"),
        vocab=_get(cfg, path, "vocab_size"),
        max_positions=_get(cfg, path, "max_position_embeddings", default=4096),
        tie_embeddings=_get_bool(cfg, path, "tie_word_embeddings", False),
        attention_dropout=_get_prob(cfg, path, "attention_dropout"),
        activation=_get_act(cfg, path, "hidden_act"),
        attention=_get_attention(cfg, path),
    )
