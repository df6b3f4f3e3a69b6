"""bench/gpu_kernel_items.py, the kernel items to measure on the day a GPU is lent: without
one it refuses in one line; on tiny shapes it runs on the CPU; its predictions are the
ones validate_published checks."""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_kernel_items.py"
sys.path.insert(0, str(ROOT / "bench"))

import gpu_kernel_items as gki  # noqa: E402
import published_kernels  # noqa: E402
from published_rows import one_gpu  # noqa: E402

LINE = re.compile(r"^(G5 swiglu|layer_norm|softmax|dropout): (.+): measured (\d+\.\d) (TFLOPS|GB/s) "
                  r"\(predicted (\d+\.\d), ([+-]\d+\.\d)%\)$")


def test_without_a_gpu_it_refuses_in_one_line():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"gpu_kernel_items: no CUDA GPU visible (torch {__import__('torch').__version__}, "
        "torch.cuda.is_available() is False); run it where one is"]


def test_the_cpu_rehearsal_measures_and_predicts_every_item(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--json", str(tmp_path / "items.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("gpu: H100 (CPU rehearsal), predicted as dgx-h100's H100-SXM5-80GB; torch ")
    rows = [LINE.match(ln) for ln in lines[1:]]
    assert all(rows), lines
    assert [(m[1], m[2]) for m in rows] == (
        [("G5 swiglu", f"d_ff {d}, {t} tokens, {w}") for d in (170, 176) for t in (32, 64) for w in ("fwd", "fwd+bwd")]
        + [("layer_norm", f"{s} {w}") for s in ("64 x 64 fp32", "64 x 128 fp16") for w in ("fwd", "bwd")]
        + [(k, f"1x2x32x32 fp16 {w}") for k in ("softmax", "dropout") for w in ("fwd", "bwd")])
    objs = [json.loads(x) for x in (tmp_path / "items.json").read_text().splitlines()]
    assert len(objs) == len(rows) == 16 and not list(tmp_path.glob("*.tmp"))
    for o in objs:
        assert o["measured"] > 0 and o["predicted"] > 0
        assert o["error_pct"] == round(100 * (o["predicted"] - o["measured"]) / o["measured"], 2)


def test_its_swiglu_prediction_is_validate_publisheds_g5():
    # G5's rows assume 8192 tokens forward: the script's prediction at that point is theirs
    with tempfile.TemporaryDirectory() as tmp:
        rows = {r.what: r.predicted for r in published_kernels.g5(Path(tmp))}
        cluster = one_gpu("dgx-h100")
        for d_ff in (10922, 10944):
            kernels = gki.swiglu_kernels(Path(tmp), 4096, d_ff, 8192)
            flops = 3 * 2 * 8192 * 4096 * d_ff
            tflops = flops / gki.predicted_s(cluster, kernels["fwd"], "bf16") / 1e12
            assert tflops == pytest.approx(rows[f"H100 SwiGLU MLP d_ff {d_ff}"], rel=1e-12)
            # forward + backward: the three matmuls' weight and input gradients, the
            # product's two, SiLU's and the sum of the input's two gradients
            assert len(kernels["fwd+bwd"]) == len(kernels["fwd"]) + 10
