"""`commsim record` on a real PyTorch FSDP2 run (2 CPU ranks, gloo): every collective
seen, with FSDP's exact pattern: per step, each unit's parameters all-gathered in
forward (and the resharded layers again in backward), each unit's gradients
reduce-scattered once, all as padded flat buffers."""

import json
import subprocess
import sys
from math import ceil, prod
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def padded_bytes(params, world=2):
    # FSDP2 shards every parameter on dim 0, padded to a multiple of the world size
    return sum(ceil(p.shape[0] / world) * world * prod(p.shape[1:]) * 4 for p in params)


def test_record_sees_fsdp2_collectives_exactly(tmp_path):
    import torch  # requirements-test.txt installs it: without it this fails, it does not skip
    from commsim.models import resolve_model
    from runtime.torch_models import build_model

    model = build_model(resolve_model("tiny"))
    layers = list(model.roberta.encoder.layer)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_layers]  # parameters() dedups the tied weight
    layer_bytes = [padded_bytes(list(layer.parameters())) for layer in layers]
    root_bytes = padded_bytes(root)
    del torch

    rec = tmp_path / "rec"
    out = subprocess.run([sys.executable, "-m", "commsim.cli", "record", "-o", str(rec), "--", sys.executable, "-m",
                          "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                          "runtime.examples.fsdp_train", "--model", "tiny", "--steps", "3"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # each rank's times start at its own t0, kept in the meta: with it, the same
    # collective ends at the same moment on both ranks (one node, one clock)
    ends = []
    for rank in (0, 1):
        d = json.loads((rec / f"rank{rank}.json").read_text())
        col = {c: i for i, c in enumerate(d["columns"])}
        t0 = d["meta"]["extra"]["t0_monotonic_ns"]
        ends.append([t0 + r[col["end_ns"]] for r in d["rows"]])
    gaps = sorted(abs(a - b) for a, b in zip(*ends))
    assert len(ends[0]) == len(ends[1]) and gaps[len(gaps) // 2] < 50_000_000, gaps[len(gaps) // 2]
    for rank in (0, 1):
        d = json.loads((rec / f"rank{rank}.json").read_text())
        col = {c: i for i, c in enumerate(d["columns"])}
        rows = [r for r in d["rows"] if r[col["kind"]] != "barrier"]
        for step in (1, 2):  # after the first step, the steady state
            seq = [(r[col["kind"]], r[col["size_bytes"]], r[col["label"]].split(":")[0])
                   for r in rows if r[col["step"]] == step]
            # forward: root unit, then each layer; backward: the layers again (resharded
            # after forward), last first; then gradients, last unit first, root last
            assert seq == [("all_gather", root_bytes, "fwd")] + \
                [("all_gather", b, "fwd") for b in layer_bytes] + \
                [("all_gather", b, "bwd") for b in reversed(layer_bytes)] + \
                [("reduce_scatter", b, "bwd") for b in reversed(layer_bytes)] + \
                [("reduce_scatter", root_bytes, "bwd")], seq
