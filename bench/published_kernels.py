"""bench/validate_published.py's kernel items: G (GEMMs by shape, one GPT layer's kernels,
SwiGLU's shape sensitivity), M (memory-bound kernels: STREAM, LayerNorm, unfused
attention) and X (a kernel beside a collective, which share the SMs and HBM; NCCL's SM
count).

Each is one Compute or Copy op (or a few, in order) through the simulator on one GPU, or
beside an all_gather on another stream; TFLOPS = flops / time, GB/s = bytes read and
written / time; shapes from the catalogue where it describes the layer. Not a script:
validate_published runs the items."""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is imported

from commsim.hardware.costs import SpecCostModel  # noqa: E402
from commsim.hardware.specs import ClusterSpec, cluster_preset  # noqa: E402
from commsim.ir import ops as O  # noqa: E402
from commsim.models import describe, resolve_model  # noqa: E402
from commsim.models.eager import Eager, chain  # noqa: E402

from published_collectives import collective_op  # noqa: E402
from published_rows import (AG, AR, KC, GiB, Row, chain_time_ns, duration_ns, first, gemm_op,  # noqa: E402
                            kernel_op, kernel_time_ns, one_gpu, run_ops, shape_name, write_config)


# ---------------------------------------------------------------- kernels


def gemm_row(item: str, what: str, preset: str, g: O.GemmShape, published: float, precision: str = "bf16",
             note: str = "") -> Row:
    cl = one_gpu(preset)
    t = duration_ns(run_ops(cl, [gemm_op(g)], precision)[1])
    return Row(item, what, f"{preset} GPU {cl.node.gpu.name}; GEMM m x n x k = {shape_name(g)} {precision}",
               "TFLOPS", published, g.flops / t / 1e3, KC, note=note)


def g1() -> list[Row]:
    g = O.GemmShape(1024, 10240, 5120)
    note = "mamf-finder's shape reads M x N x K"
    return [gemm_row("G1", "A100 SXM max bf16 matmul", "p4d", g, 271.2, note=note),
            gemm_row("G1", "A100 SXM max bf16 matmul, older revision", "p4d", g, 267.9, note=note),
            gemm_row("G1", "H100 SXM max bf16 matmul", "dgx-h100", g, 794.5,
                     note="H100's best shape not published: the A100's shape"),
            gemm_row("G1", "H100 SXM max bf16 matmul, older revision", "dgx-h100", g, 792.1,
                     note="H100's best shape not published: the A100's shape")]


def g2() -> list[Row]:
    data = [((1024, 1024, 1024), 119.4), ((2048, 2048, 2048), 221.8), ((4096, 4096, 4096), 228.0),
            ((8192, 8192, 8192), 253.7), ((16384, 16384, 16384), 256.5), ((6144, 12288, 12288), 250.8),
            ((1024, 2145, 1024), 132.8)]
    # cuBLAS is column-major: its m x n x k is PyTorch's (row-major) n x m x k
    return [gemm_row("G2", f"cuBLASLt fp16 {m}x{n}x{k}", "azure-ndm-a100", O.GemmShape(n, m, k), tf, "fp16",
                     note="m x n x k of cuBLAS's column-major call (order assumed)" if n != m else "")
            for (m, n, k), tf in data]


