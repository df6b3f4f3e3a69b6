"""The kernel items of published-runs.md whose setups leave something open, measured on
the GPU at hand beside commsim's prediction for that GPU, in one command:

    python bench/gpu_kernel_items.py [--json FILE]

validate_published has to assume what the items do not say: G5's token count and whether
its SwiGLU MLP was timed forward only (it assumes 8192 tokens, forward: 660 TFLOPS
predicted on an H100 against 398 published); which LayerNorm M2's 715 GB/s and G3's
0.1 ms ran and in which dtype (commsim's LayerNorm class rate comes from M2's torch
figure, and G3's layer norm then comes out 92% slow); the class rates of a one-pass
softmax and of dropout at G3's 4 x 16 x 2048^2 scores. On a lent GPU this script times
each of those as PyTorch runs them, at the sizes the items could mean, and prints the
measured figure beside commsim's prediction of the same kernels (the catalogue's own
kernel list: ``commsim.models``, priced by the spec cost model of the GPU's preset):

* ``G5 swiglu``: a Llama MLP with its residual add (gate, up and down projections without
  bias, SiLU, the product), h 4096, d_ff 10922 and 10944, bf16, forward and forward +
  backward, at 2048 / 8192 / 16384 tokens; TFLOPS by G5's count (the three matmuls'
  flops, three times that for forward + backward);
* ``layer_norm``: ``torch.nn.functional.layer_norm`` forward and backward at M2's shapes
  (2048 x 2048 fp32; 32 x 512 tokens x 1024 fp16) and G3's (4 x 2048 tokens x 4096 fp16);
  GB/s as commsim counts a LayerNorm's bytes;
* ``softmax`` and ``dropout``: one pass each over G3's fp16 scores, and their backward.

Each line reads ``name: what: measured X (predicted Y, error%)``, the error being the
prediction's against the measurement. Its sizes need seconds of GPU time (it has not yet
run on a GPU). Without a CUDA GPU it refuses in one line (exit 2); ``--cpu`` rehearses the
same code on tiny shapes on this machine's CPU, priced as an H100 (figures mean nothing;
the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from commsim.models import describe, resolve_model  # noqa: E402
from commsim.models.eager import Eager  # noqa: E402

from gpu_check import no_gpu, preset_for  # noqa: E402
from published_rows import chain_time_ns, one_gpu, write_config  # noqa: E402

# (h, d_ffs, token counts, layer-norm shapes (rows, width, dtype), scores shape)
GPU_SIZES = (4096, (10922, 10944), (2048, 8192, 16384),
             ((2048, 2048, "fp32"), (32 * 512, 1024, "fp16"), (4 * 2048, 4096, "fp16")), (4, 16, 2048, 2048))
CPU_SIZES = (64, (170, 176), (32, 64), ((64, 64, "fp32"), (64, 128, "fp16")), (1, 2, 32, 32))
REPEATS, WARMUP = 10, 3
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


class Timer:
    """Mean seconds of a callable after warm-up: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, torch, device: str):
        self.torch, self.gpu = torch, device == "cuda"

    def __call__(self, fn) -> float:
        for _ in range(WARMUP):
            fn()
        if not self.gpu:
            t = time.perf_counter()
            for _ in range(REPEATS):
                fn()
            return (time.perf_counter() - t) / REPEATS
        cuda = self.torch.cuda
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        cuda.synchronize()
        start.record()
        for _ in range(REPEATS):
            fn()
        end.record()
        cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / REPEATS


def line(name: str, what: str, measured: float, predicted: float, unit: str) -> tuple[str, dict]:
    err = 100 * (predicted - measured) / measured
    text = f"{name}: {what}: measured {measured:.1f} {unit} (predicted {predicted:.1f}, {err:+.1f}%)"
    return text, {"item": name, "what": what, "unit": unit, "measured": measured, "predicted": predicted,
                  "error_pct": round(err, 2)}


def predicted_s(cluster, kernels, precision: str) -> float:
    return chain_time_ns(cluster, list(kernels), precision) / 1e9


def swiglu_kernels(tmp: Path, h: int, d_ff: int, tokens: int) -> dict[str, list]:
    """The catalogue's kernels of a Llama MLP (with the layer's residual add) over
    ``tokens`` tokens: "fwd", and "fwd+bwd" (the backward in the order autograd runs it)."""
    cfg = write_config(tmp, f"g5-{d_ff}-{tokens}", {"model_type": "llama", "hidden_size": h, "num_hidden_layers": 1,
                                                    "num_attention_heads": 32 if h % 32 == 0 else 1,
                                                    "intermediate_size": d_ff, "vocab_size": 32000,
                                                    "max_position_embeddings": tokens})
    mods = [m for m in describe(resolve_model(cfg), 1, tokens, 2).modules if m.path.startswith("model.layers.0.mlp")]
    fwd = [k for m in mods for k in m.fwd]
    return {"fwd": fwd, "fwd+bwd": fwd + [k for m in reversed(mods) for k in m.bwd]}


