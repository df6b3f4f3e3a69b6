"""The bing_bert family: DeepSpeed's transformer-kernel layer as one module, its kernels,
what it keeps, and the host syncs its CUDA layer makes."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from commsim.models.bing_bert import LAYER_PARAMS, masked_positions
from commsim.models.hf import load_hf_config
from commsim.models.transformer import TransformerConfig, describe

SMALL = TransformerConfig("bb-small", family="bing_bert", layers=2, hidden=64, heads=4, ffn=256, vocab=1000,
                          type_vocab=2)


def _layer(md, i=0):
    return next(m for m in md.modules if m.path == f"bert.encoder.layer.{i}")


def test_layer_parameters_are_the_real_deepspeed_layers():
    """The installed DeepSpeed's DeepSpeedTransformerLayer, its CUDA module stubbed out
    (only its constructor's parameters are read): one module, twelve parameters, these
    names and shapes in this order."""
    torch = pytest.importorskip("torch")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    T = pytest.importorskip("deepspeed.ops.transformer.transformer")

    class NoCuda:
        def __getattr__(self, name):
            return lambda *a, **k: None

    saved = T.transformer_cuda_module
    T.transformer_cuda_module = NoCuda()
    try:
        cfg = T.DeepSpeedTransformerConfig(batch_size=2, hidden_size=64, intermediate_size=256, heads=4,
                                           attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, num_hidden_layers=2,
                                           initializer_range=0.02, local_rank=-1, seed=1, fp16=False,
                                           pre_layer_norm=True, attn_dropout_checkpoint=True, gelu_checkpoint=True)
        with torch.no_grad():
            real = T.DeepSpeedTransformerLayer(cfg)
    finally:
        T.transformer_cuda_module = saved
    assert [n for n, _ in real.named_modules()] == [""]
    ours = _layer(describe(SMALL, 2, 16))
    assert [(p.name, p.shape) for p in ours.params] == \
        [(f"bert.encoder.layer.0.{n}", tuple(p.shape)) for n, p in real.named_parameters()]
    assert tuple(n for n, _ in real.named_parameters()) == LAYER_PARAMS


def test_five_billion_layer_is_the_published_gather():
    """E2: one layer of the 5.1B model is 9,834,560 fp16 elements per rank on 8 GPUs."""
    big = TransformerConfig("bb-5.1b", family="bing_bert", layers=64, hidden=2560, heads=40, ffn=10240, vocab=32003,
                            type_vocab=2)
    md = describe(big, 1, 128)
    assert _layer(md).numel == 8 * 9_834_560
    assert round(md.num_params / 1e9, 1) == 5.1


def test_layer_kernels_in_launch_order():
    layer = _layer(describe(SMALL, 2, 16))
    assert [k.name for k in layer.fwd] == [
        "layer_norm", "qkv", "bias_add_transform_0213", "attn_scores", "softmax", "attn_prob_dropout",
        "attn_context", "transform4d_0213", "attn_out", "attn_output_dropout", "attn_layer_norm", "ff1", "bias_gelu",
        "ff2", "layer_output_dropout"]
    assert [k.name for k in layer.bwd] == [
        "layer_output_dropout_bwd", "bias_gelu_recompute", "ff2.wgrad", "ff2.dgrad", "ff2.bias_grad", "bias_gelu_bwd",
        "ff1.wgrad", "ff1.dgrad", "ff1.bias_grad", "attn_layer_norm_bwd.gamma_beta", "attn_layer_norm_bwd.input_grad",
        "attn_output_dropout_bwd", "attn_out.wgrad", "attn_out.dgrad", "attn_out.bias_grad", "transform_0213",
        "attn_prob_dropout_recompute", "attn_context.grad_v", "attn_context.grad_probs", "attn_prob_dropout_bwd",
        "softmax_bwd", "attn_scores.grad_k", "attn_scores.grad_q", "transform4d_0213_qkv", "qkv.wgrad", "qkv.dgrad",
        "qkv.bias_grad", "layer_norm_bwd.gamma_beta", "layer_norm_bwd.input_grad"]
    gemm = O.ComputeKind.GEMM
    f = sum(k.flops for k in layer.fwd if k.kind is gemm)
    # b s (2 h 3h + 2 h h + 2 h ffn 2) + the two batched attention GEMMs (2 s s d per head, each)
    t, h, ffn, s, bh, d = 32, 64, 256, 16, 8, 16
    assert f == t * (2 * h * 3 * h + 2 * h * h + 2 * 2 * h * ffn) + 2 * bh * 2 * s * s * d
    # every GEMM has two of the same flops in backward
    assert sum(k.flops for k in layer.bwd if k.kind is gemm) == 2 * f
    by_name = {k.name: k for k in layer.fwd}
    assert by_name["qkv"].gemm == O.GemmShape(t, 3 * h, h)
    assert by_name["attn_scores"].gemm == O.GemmShape(s, s, d, bh)
    # the dropout with bias and residual reads x, the residual and the bias, writes the
    # sum and its one-byte mask
    k = by_name["attn_output_dropout"]
    assert (k.bytes_read, k.bytes_written) == ((2 * t * h + h) * 2, t * h * 2 + t * h)


def test_layer_keeps_what_the_function_saves():
    """Pre-LN, attention-dropout and GELU checkpoints: output, normalised input, q k v,
    softmax output, context, residual sum, MLP input, the first MLP GEMM's output (fp16),
    three one-byte masks, four row statistics."""
    t, h, ffn, scores = 32, 64, 256, 2 * 4 * 16 * 16
    expected = 2 * (t * h + t * h + 3 * t * h + scores + t * h + t * h + t * h + t * ffn + 4 * t) \
        + (scores + t * h + t * h)
    layer = _layer(describe(SMALL, 2, 16))
    assert layer.saved_bytes == expected
    # its backward hands the layer before it one (t, h) gradient; the weight, bias and
    # norm gradient kernels are parameter gradients, not chain temporaries
    from commsim.models.grad_memory import backward_memory, writes_param_grad
    assert backward_memory(layer).grad_input_bytes == t * h * 2
    assert [k.name for k in layer.bwd if writes_param_grad(k, layer)] == [
        f"{g}.{part}" for g in ("ff2", "ff1") for part in ("wgrad", "bias_grad")] + [
        "attn_layer_norm_bwd.gamma_beta", "attn_out.wgrad", "attn_out.bias_grad", "qkv.wgrad", "qkv.bias_grad",
        "layer_norm_bwd.gamma_beta"]


def test_masked_positions_are_bert_masking_rate():
    assert [masked_positions(s) for s in (128, 256, 512, 3)] == [19, 38, 77, 1]
    md = describe(SMALL, 2, 128)
    dec = next(m for m in md.modules if m.path == "cls.predictions.decoder")
    assert dec.fwd[1].gemm == O.GemmShape(2 * 19, 1000, 64)
    assert dec.params[0].name == "bert.embeddings.word_embeddings.weight"  # tied


@pytest.mark.parametrize("stage", [2, 3])
def test_each_layer_syncs_its_stream_both_ways_and_the_head_once(stage):
    from commsim.ir.validate import validate
    from commsim.strategies import World, generate
    from commsim.strategies.dsconfig import parse_ds_config
    from commsim.strategies.knobs import KNOB_PRESETS

    cfg = parse_ds_config({"fp16": {"enabled": True}, "train_micro_batch_size_per_gpu": 2,
                           "zero_optimization": {"stage": stage}})
    sched = generate(describe(SMALL, 2, 16), World(1, 2), cfg, KNOB_PRESETS["current"], checkpointing=False)
    validate(sched)
    step = sched.programs[0].step
    syncs = [op.label for op in step if isinstance(op, O.HostSync) and op.label.endswith("stream synchronize")]
    assert syncs == ["bert.encoder.layer.0.fwd stream synchronize", "bert.encoder.layer.1.fwd stream synchronize",
                     "cls.predictions.transform.dense_act.fwd stream synchronize",
                     "bert.encoder.layer.1.bwd stream synchronize", "bert.encoder.layer.0.bwd stream synchronize"]
    assert all(op.scope is O.SyncScope.STREAM and op.stream == "compute" for op in step
               if isinstance(op, O.HostSync) and op.label.endswith("stream synchronize"))
    # the Hugging Face BERT tree syncs nowhere of its own
    hf = replace(SMALL, family="bert")
    plain = generate(describe(hf, 2, 16), World(1, 2), cfg, KNOB_PRESETS["current"], checkpointing=False)
    assert not [op for op in plain.programs[0].step if isinstance(op, O.HostSync)
                and op.label.endswith("stream synchronize")]


def test_config_json_and_bad_settings(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "bing_bert", "hidden_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "intermediate_size": 256, "vocab_size": 1000}))
    cfg = load_hf_config(p)
    assert (cfg.family, cfg.type_vocab, cfg.layers) == ("bing_bert", 2, 2)
    p.write_text(json.dumps({"model_type": "bing_bert", "hidden_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "intermediate_size": 256, "vocab_size": 1000,
                             "hidden_act": "relu"}))
    with pytest.raises(CommsimInputError, match="bing_bert family is DeepSpeed's transformer kernel"):
        load_hf_config(p)


def test_parameter_breakdown_splits_the_fused_layer():
    """The layer is one module, but its parameters count toward their own categories."""
    out = describe(SMALL, 1, 16).param_breakdown()
    h, f, L = 64, 256, 2
    assert out["attention_qkv"] == L * (3 * h * h + 3 * h)
    assert out["attention_out"] == L * (h * h + h)
    assert out["mlp"] == L * (2 * h * f + f + h)
    assert out["other"] == 0
    # every layer's six biases (norms' included), the embeddings' and heads' own
    assert out["biases"] == L * (7 * h + f) + h + h + h + h + 1000 + 2 + h


def test_sequence_not_a_multiple_of_16_is_refused():
    with pytest.raises(CommsimInputError, match="not a multiple of 16"):
        describe(SMALL, 2, 100)
