"""The local validation's runs: a command run from the checkout's root, and each runner's
measured median step (``commsim execute``, real DeepSpeed, real FSDP2) with its phase
times left in a timings file. ``validate_local`` and ``fresh_memory_ab`` use them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from local_grid import Row
from local_report import DEEPSPEED_WARMUP, EXECUTOR_WARMUP, FSDP2_WARMUP, median_step_s, stored_step_s

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], env: dict | None = None, timeout: int = 1800) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def commsim(*args: str, env: dict | None = None) -> str:
    return run([sys.executable, "-m", "commsim.cli", *args], env=env)


def measure_executor(row: Row, sched_path: Path, out: Path, steps: int) -> float:
    commsim("execute", str(sched_path), "--nproc-per-node", str(row.ranks), "--steps", str(steps),
            "--warmup", str(EXECUTOR_WARMUP), "-o", str(out))
    return median_step_s(out)


def measure_deepspeed(row: Row, cfg_path: Path, timings: Path, steps: int) -> float:
    """Real DeepSpeed's median step (its own timer); its phase times stay in ``timings``."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(ROOT / ".cache" / "torch_extensions"))
    timings.unlink(missing_ok=True)
    try:
        run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(row.ranks),
             "-m", "runtime.examples.ds_train", "--model", row.model, "--seq", str(row.seq), "--ds-config",
             str(cfg_path), "--steps", str(steps + DEEPSPEED_WARMUP), "--timings", str(timings)], env=env)
    except RuntimeError as e:
        # ds_train writes its timings after the last step, then tears the job down; a
        # rank aborting in gloo's teardown ("terminate called without an active
        # exception") comes after every step was measured, so the run stands
        if "terminate called without an active exception" not in str(e) or not timings.exists():
            raise
        print(f"  ({row.name}: a rank aborted in teardown after its timings were written; the run stands)",
              file=sys.stderr)
    return stored_step_s(row, timings)


def fsdp2_args(row: Row, cfg_path: Path, timings: Path, steps: int) -> list[str]:
    """runtime.examples.fsdp_train's arguments for an FSDP row (FSDP2, or FSDP1 with ``--fsdp1``)."""
    return ["--model", row.model, "--seq", str(row.seq), "--micro-batch", str(row.micro), "--fsdp-config",
            str(cfg_path), "--steps", str(steps + FSDP2_WARMUP), "--timings", str(timings),
            *(["--fsdp1"] if row.fsdp1 else [])]


def measure_fsdp2(row: Row, cfg_path: Path, timings: Path, steps: int) -> float:
    """Real FSDP2's median step (fsdp_train's timer); its phase times stay in ``timings``."""
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(row.ranks),
         "-m", "runtime.examples.fsdp_train", *fsdp2_args(row, cfg_path, timings, steps)],
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    return stored_step_s(row, timings)
