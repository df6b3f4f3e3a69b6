"""Parameter counts match published totals; flops match the Megatron-LM terms exactly."""

import json

import pytest

from commsim.ir.errors import CommsimInputError
from commsim.models import MODEL_PRESETS, describe, load_hf_config, resolve_model


@pytest.mark.parametrize(
    "name, published",
    [
        ("roberta-base", 125e6),
        ("roberta-large", 355e6),
        ("roberta-10b", 10.3e9),
        ("roberta-50b", 52e9),
        ("gpt3-175b", 175e9),
        ("llama2-7b", 6.74e9),
        ("llama2-13b", 13.0e9),
        ("llama2-70b", 69.0e9),
    ],
)
def test_published_totals_within_one_percent(name, published):
    n = describe(MODEL_PRESETS[name], 1, 512).num_params
    assert abs(n - published) / published <= 0.01, n


def test_exact_counts():
    # Hand counts: RobertaForMaskedLM (tied decoder weight, own bias) and LlamaForCausalLM.
    assert describe(MODEL_PRESETS["roberta-base"], 1, 512).num_params == 124_697_433
    assert describe(MODEL_PRESETS["llama2-7b"], 1, 512).num_params == 6_738_415_616
    assert describe(MODEL_PRESETS["llama2-70b"], 1, 512).num_params == 68_976_648_192


def test_roberta_base_breakdown():
    b = describe(MODEL_PRESETS["roberta-base"], 1, 512).param_breakdown()
    h, v, L = 768, 50265, 12
    assert b["embedding"] == v * h + 514 * h + 1 * h
    assert b["attention_qkv"] == L * 3 * (h * h + h)
    assert b["attention_out"] == L * (h * h + h)
    assert b["mlp"] == L * (2 * h * 3072 + 3072 + h)
    assert b["norm"] == (2 * L + 2) * 2 * h
    assert b["lm_head"] == h * h + h + v  # decoder weight is the tied embedding
    # q,k,v,o + intermediate + output + 2 LayerNorms per layer; embeddings LN; head dense, LN, decoder
    assert b["biases"] == L * (4 * h + 3072 + h + 2 * h) + h + 2 * h + v


def test_tied_weight_appears_under_both_modules_once_counted():
    d = describe(MODEL_PRESETS["tiny"], 2, 16)
    owners = [m.path for m in d.modules if any(p.name == "roberta.embeddings.word_embeddings.weight" for p in m.params)]
    assert owners == ["roberta.embeddings.word_embeddings", "lm_head.decoder"]


@pytest.mark.parametrize("name", ["roberta-10b", "roberta-50b", "gpt3-175b"])
def test_gemm_flops_match_megatron_terms(name):
    # Narayanan et al. 2021: forward = 24 B s L h^2 + 4 B s^2 L h + 2 B s h V for ffn = 4h,
    # excluding the LM-head dense layer (RoBERTa) which the formula omits.
    cfg = MODEL_PRESETS[name]
    B, s = 2, 512
    d = describe(cfg, B, s)
    # every matmul is a GEMM kernel now, the attention's QK^T and AV included; the
    # rotary table's tiny bmm (Llama) is none of the formula's terms
    gemm = sum(k.flops for m in d.modules for k in m.fwd if k.kind.value == "gemm")
    extra = 2 * B * s * cfg.hidden * cfg.hidden if cfg.family == "roberta" else 0
    h, L, V = cfg.hidden, cfg.layers, cfg.vocab
    assert gemm - extra == 24 * B * s * L * h * h + 4 * B * s * s * L * h + 2 * B * s * h * V
    # backward gemms are exactly twice the forward ones; recompute = one forward of the layers
    bwd_gemm = sum(k.flops for m in d.modules for k in m.bwd if k.kind.value == "gemm")
    assert bwd_gemm == 2 * gemm
    assert d.recompute_flops() == sum(m.fwd_flops for m in d.modules if m.block is not None)


def test_execution_order_of_a_roberta_layer():
    d = describe(MODEL_PRESETS["tiny"], 1, 8)
    layer0 = [(m.path.removeprefix("roberta.encoder.layer.0"), m.encloses) for m in d.modules if m.block == 0]
    # HF RobertaLayer's whole tree in pre-order, as DeepSpeed's hooks see it
    assert layer0 == [
        ("", 17), (".attention", 9), (".attention.self", 4), (".attention.self.query", 0),
        (".attention.self.key", 0), (".attention.self.value", 0), (".attention.self.dropout", 0),
        (".attention.output", 3), (".attention.output.dense", 0), (".attention.output.dropout", 0),
        (".attention.output.LayerNorm", 0), (".intermediate", 2), (".intermediate.dense", 0),
        (".intermediate.intermediate_act_fn", 0), (".output", 3), (".output.dense", 0), (".output.dropout", 0),
        (".output.LayerNorm", 0),
    ]


def test_sequence_longer_than_positions_is_refused():
    with pytest.raises(CommsimInputError, match="sequence length 600 exceeds its 514 learned positions"):
        describe(MODEL_PRESETS["roberta-base"], 1, 600)


ROBERTA_BASE_CONFIG = {
    "architectures": ["RobertaForMaskedLM"], "model_type": "roberta", "hidden_size": 768,
    "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
    "vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1,
}
LLAMA2_7B_CONFIG = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
}
GPT2_CONFIG = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
               "n_positions": 1024, "n_inner": None}