def swiglu(torch, dev: str, timer: Timer, cluster, h: int, d_ffs, token_counts, tmp: Path):
    """G5: the MLP as Hugging Face's Llama runs it, plus the layer's residual add."""
    F = torch.nn.functional
    for d_ff in d_ffs:
        gate, up, down = ((torch.randn(o, i, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
                          for o, i in ((d_ff, h), (d_ff, h), (h, d_ff)))
        for tokens in token_counts:
            x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
            g = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)

            def fwd():
                return x + F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

            def fwd_bwd():  # gradients returned, not accumulated into .grad (no extra adds)
                torch.autograd.grad(fwd(), (x, gate, up, down), g)

            kernels = swiglu_kernels(tmp, h, d_ff, tokens)
            flops = 3 * 2 * tokens * h * d_ff  # G5's count: the three matmuls
            for which, fn, mult in (("fwd", fwd, 1), ("fwd+bwd", fwd_bwd, 3)):
                m_s, p_s = timer(fn), predicted_s(cluster, kernels[which], "bf16")
                yield line("G5 swiglu", f"d_ff {d_ff}, {tokens} tokens, {which}", mult * flops / m_s / 1e12,
                           mult * flops / p_s / 1e12, "TFLOPS")


def memory_bound(torch, dev: str, timer: Timer, cluster, ln_shapes, scores):
    """M2 / G3: LayerNorm, and one softmax and dropout pass over G3's scores, with their backward."""
    F = torch.nn.functional
    dtypes = {"fp32": torch.float32, "fp16": torch.float16}
    for rows, width, dt in ln_shapes:
        x = torch.randn(rows, width, device=dev, dtype=dtypes[dt], requires_grad=True)
        wt = torch.ones(width, device=dev, dtype=dtypes[dt], requires_grad=True)
        b = torch.zeros(width, device=dev, dtype=dtypes[dt], requires_grad=True)
        g = torch.randn(rows, width, device=dev, dtype=dtypes[dt])
        op = Eager(BYTES[dt]).layer_norm("ln", rows, width)
        fwd = (lambda: F.layer_norm(x, (width,), wt, b))
        y = fwd()
        bwd = (lambda: torch.autograd.grad(y, (x, wt, b), g, retain_graph=True))
        for which, fn, k in (("fwd", fwd, op.fwd[0]), ("bwd", bwd, op.bwd[0])):
            nbytes = k.bytes_read + k.bytes_written
            yield line("layer_norm", f"{rows} x {width} {dt} {which}", nbytes / timer(fn) / 1e9,
                       nbytes / predicted_s(cluster, [k], "fp16" if dt == "fp16" else "fp32") / 1e9, "GB/s")
    s = torch.randn(*scores, device=dev, dtype=torch.float16, requires_grad=True)
    g = torch.randn(*scores, device=dev, dtype=torch.float16)
    eager = Eager(2)
    shape = tuple(scores)
    for name, fn_of, op in (("softmax", lambda t: F.softmax(t, dim=-1), eager.softmax("softmax", shape)),
                            ("dropout", lambda t: F.dropout(t, 0.1, training=True), eager.dropout("dropout", shape, 0.1))):
        y = fn_of(s)
        for which, fn, k in (("fwd", lambda: fn_of(s), op.fwd[0]),
                             ("bwd", lambda: torch.autograd.grad(y, s, g, retain_graph=True), op.bwd[0])):
            nbytes = k.bytes_read + k.bytes_written
            yield line(name, f"{'x'.join(map(str, scores))} fp16 {which}", nbytes / timer(fn) / 1e9,
                       nbytes / predicted_s(cluster, [k], "fp16") / 1e9, "GB/s")


def run(cpu: bool) -> list[tuple[str, dict]]:
    import torch

    dev = "cpu" if cpu else "cuda"
    name = "H100 (CPU rehearsal)" if cpu else torch.cuda.get_device_name()
    found = ("dgx-h100", "dgx-h100") if cpu else preset_for(name)
    if found is None:
        raise SystemExit(f"gpu_kernel_items: {name}: no preset has this GPU (A100, H100, H200)")
    cluster = one_gpu(found[1])
    h, d_ffs, tokens, ln_shapes, scores = CPU_SIZES if cpu else GPU_SIZES
    timer = Timer(torch, dev)
    header = (f"gpu: {name}, predicted as {found[0]}'s {cluster.node.gpu.name}; torch {torch.__version__}", {})
    with tempfile.TemporaryDirectory(prefix="commsim-kernel-items-") as tmp:
        rows = [header] + list(swiglu(torch, dev, timer, cluster, h, d_ffs, tokens, Path(tmp)))
    rows += list(memory_bound(torch, dev, timer, cluster, ln_shapes, scores))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="also write every figure here, one object per line")
    ap.add_argument("--cpu", action="store_true",
                    help="rehearse on this machine's CPU with tiny shapes (for tests; figures mean nothing)")
    args = ap.parse_args(argv)
    if not args.cpu:
        problem = no_gpu()
        if problem:
            print(f"gpu_kernel_items: {problem}", file=sys.stderr)
            return 2
    rows = run(args.cpu)
    for text, _ in rows:
        print(text, flush=True)
    if args.json:
        out = Path(args.json)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text("".join(json.dumps(obj) + "\n" for _, obj in rows if obj))
        tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