def g3(tmp: Path) -> list[Row]:
    # One GPT layer, h 4096, 16 heads, micro-batch 4, seq 2048, vocab 51200, fp16, as
    # Megatron-LM's layer runs it with the fused softmax off (the megatron_gpt family,
    # "masked_softmax_fusion": false): the cookbook's sizing benchmarks time Megatron's
    # layers (assumed: its code is not on this machine), and its "unfused softmax", 7.6 ms
    # over 4 x 16 x 2048^2 elements, moves about 36 bytes an element: Megatron's PyTorch
    # path (to fp32, scale, masked_fill, softmax, back to fp16), where one fp16 softmax
    # pass moves 4 (about 0.8 ms).
    h, nh, b, s, V = 4096, 16, 4, 2048, 51200
    T = b * s
    cfg = write_config(tmp, "g3-layer", {"model_type": "megatron_gpt", "n_embd": h, "n_layer": 2, "n_head": nh,
                                         "n_inner": 4 * h, "vocab_size": V, "n_positions": s,
                                         "masked_softmax_fusion": False})
    md = describe(resolve_model(cfg), b, s, 2)
    L = "language_model.encoder.layers.1"
    mod = {m.path.removeprefix(L + "."): m for m in md.modules}
    preset = "p4d"
    gpu = f"{preset} GPU {one_gpu(preset).node.gpu.name} (GPU not named: the original A100 SKU assumed), fp16"
    rows = []
    G = O.ComputeKind.GEMM
    for path, what, tf in [("self_attention.query_key_value", "QKV GEMM", 241.6),
                           ("self_attention.dense", "attention out-projection", 234.9),
                           ("mlp.dense_h_to_4h", "h->4h GEMM", 241.1),
                           ("mlp.dense_4h_to_h", "4h->h GEMM", 252.8),
                           ("output_layer", "logits GEMM (vocab 51200)", 255.4)]:
        k = first(mod[path].fwd, G, "fwd")
        t = kernel_time_ns(preset, kernel_op(k), "fp16")
        rows.append(Row("G3", what, f"{gpu}; Megatron {path} fwd GEMM {shape_name(k.gemm)}", "TFLOPS", tf,
                        k.flops / t / 1e3, KC))
    # the attention's kernels, each on its own
    scores, ctx = mod["self_attention.scale_mask_softmax"].fwd, mod["self_attention.dense"].fwd
    for k, what, tf in [(first(scores, G, "qk"), "attention-score bmm", 130.2),
                        (first(ctx, G, "av"), "attention-over-value bmm", 219.0)]:
        t = kernel_time_ns(preset, kernel_op(k), "fp16")
        rows.append(Row("G3", what, f"{gpu}; Megatron {k.name} bmm {shape_name(k.gemm)}", "TFLOPS", tf,
                        k.flops / t / 1e3, KC))
    chain_kernels = [k for k in scores if k.kind is not G]
    t = chain_time_ns(one_gpu(preset), chain_kernels, "fp16")
    gb = sum(k.bytes_read + k.bytes_written for k in chain_kernels) / 1e9
    rows.append(Row("G3", "unfused softmax time", f"{gpu}; Megatron's unfused FusedScaleMaskSoftmax over "
                    f"{b}x{nh}x{s}x{s}: {len(chain_kernels)} kernels ({', '.join(k.name for k in chain_kernels)}; "
                    f"{gb:.2f} GB)", "ms", 7.6, t / 1e6, KC))
    k = first(mod["self_attention.attention_dropout"].fwd, O.ComputeKind.DROPOUT)
    t = kernel_time_ns(preset, kernel_op(k), "fp16")
    rows.append(Row("G3", "its dropout time", f"{gpu}; {k.name} kernel over {b}x{nh}x{s}x{s} "
                    f"({(k.bytes_read + k.bytes_written) / 1e9:.2f} GB)", "ms", 1.2, t / 1e6, KC))
    ln = first(mod["input_layernorm"].fwd, O.ComputeKind.NORM)
    t = kernel_time_ns(preset, kernel_op(ln), "fp16")
    rows.append(Row("G3", "layer norm time", f"{gpu}; input_layernorm fwd ({ln.bytes_read + ln.bytes_written} B)",
                    "ms", 0.1, t / 1e6, KC))
    # The whole layer: block 1's forward kernels one after the other on the compute
    # stream; flops counted as matmuls only (24 T h^2 + 4 T s h). The item's own kernels
    # (its GEMM rates, softmax, dropout and norms) add up to about 25 ms, 143 TFLOPS: its
    # 92 TFLOPS (38.8 ms) must count or run the layer otherwise.
    kernels = [k for m in md.modules if m.block == 1 for k in m.fwd]
    t = chain_time_ns(one_gpu(preset), kernels, "fp16")
    flops = 24 * T * h * h + 4 * T * s * h
    rows.append(Row("G3", "whole layer (unfused attention)", f"{gpu}; Megatron layer forward, {len(kernels)} "
                    "kernels in order, the softmax unfused", "TFLOPS", 92.0, flops / t / 1e3, KC,
                    note="taken as the layer's forward; matmul flops only; the item's own kernel figures add up to "
                    "about 143 TFLOPS"))
    return rows