@pytest.mark.parametrize("config, preset", [(ROBERTA_BASE_CONFIG, "roberta-base"), (LLAMA2_7B_CONFIG, "llama2-7b")])
def test_hf_config_matches_preset(tmp_path, config, preset):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    loaded = describe(resolve_model(str(path)), 1, 128)
    ref = describe(MODEL_PRESETS[preset], 1, 128)
    assert loaded.modules == ref.modules


def test_hf_gpt2_small(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2_CONFIG))
    assert describe(load_hf_config(path), 1, 128).num_params == 124_439_808  # GPT-2 small, published 124M


def test_hf_config_errors(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(CommsimInputError, match=r"config.json: model_type 't5' is not supported; supported: bert"):
        load_hf_config(path)
    path.write_text(json.dumps({**ROBERTA_BASE_CONFIG, "hidden_size": "wide"}))
    with pytest.raises(CommsimInputError, match=r"config.json: field 'hidden_size' must be a positive integer, got 'wide'"):
        load_hf_config(path)
    del ROBERTA_BASE_CONFIG["vocab_size"]
    path.write_text(json.dumps(ROBERTA_BASE_CONFIG))
    ROBERTA_BASE_CONFIG["vocab_size"] = 50265
    with pytest.raises(CommsimInputError, match=r"config.json: missing field 'vocab_size'"):
        load_hf_config(path)


def test_unknown_model_lists_presets():
    with pytest.raises(CommsimInputError, match=r"--model 'roberta-3b': not a preset .*presets: roberta-base, roberta-large"):
        resolve_model("roberta-3b")


def _layer_counts(name, **kw):
    d = describe(MODEL_PRESETS[name], 2, 16, **kw)
    layer = [m for m in d.modules if m.block == 0]
    return sum(len(m.fwd) for m in layer), sum(len(m.bwd) for m in layer)


def test_kernels_per_layer():
    # HF eager, training mode (tests/models/test_hf_kernels.py checks them against the
    # real layers): PyTorch 1.10 adds a bias kernel after each of RoBERTa's 6 Linears and
    # before each of GPT-2's 4 Conv1D GEMMs; Llama has no biases
    from commsim.models import PYTORCH_2

    assert _layer_counts("tiny") == (29, 38) and _layer_counts("tiny", torch=PYTORCH_2) == (23, 38)
    assert _layer_counts("tiny-gpt2") == (32, 40) and _layer_counts("tiny-gpt2", torch=PYTORCH_2) == (28, 40)
    assert _layer_counts("tiny-llama") == (48, 82)  # grouped: repeat_kv copies instead of k and v copies
    assert _layer_counts("llama2-7b") == (48, 80)


def test_dropout_at_zero_launches_nothing(tmp_path):
    d = describe(MODEL_PRESETS["tiny"], 2, 16)
    drop = next(m for m in d.modules if m.path.endswith("0.output.dropout"))
    assert [k.kind.value for k in drop.fwd] == ["dropout"] and drop.fwd[0].bytes_written == 2 * 16 * 64 * 3
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**ROBERTA_BASE_CONFIG, "hidden_dropout_prob": 0.0, "hidden_act": "gelu"}))
    d = describe(load_hf_config(path), 1, 16)
    assert next(m for m in d.modules if m.path.endswith("0.output.dropout")).fwd == ()
    # the module stays: ZeRO-3's hooks still see it
    assert [m.path for m in d.modules] == [m.path for m in describe(MODEL_PRESETS["roberta-base"], 1, 16).modules]
    path.write_text(json.dumps({**ROBERTA_BASE_CONFIG, "hidden_act": "swish"}))
    with pytest.raises(CommsimInputError, match=r"field 'hidden_act'='swish' is not supported"):
        load_hf_config(path)
    path.write_text(json.dumps({**ROBERTA_BASE_CONFIG, "hidden_dropout_prob": 1.5}))
    with pytest.raises(CommsimInputError, match=r"field 'hidden_dropout_prob' must be a probability in \[0, 1\)"):
        load_hf_config(path)


def test_sdpa_attention_from_the_config(tmp_path):
    """attn_implementation "sdpa" (llama): one fused kernel each way in place of the score
    chain, no causal-mask kernels; refused for the other families and for other values."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA2_7B_CONFIG, "attn_implementation": "sdpa"}))
    cfg = load_hf_config(path)
    assert cfg.attention == "sdpa"
    d = describe(cfg, 2, 4096)
    layer = [m for m in d.modules if m.block == 0]
    att = [k for m in layer for k in m.fwd + m.bwd if k.kind.value == "attention"]
    assert [k.name for k in att] == ["sdpa", "sdpa_bwd"]
    causal = 4 * 2 * 32 * 4096 * 4096 * 128 // 2
    assert att[0].flops == causal and att[1].flops == causal * 5 // 2
    assert not any(k.kind.value == "softmax" for m in layer for k in m.fwd)
    rotary = next(m for m in d.modules if m.path == "model.rotary_emb")
    assert not any(k.name.startswith("causal_mask") for k in rotary.fwd)
    assert _layer_counts("llama2-7b") == (48, 80)  # eager stays the default
    path.write_text(json.dumps({**LLAMA2_7B_CONFIG, "attn_implementation": "flex_attention"}))
    with pytest.raises(CommsimInputError, match=r"config.json: field 'attn_implementation'='flex_attention' is not "
                                                r"supported; supported: eager, sdpa"):
        load_hf_config(path)
    path.write_text(json.dumps({**GPT2_CONFIG, "attn_implementation": "sdpa"}))
    with pytest.raises(CommsimInputError, match=r"attention 'sdpa' is modelled for the llama family only"):
        load_hf_config(path)
