"""The megatron_gpt family: Megatron-LM's GPT layer with its fused kernels, what it keeps,
and its flops."""

from __future__ import annotations

import json

import pytest

from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from commsim.models.hf import load_hf_config
from commsim.models.megatron_gpt import fused_softmax_applies
from commsim.models.transformer import TransformerConfig, describe

SMALL = TransformerConfig("mg-small", family="megatron_gpt", layers=2, hidden=64, heads=4, ffn=256, vocab=1000,
                          max_positions=4096)
L1 = "language_model.encoder.layers.1"


def _block(md, i):
    return [m for m in md.modules if m.block == i]


def test_layer_kernels_in_order():
    """Block 1's kernels forward and backward (PyTorch 1.10's Linear: the QKV bias its own
    kernel), module by module, as the module docstring lists them."""
    mods = _block(describe(SMALL, 2, 64), 1)
    assert [(m.path.removeprefix(L1 + "."), [k.name for k in m.fwd]) for m in mods if m.fwd] == [
        ("input_layernorm", ["norm"]),
        ("self_attention.query_key_value", ["fwd", "bias_add"]),
        ("self_attention.scale_mask_softmax", ["qk", "softmax"]),
        ("self_attention.attention_dropout", ["dropout"]),
        ("self_attention.dense", ["av", "context_copy", "fwd"]),
        ("post_attention_layernorm", ["bias_dropout_add", "norm"]),
        ("mlp.dense_h_to_4h", ["fwd", "bias_gelu"]),
        ("mlp.dense_4h_to_h", ["fwd", "bias_dropout_add"]),
    ]
    assert [(m.path.removeprefix(L1 + "."), [k.name for k in m.bwd]) for m in reversed(mods) if m.bwd] == [
        ("mlp.dense_4h_to_h", ["bias_dropout_add_bwd", "bias_dropout_add.bias_grad", "wgrad", "dgrad"]),
        ("mlp.dense_h_to_4h", ["bias_gelu_bwd", "bias_gelu.bias_grad", "wgrad", "dgrad"]),
        ("post_attention_layernorm", ["norm_bwd.gamma_beta", "norm_bwd.input_grad", "input_grad_sum",
                                      "bias_dropout_add_bwd", "bias_dropout_add.bias_grad"]),
        ("self_attention.dense", ["wgrad", "dgrad", "av.grad_b", "av.grad_a"]),
        ("self_attention.attention_dropout", ["dropout_bwd"]),
        ("self_attention.scale_mask_softmax", ["softmax_bwd", "qk.grad_a", "qk.grad_a.alpha", "qk.grad_b",
                                               "qk.grad_b.alpha"]),
        ("self_attention.query_key_value", ["qkv_grad_cat", "bias_grad", "wgrad", "dgrad"]),
        ("input_layernorm", ["norm_bwd.gamma_beta", "norm_bwd.input_grad", "input_grad_sum"]),
    ]
    # the first layer also copies the embeddings to [s, b, h] (and back in backward)
    first = _block(describe(SMALL, 2, 64), 0)[1]
    assert [k.name for k in first.fwd] == ["to_sbh", "norm"] and first.bwd[-1].name == "to_sbh_bwd"


def test_saved_bytes_are_korthikantis_count():
    """34 s b h + 5 b heads s^2 bytes a layer in fp16 (Korthikanti et al. 2022), plus the
    two norms' fp32 mean and rstd."""
    for b, s in ((2, 64), (3, 128)):
        md = describe(SMALL, b, s)
        t, h, nh = b * s, SMALL.hidden, SMALL.heads
        assert sum(m.activation_bytes for m in _block(md, 1)) == 34 * t * h + 5 * b * nh * s * s + 16 * t


def test_gemm_flops_are_megatrons_formula():
    """Forward matmuls 24 t h^2 + 4 t s h a layer, backward twice that."""
    b, s, h = 2, 64, SMALL.hidden
    t = b * s
    mods = _block(describe(SMALL, b, s), 1)
    fwd = sum(k.flops for m in mods for k in m.fwd if k.kind is O.ComputeKind.GEMM)
    bwd = sum(k.flops for m in mods for k in m.bwd if k.kind is O.ComputeKind.GEMM)
    assert fwd == 24 * t * h * h + 4 * t * s * h and bwd == 2 * fwd


def test_softmax_falls_back_beyond_the_fused_kernels_range():
    assert fused_softmax_applies(2048, 4) and not fused_softmax_applies(4096, 4)
    assert not fused_softmax_applies(16, 4) and not fused_softmax_applies(64, 6)
    b, s = 1, 4096  # B = 4 heads: only the length rules it out
    mods = _block(describe(SMALL, b, s), 1)
    sm = next(m for m in mods if m.path.endswith("scale_mask_softmax"))
    assert [k.name for k in sm.fwd] == ["qk", "softmax.to_fp32", "softmax.scale", "softmax.mask", "softmax",
                                        "softmax.to_input"]
    assert sm.activation_bytes == 3 * b * s * SMALL.hidden * 2 + 4 * b * s * s * 4  # the fp32 probabilities


def test_config_json_and_refusals(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "megatron_gpt", "n_embd": 64, "n_layer": 2, "n_head": 4,
                             "vocab_size": 1000, "n_positions": 128}))
    cfg = load_hf_config(p)
    assert (cfg.family, cfg.ffn, cfg.act, cfg.tie_embeddings) == ("megatron_gpt", 256, "gelu_new", True)
    p.write_text(json.dumps({"model_type": "megatron_gpt", "n_embd": 64, "n_layer": 2, "n_head": 4,
                             "vocab_size": 1000, "activation_function": "relu"}))
    with pytest.raises(CommsimInputError, match="megatron_gpt family is Megatron-LM's GPT"):
        load_hf_config(p)
    with pytest.raises(CommsimInputError, match="exceeds its 128 learned positions"):
        describe(TransformerConfig("x", family="megatron_gpt", layers=1, hidden=64, heads=4, ffn=256, vocab=10,
                                   max_positions=128), 1, 256)


def test_softmax_fusion_off_runs_pytorchs_chain(tmp_path):
    """Megatron's --no-masked-softmax-fusion, as config.json's masked_softmax_fusion."""
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "megatron_gpt", "n_embd": 64, "n_layer": 2, "n_head": 4,
                             "vocab_size": 1000, "n_positions": 128, "masked_softmax_fusion": False}))
    cfg = load_hf_config(p)
    assert not cfg.softmax_fusion
    sm = next(m for m in _block(describe(cfg, 2, 64), 1) if m.path.endswith("scale_mask_softmax"))
    assert [k.name for k in sm.fwd][1:] == ["softmax.to_fp32", "softmax.scale", "softmax.mask", "softmax",
                                            "softmax.to_input"]
    # 36 bytes an element: 2 + 4, 4 + 4, 4 + 4 (+ the mask), 4 + 4, 4 + 2
    S = 2 * 4 * 64 * 64
    assert sum(k.bytes_read + k.bytes_written for k in sm.fwd[1:]) == 36 * S + 2 * 64 * 64
    with pytest.raises(CommsimInputError, match="masked_softmax_fusion is Megatron-LM's option"):
        TransformerConfig("g", family="gpt2", layers=1, hidden=64, heads=4, ffn=256, vocab=10, softmax_fusion=False)