def g4() -> list[Row]:
    note = "V100-SXM2-16GB measured; the p3dn V100-32GB has the same peak and HBM bandwidth"
    rows = [gemm_row("G4", f"V100 cuBLAS fp16 {n}^3", "p3dn", O.GemmShape(n, n, n), tf, "fp16", note=note)
            for n, tf in ((1024, 57.3), (4096, 95.7), (8192, 97.4))]
    rows.append(gemm_row("G4", "V100 bf16 (emulated) matmul", "p3dn", O.GemmShape(4096, 4096, 4096), 10.0, "bf16",
                         note="'about 10 TFLOPS', shape not stated: 4096^3"))
    return rows


def g5(tmp: Path) -> list[Row]:
    # SwiGLU MLP h 4096 (gate, act, up, down), the catalogue's llama block; tokens not
    # published: 8192 (micro-batch 2 x seq 4096). Forward kernels in order.
    rows = []
    for d_ff, tf in ((10922, 272.7), (10944, 398.4)):
        cfg = write_config(tmp, f"g5-{d_ff}", {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 1,
                                               "num_attention_heads": 32, "intermediate_size": d_ff,
                                               "vocab_size": 32000, "max_position_embeddings": 4096})
        md = describe(resolve_model(cfg), 2, 4096, 2)
        kernels = [k for m in md.modules if m.path.startswith("model.layers.0.mlp") for k in m.fwd]
        t = chain_time_ns(one_gpu("dgx-h100"), kernels, "bf16")
        flops = 3 * 2 * 8192 * 4096 * d_ff
        setup = ("dgx-h100 GPU; catalogue llama MLP forward (gate, act, up, product, down, the layer's residual "
                 "add), 8192 tokens (not published), bf16")
        rows.append(Row("G5", f"H100 SwiGLU MLP d_ff {d_ff}", setup, "TFLOPS", tf, flops / t / 1e3, KC,
                        note="matmul flops only; forward assumed"))
    return rows


def m1() -> list[Row]:
    # BabelStream's default arrays: 2^25 doubles each (array size not published).
    n = 2**25
    size = 8 * n
    rows = []
    for preset, gpu, data in (("azure-ndm-a100", "A100-80GB", (("copy", 1610), ("triad", 1700), ("dot", 1750))),
                              ("dgx-h100", "H100", (("copy", 2900), ("triad", 2970)))):
        for kernel, gbs in data:
            if kernel == "copy":
                op, moved = O.Copy(O.OpId(1), "compute", "copy", O.CopyDirection.D2D, size), 2 * size
            elif kernel == "triad":  # a = b + s * c
                op = O.Compute(O.OpId(1), "compute", "triad", O.ComputeKind.ELEMENTWISE, 2 * n, 2 * size, size)
                moved = 3 * size
            else:  # sum += a * b
                op = O.Compute(O.OpId(1), "compute", "dot", O.ComputeKind.REDUCTION, 2 * n, 2 * size, 8)
                moved = 2 * size
            t = kernel_time_ns(preset, op)
            kind = "Copy D2D" if isinstance(op, O.Copy) else f"{op.kind.value} Compute"
            rows.append(Row("M1", f"{gpu} STREAM {kernel}", f"{preset} GPU; {kind} over 2^25 fp64 "
                            f"({moved / 1e6:.0f} MB moved)", "GB/s", gbs, moved / t, KC,
                            note="array size not published: BabelStream's default"))
    return rows


