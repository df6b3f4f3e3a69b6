"""Real PyTorch FSDP2 on this machine's CPUs (gloo), recorded with `commsim record`: the
recording's steady-state steps must equal the schedule `commsim schedule --strategy fsdp2`
generates for the same model and settings, collective for collective (kind, order,
bytes, dtype, group), on every rank (commsim.report.collectives.strict_match)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# a 4-block tiny RoBERTa: explicit prefetch of 2 blocks needs more blocks than tiny's 2
TINY4 = {"model_type": "roberta", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
         "intermediate_size": 256, "vocab_size": 1000, "max_position_embeddings": 130, "type_vocab_size": 1,
         "_name_or_path": "tiny4"}
# name -> (FSDP2 settings, model, ranks, checkpointing flags)
CONFIGS = {
    # FSDP2's defaults: blocks resharded after forward and gathered again in backward
    "reshard": ({}, "tiny", 2, ()),
    "no-reshard": ({"reshard_after_forward": False}, "tiny", 2, ("--no-checkpointing",)),
    # bf16 all-gathers, fp32 reduce-scatters, non-reentrant checkpointing
    "mixed-precision": ({"mp_param_dtype": "bf16", "mp_reduce_dtype": "fp32"}, "tiny", 2,
                        ("--checkpoint-style", "non_reentrant")),
    # HSDP on 4 ranks: shard over (0,1) / (2,3), all-reduce over (0,2) / (1,3); the root
    # resharded too, fp16 (reduce-scatter and all-reduce sum, divided before)
    "hsdp-4-ranks": ({"hsdp_replicas": 2, "root_reshard_after_forward": True, "mp_param_dtype": "fp16"}, "tiny", 4,
                     ()),
    # reshard_after_forward=2 on 4 ranks: the backward all-gathers run over pairs
    "reshard-to-2-of-4": ({"reshard_after_forward": 2}, "tiny", 4, ()),
    # each block prefetches the next 2 in forward and the previous 2 in backward; with
    # reentrant checkpointing the recompute's forward prefetches gather blocks again
    "explicit-prefetch": ({"forward_prefetch": 2, "backward_prefetch": 2}, "tiny4", 2, ()),
    # 3 micro-steps, reduced only at the last (set_requires_gradient_sync(False) before)
    "accumulate-without-sync": ({"gradient_accumulation_steps": 3, "requires_gradient_sync": False,
                                 "mp_param_dtype": "bf16", "mp_reduce_dtype": "fp32"}, "tiny", 2,
                                ("--no-checkpointing",)),
}


def commsim(*args):
    return subprocess.run([sys.executable, "-m", "commsim.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_recorded_fsdp2_matches_generated_schedule(tmp_path, name):
    import torch.distributed.fsdp  # noqa: F401  (requirements-test.txt installs torch: without it this fails)

    settings, model, ranks, ckpt = CONFIGS[name]
    cfg = tmp_path / "fsdp.json"
    cfg.write_text(json.dumps(settings))
    if model == "tiny4":
        model = str(tmp_path / "config.json")
        Path(model).write_text(json.dumps(TINY4))
    sched = tmp_path / "sched.json"
    out = commsim("schedule", "--strategy", "fsdp2", "--fsdp-config", str(cfg), "--model", model, "--nodes", "1",
                  "--gpus-per-node", str(ranks), "--micro-batch", "2", "--seq", "16", *ckpt, "-o", str(sched))
    assert out.returncode == 0, out.stderr
    rec = tmp_path / "rec"
    out = commsim("record", "-o", str(rec), "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", str(ranks), "-m", "runtime.examples.fsdp_train", "--model", model,
                  "--micro-batch", "2", "--seq", "16", "--steps", "3", "--fsdp-config", str(cfg), *ckpt)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in range(ranks):
        res = commsim("compare", "--collectives", str(rec), str(sched), "--rank", str(rank), "--json")
        report = json.loads(res.stdout)
        # FSDP2's first step already communicates as the later ones: all three match
        assert report["match"] and report["repeats"] == 3, report


def test_the_executor_runs_an_fsdp2_schedule(tmp_path):
    # offloaded shards copied in, bf16 casts on the copy-in stream, gradients accumulated
    # unsharded over two micro-steps and copied to the host, the host waiting for them
    cfg = tmp_path / "fsdp.json"
    cfg.write_text(json.dumps({"offload": True, "mp_param_dtype": "bf16", "gradient_accumulation_steps": 2,
                               "requires_gradient_sync": False}))
    sched = tmp_path / "sched.json"
    out = commsim("schedule", "--strategy", "fsdp2", "--fsdp-config", str(cfg), "--model", "tiny", "--nodes", "1",
                  "--gpus-per-node", "2", "--micro-batch", "2", "--seq", "16", "-o", str(sched))
    assert out.returncode == 0, out.stderr
    out = commsim("execute", str(sched), "--nproc-per-node", "2", "--steps", "1", "--check-data", "-o",
                  str(tmp_path / "measured.json"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    trace = json.loads((tmp_path / "measured.json").read_text())
    col = {c: i for i, c in enumerate(trace["columns"])}
    coll = [(r[col["kind"]], r[col["dtype"]], r[col["group"]]) for r in trace["rows"]
            if r[col["kind"]] in ("all_gather", "reduce_scatter") and r[col["rank"]] == 0]
    assert coll == [("all_gather", "bf16", "0,1")] * 10 + [("reduce_scatter", "bf16", "0,1")] * 3
