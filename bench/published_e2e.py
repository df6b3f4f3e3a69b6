"""bench/validate_published.py's end-to-end items: E1-E5, whole training steps predicted
by ``commsim.api.predict`` in symmetric mode (BERT-Large pre-training on DGX A100 and
DGX-1, the 5.1B bing_bert under DeepSpeed 0.5.4 / 0.5.10 / 0.6.0 and ZeRO-2, Megatron's
1.7B GPT, ZeRO-3 10B on a DGX-2, fms-fsdp's Llama-2 7B-70B), the models the catalogue
lacks described by a Hugging Face config.json in a temporary folder. Where the setup
leaves something open the prediction is a range over it. Not a script: validate_published
runs the items; ``e2_phases`` and ``phase_times_ms`` also serve ad-hoc scripts."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is imported

from commsim.api import Scenario, predict  # noqa: E402
from commsim.ir import ops as O  # noqa: E402

from published_rows import E2E, Row, range_row, write_config  # noqa: E402


# ---------------------------------------------------------------- end to end


def ds(stage: int, micro: int, precision: str = "fp16", gas: int = 1, optimizer: str = "Lamb") -> dict:
    return {precision: {"enabled": True}, "optimizer": {"type": optimizer}, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas, "zero_optimization": {"stage": stage}}


def bert_large_config(tmp: Path) -> str:
    # BERT-Large (Devlin et al. 2019; HF bert-large-uncased config.json): the roberta-large
    # shape with BERT's vocabulary, positions and token types.
    return write_config(tmp, "bert-large", {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24,
                                            "num_attention_heads": 16, "intermediate_size": 4096,
                                            "vocab_size": 30522, "max_position_embeddings": 512,
                                            "type_vocab_size": 2})


def seqs_per_s(model: str, cluster: str, nodes: int, gpn: int | None, micro: int, seq: int,
               with_tflops: bool = False):
    """(sequences/s, OOM reason or None) predicted; with ``with_tflops`` also the model
    TFLOPS/GPU of that prediction (commsim's count of the model's flops)."""
    p = predict(Scenario(model=model, cluster=cluster, nodes=nodes, gpus_per_node=gpn, stage=0,
                         ds_config=ds(0, micro), seq=seq, checkpointing=False, mode="symmetric"))
    out = (p.metrics.tokens_per_s / seq, p.metrics.oom)
    return out + (p.metrics.model_tflops_per_gpu,) if with_tflops else out


PADDING_NOTE = ("every sequence full length (NVIDIA's loader pads a batch to its longest and may bin by "
                "length: fewer tokens, not modelled)")


def e1(tmp: Path) -> list[Row]:
    # Every sequence is predicted at the full length. NVIDIA's data loader for these
    # examples, LDDL (PyPI lddl 0.1.0, "Language Datasets and Data Loaders for NVIDIA Deep
    # Learning Examples"; its README builds on the NGC PyTorch 21.11 container, E1's
    # release), pads each batch only to its longest sequence (lddl/torch/bert.py
    # _to_encoded_inputs, aligned to 8) and can bin samples by length (--bin-size, 64 in
    # its phase-2 example), so a run may compute on fewer tokens than micro-batch x seq.
    # Whether E1's runs used it, and the samples' lengths, are not published: the
    # prediction is the work of full sequences, an upper bound, and each row says so.
    bert = bert_large_config(tmp)
    rows = []

    def row(what: str, cluster: str, nodes: int, gpn: int | None, micro: int, seq: int, pub: float, gpu: str,
            note: str = "") -> None:
        v, oom, tflops = seqs_per_s(bert, cluster, nodes, gpn, micro, seq, with_tflops=True)
        gpus = nodes * (gpn or 8)
        # the published rate in model TFLOPS/GPU by commsim's count of the padded model's
        # flops: beside G1's best GEMM on the GPU, what the run's kernels must have reached
        implied = "" if oom or not v else f"the published rate is {tflops * pub / v:.0f} model TFLOPS/GPU"
        rows.append(Row("E1", what, f"{cluster} {nodes}x{gpn or 8} {gpu}; BERT-Large (bert config.json, vocab 30522), "
                        f"ZeRO-0, micro-batch {micro} x seq {seq}, fp16, fused-LAMB-as-Adam, no checkpointing "
                        f"({gpus} GPUs)", "seq/s", pub, None if oom else v, E2E,
                        note="; ".join(n for n in (note or oom or "", implied, PADDING_NOTE) if n)))

    a100 = "A100-80GB"
    for seq, micro, one, eight in ((128, 256, 580, 4591), (512, 32, 210, 1657)):
        # the mapping's effect: the catalogue's roberta-large (vocab 50265, 514 positions,
        # one token type) instead of the exact BERT-Large config
        exact, _ = seqs_per_s(bert, "dgx-a100", 1, 1, micro, seq)
        rl, _ = seqs_per_s("roberta-large", "dgx-a100", 1, 1, micro, seq)
        row(f"DGX A100 seq {seq} 1 GPU", "dgx-a100", 1, 1, micro, seq, one, a100,
            note=f"the roberta-large preset instead: {rl:.1f} seq/s ({100 * (rl - exact) / exact:+.1f}%)")
        row(f"DGX A100 seq {seq} 8 GPUs", "dgx-a100", 1, None, micro, seq, eight, a100)
    multi = {128: (256, (4553, 9191, 18119, 35774, 70555, 138294)), 512: (32, (1648, 3291, 6464, 13005, 25570, 49663))}
    for seq, (micro, pubs) in multi.items():
        for nodes, pub in zip((1, 2, 4, 8, 16, 32), pubs):
            row(f"DGX A100 seq {seq} {nodes} nodes", "dgx-a100", nodes, None, micro, seq, pub, a100,
                note="batch per GPU of the single-node runs assumed")
    note = "DGX-1 batch not in published-runs.md: 64 (seq 128) / 8 (seq 512) assumed"
    for seq, micro, one, eight in ((128, 64, 224, 1746), (512, 8, 75, 586)):
        row(f"DGX-1 V100 seq {seq} 1 GPU", "p3dn", 1, 1, micro, seq, one, "V100-32GB (DGX-1's node)", note)
        row(f"DGX-1 V100 seq {seq} 8 GPUs", "p3dn", 1, None, micro, seq, eight, "V100-32GB (DGX-1's node)", note)
    return rows


def phase_times_ms(pred) -> dict[str, float]:
    """Forward, backward (recompute and gradient reduction included) and optimizer times
    of the predicted step, as a synchronised wall-clock breakdown sees them: forward ends
    with its last op (any stream, host included), backward from there to its last op."""
    recs = [r for rr in pred.result.ranks.values() for r in rr.records]
    t0 = min(r.start_ns for r in recs)
    end = {ph: max((r.end_ns for r in recs if r.op.phase in phs), default=t0)
           for ph, phs in (("fwd", (O.Phase.FORWARD,)), ("bwd", (O.Phase.BACKWARD, O.Phase.RECOMPUTE)),
                           ("optimizer", (O.Phase.OPTIMIZER,)))}
    return {"fwd": (end["fwd"] - t0) / 1e6, "bwd": (end["bwd"] - end["fwd"]) / 1e6,
            "optimizer": (end["optimizer"] - end["bwd"]) / 1e6}


E2_MICRO, E2_SEQ = (4, 8, 16), (128, 256, 512)


def e2_phases(tmp: Path) -> tuple[dict, list, list]:
    """Forward / backward / optimizer times of the 5.1B bing_bert on one p4d node over
    the grid, for DeepSpeed 0.5.4 (``before-pr1188``: the state before PR 1188), 0.5.10
    (``baseline``: PR 1188's state, which 0.5.5 shipped), 0.6.0 (``optimized``) and
    ZeRO-2; and the grid points where all of them fit."""
    # bing_bert 5.1B (DeepSpeed PR 1188) with DeepSpeed's transformer kernel (commsim's
    # bing_bert family: one module per layer, DeepSpeed's fused kernels, attention
    # dropout and GELU recomputed in the kernel's backward), no layer-wise checkpointing.
    cfg = write_config(tmp, "bing-bert-5.1b", {"model_type": "bing_bert", "hidden_size": 2560, "num_hidden_layers": 64,
                                               "num_attention_heads": 40, "intermediate_size": 10240,
                                               "vocab_size": 32003, "max_position_embeddings": 512,
                                               "type_vocab_size": 2})
    presets = (("z3 0.5.4", 3, "before-pr1188"), ("z3 0.5.10", 3, "baseline"), ("z3 0.6.0", 3, "optimized"),
               ("z2", 2, "current"))
    points = [(micro, seq) for micro in E2_MICRO for seq in E2_SEQ]
    phases: dict[tuple[str, int, int], dict[str, float] | None] = {}
    for name, stage, preset in presets:
        for micro, seq in points:
            p = predict(Scenario(model=cfg, cluster="p4d", nodes=1, stage=stage, preset=preset,
                                 ds_config=ds(stage, micro), seq=seq, checkpointing=False, mode="symmetric"))
            phases[name, micro, seq] = None if p.metrics.oom else phase_times_ms(p)
    # The published figures come from one setup run under each version: the range is over
    # the points where every one fits (at the largest points every version runs out of
    # the A100-40GB's memory; at 16 x 256 ZeRO-2, which keeps every fp16 parameter,
    # runs out where ZeRO-3 does not).
    fit = [(m, s) for m, s in points if all(phases[name, m, s] is not None for name, _, _ in presets)]
    return phases, fit, points


def e2(tmp: Path) -> list[Row]:
    # PR 1188 was merged between DeepSpeed 0.5.4 and 0.5.5; 0.5.5-0.5.10 ship its state
    # (research note deepspeed-zero3-versions.md section 10.2), so its "after" figures are
    # the baseline's (0.5.10), its "before" figures 0.5.4's (before-pr1188).
    phases, fit, points = e2_phases(tmp)
    grid = f"micro-batch {'/'.join(map(str, E2_MICRO))} x seq {'/'.join(map(str, E2_SEQ))}"

    def setup(name: str) -> str:
        what = {"z3 0.5.4": "ZeRO-3 DeepSpeed 0.5.4 (before-pr1188)", "z3 0.5.10": "ZeRO-3 DeepSpeed 0.5.10 (baseline)",
                "z3 0.6.0": "ZeRO-3 DeepSpeed 0.6.0 (optimized)", "z2": "ZeRO-2"}[name]
        return (f"p4d 1x8 A100-40GB; 5.1B bing_bert with DeepSpeed's transformer kernel (h 2560, 64 layers, "
                f"40 heads, FFN 10240, vocab 32003), "
                f"{what}, fp16, no checkpointing; range over {grid} where every version fits")

    fit_note = (f"{len(fit)} of {len(points)} points fit under ZeRO-3: "
                + " ".join(f"{m}x{s}" for m, s in fit))
    pr = "DeepSpeed PR 1188 text"
    cm = "the PR's final commit message"
    rows = []
    for name, phase, pub, src in (("z3 0.5.10", "fwd", 270, f"{pr}, after the PR"),
                                  ("z3 0.5.10", "bwd", 670, f"{pr}, after the PR"),
                                  ("z3 0.5.10", "fwd", 200, f"{cm}, after"), ("z3 0.5.10", "bwd", 610, f"{cm}, after"),
                                  ("z3 0.5.4", "fwd", 470, f"{pr}, before the PR"),
                                  ("z3 0.5.4", "bwd", 900, f"{pr}, before the PR"),
                                  ("z3 0.5.4", "fwd", 300, f"{cm}, before"), ("z3 0.5.4", "bwd", 680, f"{cm}, before"),
                                  ("z2", "fwd", 60, pr)):
        values = [phases[name, m, s][phase] for m, s in fit]
        rows.append(range_row("E2", f"{name} {phase} ({src})", setup(name), "ms", pub, values, E2E, note=fit_note))

    def ratio_row(what: str, num: str, den: str, phase: str, pub: float, den_phase: str | None = None) -> Row:
        """num / den point by point (both versions at the same micro-batch and sequence)."""
        values = [phases[num, m, s][phase] / phases[den, m, s][den_phase or phase] for m, s in fit]
        return range_row("E2", what, setup(num) + f"; {den[3:] if den.startswith('z3') else 'ZeRO-2'} at the same "
                         "point", "x", pub, values, E2E, note=fit_note)

    rows.append(ratio_row("z3 0.5.10 fwd / z2 fwd (270 / 60, after the PR)", "z3 0.5.10", "z2", "fwd", 270 / 60))
    rows.append(ratio_row("z3 0.5.4 fwd / z2 fwd (470 / 60, before the PR: 'about 8x')", "z3 0.5.4", "z2", "fwd",
                          470 / 60))
    for phase, before, after, src in (("fwd", 470, 270, pr), ("bwd", 900, 670, pr), ("fwd", 300, 200, cm),
                                      ("bwd", 680, 610, cm)):
        rows.append(ratio_row(f"z3 {phase} before / after PR 1188 ({before} / {after}, {src})", "z3 0.5.4",
                              "z3 0.5.10", phase, before / after))
    # "about 1.1 ms saved per all-gather of one layer": bing_bert's DeepSpeed transformer
    # layer is one module, one gather a forward; the forward's saving over its 64 layers
    saved = [(phases["z3 0.5.4", m, s]["fwd"] - phases["z3 0.5.10", m, s]["fwd"]) / 64 for m, s in fit]
    rows.append(range_row("E2", "forward time PR 1188 saved per layer's all-gather", setup("z3 0.5.4")
                          + "; 0.5.10 at the same point; the forward's difference over 64 layers", "ms", 1.1, saved,
                          E2E, note=fit_note))
    return rows


def e3(tmp: Path) -> list[Row]:
    # Megatron-LM 1.7B GPT (arXiv 2104.04473 Table 1: h 2304, 24 layers, 24 heads) with
    # Megatron's fused kernels (the megatron_gpt family); 32 GPUs = 4 DGX A100 nodes;
    # global batch 512 = 16 sequences per GPU per step; the micro-batch is not
    # published: 2, 4, 8 or 16 with accumulation.
    cfg = write_config(tmp, "megatron-1.7b", {"model_type": "megatron_gpt", "n_embd": 2304, "n_layer": 24, "n_head": 24,
                                              "n_inner": 4 * 2304, "vocab_size": 51200, "n_positions": 2048})
    values = []
    micros = (2, 4, 8, 16)
    for micro in micros:
        p = predict(Scenario(model=cfg, cluster="dgx-a100", nodes=4, stage=0, ds_config=ds(0, micro, gas=16 // micro,
                                                                                          optimizer="Adam"),
                             seq=2048, checkpointing=True, mode="symmetric"))
        if not p.metrics.oom:
            values.append(p.metrics.hardware_tflops_per_gpu)
    return [range_row("E3", "1.7B GPT TFLOPS/GPU with recompute",
                      f"dgx-a100 4x8 A100-80GB; Megatron-LM GPT with its fused kernels (h 2304, 24 layers, 24 heads, "
                      f"vocab 51200), ZeRO-0, "
                      f"seq 2048, 16 seq/GPU/step as micro-batch {'/'.join(map(str, micros))} x accumulation, fp16, "
                      "layer-wise checkpointing; Megatron's formula with recompute", "TFLOPS", 137.0, values, E2E)]


def e4(tmp: Path) -> list[Row]:
    # A 10B GPT (shape not published: roberta-10b's, h 5120, 32 layers, 40 heads, as a gpt2
    # config.json, seq 1024 of Megatron's GPT-2) on one DGX-2: 16 V100-32GB on NVSwitch at
    # 150 GB/s one way per GPU (NVIDIA DGX-2 datasheet). No preset: the p3dn node with 16
    # GPUs per node (p3dn's V100-32GB and its 150 GB/s NVLink per GPU; its ring efficiency
    # is the hybrid cube mesh's assumption, not NVSwitch's; the fabric is unused in one node).
    cfg = write_config(tmp, "gpt-10b", {"model_type": "gpt2", "n_embd": 5120, "n_layer": 32, "n_head": 40,
                                        "n_inner": 4 * 5120, "vocab_size": 50257, "n_positions": 1024})
    values, ooms = [], 0
    micros = (4, 8, 16)
    for preset in ("baseline", "optimized"):
        for micro in micros:
            p = predict(Scenario(model=cfg, cluster="p3dn", nodes=1, gpus_per_node=16, stage=3, preset=preset,
                                 ds_config=ds(3, micro, optimizer="Adam"), seq=1024, checkpointing=True,
                                 mode="symmetric"))
            if p.metrics.oom:
                ooms += 1
            else:
                values.append(p.metrics.hardware_tflops_per_gpu)
    return [range_row("E4", "ZeRO-3 10B on a DGX-2, TFLOPS/GPU",
                      f"p3dn node with 16 GPUs (DGX-2 stand-in) V100-32GB; gpt2 config.json h 5120, 32 layers, "
                      f"40 heads (shape assumed), ZeRO-3 baseline and optimized, micro-batch "
                      f"{'/'.join(map(str, micros))} x seq 1024, fp16, layer-wise checkpointing, no offload; "
                      "Megatron's formula with recompute",
                      "TFLOPS", 63.0, values, E2E, note=f"{len(values)} of {len(values) + ooms} points fit in memory")]


def e5(tmp: Path) -> list[Row]:
    # IBM fms-fsdp (2024) on 128 A100-80GB = 16 nodes: Llama-2 shapes (34B: CodeLlama's,
    # 8 key-value heads; 70B: 8), seq 4096, bf16, SDPA flash attention (the catalogue's
    # Hugging Face Llama with attn_implementation "sdpa"; fms's own Llama module is
    # assumed to launch the same kernels). fms-fsdp wraps with FSDP1
    # (FullyShardedDataParallel, its ShardingStrategy names; A4's issue is of the same
    # repository): one unit per block and the root, torch's defaults otherwise (rate
    # limiter, BACKWARD_PRE); mixed precision bf16 for parameters and gradient
    # reduction (fms-fsdp's bf16 policy, assumed); hybrid sharding = HYBRID_SHARD,
    # sharded inside a node, replicated across the 16; checkpointing by torch's
    # non-reentrant checkpoint wrapper (fms-fsdp's, assumed). The network is not stated:
    # the range is over DGX A100's 8x200 Gb/s InfiniBand and p4de's 4x100 Gb/s EFA, on
    # the NCCL of 2023-2024 (stack "2023").
    shapes = {"7b": (4096, 32, 32, 32, 11008), "13b": (5120, 40, 40, 40, 13824), "34b": (8192, 48, 64, 8, 22016),
              "70b": (8192, 80, 64, 8, 28672)}
    runs = [("7b", True, 2, False, 3760.0), ("13b", True, 1, False, 1700.0), ("34b", False, 8, True, 772.0),
            ("70b", False, 6, True, 380.0)]
    seq, nodes = 4096, 16
    rows = []
    for name, hybrid, micro, ckpt, published in runs:
        h, layers, heads, kv, ffn = shapes[name]
        cfg = write_config(tmp, f"llama-{name}", {"model_type": "llama", "hidden_size": h, "num_hidden_layers": layers,
                                                  "num_attention_heads": heads, "num_key_value_heads": kv,
                                                  "intermediate_size": ffn, "vocab_size": 32000,
                                                  "max_position_embeddings": seq, "attn_implementation": "sdpa"})
        fsdp = {"mp_param_dtype": "bf16", "mp_reduce_dtype": "bf16",
                "sharding_strategy": "HYBRID_SHARD" if hybrid else "FULL_SHARD"}
        values = []
        for net in ("ib", "efa"):
            p = predict(Scenario(model=cfg, strategy="fsdp1", fsdp_config=fsdp, cluster="dgx-a100", nodes=nodes,
                                 net=net, nccl_stack="2023", micro_batch=micro, seq=seq, checkpointing=ckpt,
                                 checkpoint_style="non_reentrant", mode="symmetric"))
            if not p.metrics.oom:
                values.append(micro * seq / p.metrics.step_time_s)
        sharding = "hybrid (HSDP 16 x 8)" if hybrid else "full"
        rows.append(range_row("E5", f"Llama-2 {name} tokens/GPU/s, {sharding} sharding",
                              f"16x dgx-a100 A100-80GB, IB 8x200 or EFA 4x100 (not stated), NCCL 2.18; Llama "
                              f"{name} (h {h}, {layers} layers, {heads} heads, {kv} kv heads), SDPA, FSDP1 {sharding}, "
                              f"bf16, micro-batch {micro} x seq {seq}, "
                              f"{'layer-wise non-reentrant checkpointing' if ckpt else 'no checkpointing'}",
                              "tok/s", published, values, E2E, note="range over the two networks"))
    return rows