def m2(tmp: Path) -> list[Row]:
    # apex issue 1037: B 32, S 512; hidden not stated: BERT-Large's 1024. The catalogue's
    # LayerNorm kernels (fwd reads and writes T x h; bwd reads 2 T x h, writes T x h), fp16.
    cfg = write_config(tmp, "m2-bert", {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 1,
                                        "num_attention_heads": 16, "intermediate_size": 4096, "vocab_size": 30522})
    md = describe(resolve_model(cfg), 32, 512, 2)
    ln = next(m for m in md.modules if m.path.endswith("attention.output.LayerNorm"))
    preset = "p4d"
    rows = []
    for k, pass_name, pubs in ((first(ln.fwd, O.ComputeKind.NORM), "forward", (("old apex", 896), ("tuned", 1258))),
                               (first(ln.bwd, O.ComputeKind.NORM), "backward", (("old apex", 572), ("tuned", 1163)))):
        t = kernel_time_ns(preset, kernel_op(k), "fp16")
        for which, gbs in pubs:
            rows.append(Row("M2", f"LayerNorm {pass_name}, {which} kernel", f"{preset} GPU A100-40GB (variant not "
                            f"named); catalogue LayerNorm {pass_name}, 32x512 tokens x 1024 (hidden assumed), fp16",
                            "GB/s", gbs, (k.bytes_read + k.bytes_written) / t, KC))
    # torch.nn.LayerNorm on 2048 x 2048 (dtype not stated: fp32, as autocast runs it),
    # the catalogue's forward kernel built with 4-byte elements
    t_el, dt = 2048 * 2048, 4
    k = first(Eager(dt).layer_norm("layernorm", 2048, 2048).fwd, O.ComputeKind.NORM)
    t = kernel_time_ns(preset, kernel_op(k), "fp32")
    rows.append(Row("M2", "torch.nn.LayerNorm 2048x2048", f"{preset} GPU A100-40GB (variant not named); LayerNorm "
                    "forward as the catalogue's, fp32 (dtype assumed)", "GB/s", 715.0, 2 * t_el * dt / t, KC))
    return rows


def m3(tmp: Path) -> list[Row]:
    # FlashAttention's benchmark (benchmarks/benchmark_flash_attention.py,
    # attention_pytorch): model dim 2048, batch 2 x seq 8192, non-causal, dropout 0,
    # forward flops 4 b s^2 h. Its kernels: q and k rearranged out of qkv (copies), the
    # scores by baddbmm (scale folded in), softmax, v rearranged (a copy), the einsum's bmm.
    rows = []
    for preset, gpu, hd, tf in (("azure-ndm-a100", "A100-80GB", 64, 46.0), ("dgx-h100", "H100", 128, 145.1)):
        nh, b, s = 2048 // hd, 2, 8192
        e = Eager(2)
        heads = (b, nh, s, hd)
        op = chain(e.copy("q", heads), e.copy("k", (b, nh, hd, s)), e.bmm("qk", b * nh, s, s, hd),
                   e.softmax("softmax", (b, nh, s, s)), e.copy("v", heads), e.bmm("av", b * nh, s, hd, s))
        t = chain_time_ns(one_gpu(preset), op.fwd, "fp16")
        flops = 4 * b * s * s * 2048
        rows.append(Row("M3", f"{gpu} unfused attention, head dim {hd}", f"{preset} GPU; eager attention kernels "
                        f"(3 copies, QK^T, softmax, AV), {nh} heads x {hd}, batch {b}, seq {s}, fp16", "TFLOPS", tf,
                        flops / t / 1e3, KC,
                        note="sets the softmax class's bandwidth (specs.SOFTMAX_BW_EFFICIENCY): a check of the mean"))
    return rows


# ---------------------------------------------------------------- interference


def beside(cluster: ClusterSpec, kernels: list[O.Compute], gather_bytes: int, lead: bool,
           precision: str = "bf16") -> tuple[float, bool]:
    """(time of ``kernels`` in order on the compute stream beside an all_gather of
    ``gather_bytes`` over the node / their time alone, whether the gather outlasted them).
    ``lead``: a 1-byte kernel runs first, so the gather is already in flight when the
    measured kernels start; else the gather and the first kernel start at the same time."""
    group = tuple(range(cluster.world_size))
    first = 2 if lead else 1
    ops: list[O.Op] = [collective_op(AG, gather_bytes, group, op_id=1, stream="allgather", dtype=O.DType.BF16)]
    if lead:
        ops.append(O.Compute(O.OpId(2), "compute", "lead", O.ComputeKind.ELEMENTWISE, 1, 1, 0))
    ops += [replace(k, id=O.OpId(first + 1 + i)) for i, k in enumerate(kernels)]
    ids = [first + 1 + i for i in range(len(kernels))]
    alone = run_ops(cluster, [replace(k, id=O.OpId(1 + i)) for i, k in enumerate(kernels)], precision)
    t_alone = sum(duration_ns(r) for r in alone.values())
    recs = run_ops(cluster, ops, precision)
    t_beside = sum(duration_ns(recs[i]) for i in ids)
    covered = recs[1].end_ns >= max(recs[i].end_ns for i in ids)
    return t_beside / t_alone, covered


