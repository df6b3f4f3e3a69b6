"""A fixed set of predictions, recorded and compared: has a change moved any figure?

    python bench/prediction_snapshot.py -o before.json          # record every scenario's --json
    python bench/prediction_snapshot.py --against before.json    # record again and list what moved

A refactor must leave every figure identical; a change to the model moves some, and the
list says which scenario and which figure, from what to what, so each move can be
explained. The scenarios cover ZeRO stages 0-3, both knob presets, EFA and InfiniBand,
hpZ, MiCS, optimizer offload, fp16, gradient accumulation, the checkpoint styles,
per-rank mode, several node presets, and measured CPU profiles (2 ranks, and 4 ranks
time-sliced on 2 cores). Each runs ``commsim predict ... --json`` in a subprocess, as a
user would. Ends with one line: ``N scenarios, M differ``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU2 = str(ROOT / "traces/local-cpu/small_z3_opt.profile.json")
CPU2_Z2 = str(ROOT / "traces/local-cpu/small_z2.profile.json")
CPU4 = str(ROOT / "traces/local-cpu/small_z3_baseline_x4.profile.json")

# DeepSpeed configs the scenarios name (written to a temporary folder)
CONFIGS = {
    "hpz": {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
            "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}},
    "mics": {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
             "zero_optimization": {"stage": 3, "mics_shard_size": 16, "mics_hierarchical_params_gather": True}},
    "offload3": {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
                 "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
    "offload2": {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
                 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "fp16": {"fp16": {"enabled": True}, "zero_optimization": {"stage": 3}},
    "accum": {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 3}},
    "small_buckets": {"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": 20000000, "stage3_prefetch_bucket_size": 10000000}},
    "cpu_z3": {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4},
    "cpu_z2": {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4},
}

SMALL2 = ["--model", "small", "--nodes", "1", "--gpus-per-node", "2", "--seq", "128"]
SMALL4 = ["--model", "small", "--nodes", "1", "--gpus-per-node", "4", "--seq", "128"]

SCENARIOS: dict[str, list[str]] = {
    "seed efa": ["--net", "efa"],
    "seed ib": ["--net", "ib"],
    "baseline efa": ["--net", "efa", "--preset", "baseline"],
    "baseline ib": ["--net", "ib", "--preset", "baseline"],
    "stage 0": ["--stage", "0"],  # roberta-10b does not fit unsharded: the out-of-memory path
    "stage 0 large": ["--stage", "0", "--model", "roberta-large", "--nodes", "2"],
    "stage 1": ["--stage", "1"],
    "stage 2 efa": ["--stage", "2"],
    "stage 2 ib": ["--stage", "2", "--net", "ib"],
    "hpz": ["--ds-config", "{hpz}"],
    "mics hierarchical": ["--ds-config", "{mics}"],
    "offload z3": ["--ds-config", "{offload3}"],
    "offload z2": ["--ds-config", "{offload2}"],
    "fp16": ["--ds-config", "{fp16}", "--nodes", "4"],
    "grad accumulation": ["--ds-config", "{accum}"],
    "small buckets": ["--ds-config", "{small_buckets}", "--nodes", "2"],
    "no coalescing": ["--knob", "coalesced_collectives=false"],
    "no checkpointing": ["--no-checkpointing", "--micro-batch", "4"],
    "non-reentrant": ["--checkpoint-style", "non_reentrant", "--nodes", "2"],
    "p5": ["--cluster", "p5", "--model", "llama2-13b", "--nodes", "4", "--seq", "2048", "--micro-batch", "2"],
    "dgx-a100 50b": ["--cluster", "dgx-a100", "--model", "roberta-50b", "--nodes", "16"],
    "p3dn large": ["--cluster", "p3dn", "--model", "roberta-large", "--nodes", "2"],
    "per-rank": ["--mode", "per-rank", "--nodes", "2", "--seed", "3"],
    "per-rank baseline large": ["--model", "roberta-large", "--nodes", "2", "--preset", "baseline",
                                "--mode", "per-rank"],
    "cpu 2 ranks z3": SMALL2 + ["--ds-config", "{cpu_z3}", "--hw-profile", CPU2],
    "cpu 2 ranks z3 symmetric": SMALL2 + ["--ds-config", "{cpu_z3}", "--hw-profile", CPU2, "--mode", "symmetric"],
    "cpu 2 ranks z2": SMALL2 + ["--ds-config", "{cpu_z2}", "--hw-profile", CPU2_Z2],
    "cpu 4 ranks baseline": SMALL4 + ["--ds-config", "{cpu_z3}", "--preset", "baseline", "--hw-profile", CPU4],
}

# figures that describe the run rather than predict it
_SKIP = {"scenario", "hardware_sources"}


def run_one(name: str, args: list[str], cfg_dir: Path) -> dict:
    argv = [a.format(**{k: str(cfg_dir / f"{k}.json") for k in CONFIGS}) for a in args]
    proc = subprocess.run([sys.executable, "-m", "commsim.cli", "predict", *argv, "--json"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode not in (0, 1):
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]}
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"error": f"not JSON: {proc.stdout[:200]!r} {proc.stderr[-300:]!r}"}
    return {k: v for k, v in out.items() if k not in _SKIP}


def record(jobs: int) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg_dir = Path(tmp)
        for k, v in CONFIGS.items():
            (cfg_dir / f"{k}.json").write_text(json.dumps(v))
        with ThreadPoolExecutor(jobs) as pool:
            futs = {name: pool.submit(run_one, name, args, cfg_dir) for name, args in SCENARIOS.items()}
            return {name: f.result() for name, f in futs.items()}


def differences(before: dict, after: dict, where: str = "") -> list[str]:
    """Every figure that is not identical, as 'where: before -> after'."""
    out: list[str] = []
    for k in sorted(set(before) | set(after)):
        w = f"{where}.{k}" if where else k
        a, b = before.get(k, "<absent>"), after.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(differences(a, b, w))
        elif a != b and not (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
            out.append(f"{w}: {a!r} -> {b!r}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", help="write the predictions here (JSON)")
    ap.add_argument("--against", help="an earlier output: list every figure that differs")
    ap.add_argument("--jobs", type=int, default=2, help="parallel predictions (default 2)")
    args = ap.parse_args()
    now = record(args.jobs)
    errors = [f"{n}: {r['error']}" for n, r in now.items() if "error" in r]
    for e in errors:
        print(f"error: {e}")
    if args.output:
        Path(args.output).write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    if args.against:
        before = json.loads(Path(args.against).read_text())
        moved = 0
        for name in SCENARIOS:
            diff = differences(before.get(name, {}), now.get(name, {}))
            if diff:
                moved += 1
                print(f"{name}:")
                for d in diff:
                    print(f"  {d}")
        print(f"{len(SCENARIOS)} scenarios, {moved} differ")
    else:
        print(f"{len(SCENARIOS)} scenarios recorded, {len(errors)} errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
