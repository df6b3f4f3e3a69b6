"""Real PyTorch FSDP1 (``FullyShardedDataParallel``) on this machine's CPUs (gloo), recorded
with `commsim record`: every steady-state step must equal the schedule `commsim schedule
--strategy fsdp1` generates for the same model and settings, collective for collective
(kind, order, bytes, dtype, group), on every rank. On CPU tensors FSDP1 all-gathers
through the list API (_flat_param.py:1466-1474) where CUDA tensors take one
``all_gather_single``: the same bytes, recorded the same way."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# name -> (FSDP1 settings, ranks, checkpointing flags)
CONFIGS = {
    # FSDP1's defaults under Hugging Face's reentrant checkpointing, outside each unit:
    # every block gathered for its recompute, freed, gathered again; no backward prefetch
    "defaults-reentrant": ({}, 2, ()),
    # bf16 all-gathers, fp32 reduce-scatters; the next block prefetched in post-backward,
    # and in each pre-forward (forward_prefetch)
    "mixed-precision-prefetch-post": ({"mp_param_dtype": "bf16", "mp_reduce_dtype": "fp32",
                                       "backward_prefetch": "BACKWARD_POST", "forward_prefetch": True}, 2,
                                      ("--no-checkpointing",)),
    # sharded inside a "node" of 2 ranks, the reduced shards all-reduced across the 2 nodes;
    # non-reentrant checkpointing leaves the hooks (and the prefetch) as without it. With
    # forward_prefetch each pre-forward gathers the next block, and a block's reduction
    # then waits for the next block's backward (its views were made a pre-forward early)
    "hybrid-4-ranks-forward-prefetch": ({"sharding_strategy": "HYBRID_SHARD", "forward_prefetch": True}, 4,
                                        ("--checkpoint-style", "non_reentrant")),
    # SHARD_GRAD_OP keeps a block's parameters from its forward to its post-backward (no
    # backward all-gather); 3 micro-steps, the first two inside no_sync(), through which it
    # keeps them gathered: only the first micro-step gathers and only the last reduces
    "shard-grad-op-accumulate-no-sync": ({"sharding_strategy": "SHARD_GRAD_OP", "backward_prefetch": None,
                                          "gradient_accumulation_steps": 3, "no_sync": True}, 2,
                                         ("--no-checkpointing",)),
}
# the model when not tiny, and the steps run: forward prefetch on the 4-block model, where
# its order shows, for 4 steps (step 0 has no recorded order yet and need not match)
MODEL = {"mixed-precision-prefetch-post": ("small", 4), "hybrid-4-ranks-forward-prefetch": ("small", 4)}


def commsim(*args):
    return subprocess.run([sys.executable, "-m", "commsim.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_recorded_fsdp1_matches_generated_schedule(tmp_path, name):
    import torch.distributed.fsdp  # noqa: F401  (requirements-test.txt installs torch: without it this fails)

    settings, ranks, ckpt = CONFIGS[name]
    model, steps = MODEL.get(name, ("tiny", 3))
    cfg = tmp_path / "fsdp1.json"
    cfg.write_text(json.dumps(settings))
    nodes, gpn = (2, 2) if ranks == 4 else (1, ranks)  # HYBRID_SHARD shards inside a node
    sched = tmp_path / "sched.json"
    out = commsim("schedule", "--strategy", "fsdp1", "--fsdp-config", str(cfg), "--model", model, "--nodes",
                  str(nodes), "--gpus-per-node", str(gpn), "--micro-batch", "2", "--seq", "16", *ckpt, "-o", str(sched))
    assert out.returncode == 0, out.stderr
    rec = tmp_path / "rec"
    out = commsim("record", "-o", str(rec), "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", str(ranks), "-m", "runtime.examples.fsdp_train", "--fsdp1", "--model", model,
                  "--micro-batch", "2", "--seq", "16", "--steps", str(steps), "--fsdp-config", str(cfg), *ckpt)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in range(ranks):
        res = commsim("compare", "--collectives", str(rec), str(sched), "--rank", str(rank), "--json")
        report = json.loads(res.stdout)
        assert report["match"] and report["repeats"] >= 3, report  # the steady state: the last 3 steps at least