def x1(tmp: Path) -> list[Row]:
    # A100-80GB node; the all_gather over its 8 GPUs (1 GiB, outlasting each kernel).
    # Shapes not published: a GPT-sized GEMM (275 GFLOP), the catalogue's eager attention
    # core of a GPT layer (h 1024, 16 heads, one sequence of 2048), an elementwise op of 32 MB.
    cl = cluster_preset("dgx-a100", 1)
    gemm = gemm_op(O.GemmShape(4096, 4096, 8192))
    cfg = write_config(tmp, "x1-gpt", {"model_type": "gpt2", "n_embd": 1024, "n_layer": 1, "n_head": 16,
                                       "vocab_size": 1000, "n_positions": 2048})
    md = describe(resolve_model(cfg), 1, 2048, 2)
    # the attention chain (QK^T to the probabilities' dropout) as one kernel's worth of work
    chain_ks = next(m for m in md.modules if m.path.endswith("attn.attn_dropout")).fwd
    att = O.Compute(O.OpId(1), "compute", "attention", O.ComputeKind.ATTENTION, sum(k.flops for k in chain_ks),
                    sum(k.bytes_read for k in chain_ks), sum(k.bytes_written for k in chain_ks),
                    first(chain_ks, O.ComputeKind.GEMM, "qk").gemm)
    elt = O.Compute(O.OpId(1), "compute", "elementwise", O.ComputeKind.ELEMENTWISE, 8 * 2**20, 16 * 2**20, 16 * 2**20)
    rows = []
    for k, what, pub in ((gemm, "GEMM 1.18 -> 2.08 ms", 2.08 / 1.18), (att, "attention 0.18 -> 0.33 ms", 0.33 / 0.18),
                         (elt, "elementwise 0.02 -> 0.05 ms", 0.05 / 0.02)):
        r, covered = beside(cl, [k], GiB, lead=False)
        r_lead, _ = beside(cl, [k], GiB, lead=True)
        rows.append(Row("X1", what, f"dgx-a100 1x8 A100-80GB; {k.label} ({shape_name(k.gemm) if k.gemm else '32 MB'}) "
                        f"and an all_gather of 1 GiB over 8 GPUs starting together", "ratio", pub, r, KC,
                        note=f"all_gather outlasts it: {covered}; with the gather already in flight: {r_lead:.3f}"))
    return rows


def layer_gemms(h: int, tokens: int) -> list[O.Compute]:
    """The four forward GEMMs of a GPT layer (QKV, out-projection, h->4h, 4h->h)."""
    shapes = [O.GemmShape(tokens, 3 * h, h), O.GemmShape(tokens, h, h), O.GemmShape(tokens, 4 * h, h),
              O.GemmShape(tokens, h, 4 * h)]
    return [gemm_op(g, i + 1) for i, g in enumerate(shapes)]


def x2() -> list[Row]:
    # H100: a GEMM of exactly one wave of 128x128 tiles (12 x 11 = 132 = the SMs); k not
    # published: 16384. The all_gather over one node's 8 GPUs, already in flight.
    cl = cluster_preset("dgx-h100", 1)
    g = O.GemmShape(12 * 128, 11 * 128, 16384)
    k = gemm_op(g)
    r, covered = beside(cl, [k], 4 * GiB, lead=True)
    t_alone = kernel_time_ns("dgx-h100", k)
    mfu_alone = g.flops / t_alone / cl.node.gpu.peak_tensor_flops_per_s * 1e9
    ag = O.Collective(O.OpId(1), "comm", "ag", O.CollectiveKind.ALL_GATHER, 4 * GiB, O.DType.BF16, tuple(range(8)))
    sms = SpecCostModel(cl).collective(ag).sms
    setup = (f"dgx-h100 1x8 H100; GEMM {shape_name(g)} bf16 (one wave) beside a 4 GiB all_gather in flight "
             f"(commsim: {sms} channels)")
    note = f"all_gather outlasts it: {covered}"
    return [Row("X2", "one-wave GEMM time beside all_gather (~2x)", setup, "ratio", 2.0, r, KC, note=note),
            Row("X2", "its MFU alone (80%)", setup, "MFU", 0.80, mfu_alone, KC),
            Row("X2", "its MFU beside the all_gather (47%)", setup, "MFU", 0.47, mfu_alone / r, KC, note=note)]


def x3() -> list[Row]:
    # The four GEMMs of a GPT layer (h 4096, 8192 tokens) on one 4-GPU node, beside an
    # all_gather of the next layer's parameters starting with them (as a prefetch does)
    # and sized to outlast them (8 GiB). A100 and H100 (the paper's MI250 / MI210: no preset).
    ratios = {}
    for preset in ("dgx-a100", "dgx-h100"):
        cl = cluster_preset(preset, 1, gpus_per_node=4)
        ratios[preset], covered = beside(cl, layer_gemms(4096, 8192), 8 * GiB, lead=False)
        assert covered, preset
    setup = ("dgx-a100 / dgx-h100 1x4; 4 GEMMs of a GPT layer (h 4096, 8192 tokens) beside an 8 GiB all_gather "
             "starting with them")
    detail = ", ".join(f"{p} {r:.3f}" for p, r in ratios.items())
    return [Row("X3", "overlapped compute slower, average 18.9%", setup, "ratio", 1.189,
                statistics.mean(ratios.values()), KC, note=f"mean of {detail}"),
            Row("X3", "overlapped compute slower, worst 40%", setup, "ratio", 1.40, max(ratios.values()), KC,
                note=f"max of {detail}")]


def x5() -> list[Row]:
    # the channels (one CTA, one SM each) of a 1 GiB all_reduce between two nodes, one GPU
    # on each: over one NIC (p3dn) and over eight (dgx-a100)
    rows = []
    for preset, nics, pub in (("p3dn", "one PCIe NIC", 2), ("dgx-a100", "8 NICs at 190 GB/s", 16)):
        cl = cluster_preset(preset, 2)
        gpn = cl.node.gpus_per_node
        ar = O.Collective(O.OpId(1), "comm", "ar", O.CollectiveKind.ALL_REDUCE, GiB, O.DType.BF16, (0, gpn),
                          reduce_op=O.ReduceOp.SUM)
        plan = SpecCostModel(cl).collective(ar)
        rows.append(Row("X5", f"SMs NCCL uses for {nics}", f"{preset} 2 nodes, one GPU each; 1 GiB all_reduce "
                        f"({plan.algorithm}): the channels of its plan", "SMs", pub, plan.sms, KC))
    return rows


def x6() -> list[Row]:
    # 8x V100 (p3dn node): sizes not in the issue. A Megatron-style pair: the 4h->h GEMM
    # of 8192 tokens at h 3072 and an all_reduce of its fp16 output (48 MiB), overlapped
    # (two streams, starting together) vs one after the other (one stream).
    cl = cluster_preset("p3dn", 1)
    group = tuple(range(8))
    g = O.GemmShape(8192, 3072, 4 * 3072)
    size = 8192 * 3072 * 2
    over = run_ops(cl, [collective_op(AR, size, group, 1, "comm", O.DType.FP16), gemm_op(g, 2)], "fp16")
    seq = run_ops(cl, [gemm_op(g, 1), collective_op(AR, size, group, 2, "compute", O.DType.FP16)], "fp16")
    t_over = max(r.end_ns for r in over.values()) - min(r.start_ns for r in over.values())
    t_seq = max(r.end_ns for r in seq.values()) - min(r.start_ns for r in seq.values())
    return [Row("X6", "overlapped/sequential GEMM+all_reduce (207/157)",
                f"p3dn 1x8 V100; GEMM {shape_name(g)} fp16 + all_reduce 48 MiB fp16 (sizes assumed)", "ratio",
                207 / 157, t_over / t_seq, KC,
                note=f"overlapped {t_over / 1e6:.2f} ms, sequential {t_seq / 1e6:.2f} ms")]
