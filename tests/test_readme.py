"""The README's shell examples run as written.

Every ```sh block of README.md is run whole, with ``sh -e`` (a failing line fails the
block), in a fresh temporary folder, with this Python's bin folder (the venv's, which
holds ``commsim``) first on PATH and the repository importable. Blocks that install,
launch ranks or take long are listed in SKIPPED with the reason (they were run by hand,
as written, when the README last changed); a block must create the files it reads (a
heredoc or printf), as a reader would in an empty folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# the start of a block's first line -> why the suite does not run it
SKIPPED = {
    "python3 -m venv .venv && .venv/bin/pip install -q . &&": "installs commsim into a new virtual environment",
    "python3 -m venv .venv && .venv/bin/pip install -q -r requirements-test.txt":
        "installs, then runs this whole suite",
    "commsim sweep --grid stage=2,3 --grid net=efa,ib --grid nodes=2,4,8,16":
        "64 predictions, 15-30 s on two cores (the plot block runs a small sweep)",
    "pip install 'commsim[ray]'": "installs; then starts a Ray instance, 15-30 s on two cores "
        "(tests/test_sweep_ray.py runs Ray sweeps)",
    "commsim tune --net efa -o ds_config.json": "two searches, 78 predictions, about 40 s",
    "commsim calibrate --nproc-per-node 2": "launches torch ranks (calibrate, then execute), about a minute",
    "printf '{\"train_micro_batch_size_per_gpu\": 2":
        "records real DeepSpeed under torchrun (tests/runtime/test_deepspeed_fidelity.py does, per config)",
    "commsim schedule --model tiny --nodes 1 --gpus-per-node 2 --micro-batch 2 --seq 16 -o tiny.json":
        "launches torch ranks (tests/report/test_kineto.py executes and exports a schedule)",
    "commsim export traces/local-cpu/small_z3_opt.json.gz": "reads the repository's stored traces, from its root",
    "python bench/validate_published.py": "a script of the repository, from its root; about a minute "
        "(tests/test_validate_published.py runs it on some items)",
    "printf '{\"mp_param_dtype\": \"bf16\", \"mp_reduce_dtype\": \"fp32\", \"hsdp_replicas\": 8}":
        "its caching allocator flushes, so all 64 ranks are simulated one by one (about 40 s on two cores); "
        "notebooks/01_efa_vs_infiniband.ipynb predicts the same HSDP setup on both fabrics",
    "printf '{}\\n' > fsdp.json":
        "runs real FSDP2 and DeepSpeed under torchrun (tests/runtime/test_run_records.py does)",
}


def sh_blocks(text: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", text, flags=re.M | re.S)


BLOCKS = sh_blocks((ROOT / "README.md").read_text())


def _skip_reason(block: str) -> str | None:
    first = block.splitlines()[0]
    return next((why for start, why in SKIPPED.items() if first.startswith(start)), None)


def test_every_skip_names_one_block():
    for start in SKIPPED:
        assert sum(b.splitlines()[0].startswith(start) for b in BLOCKS) == 1, f"no single README block starts {start!r}"
    assert len(BLOCKS) - len(SKIPPED) >= 3  # the cheap ones are run below


@pytest.mark.parametrize("block", [b for b in BLOCKS if _skip_reason(b) is None],
                         ids=lambda b: b.splitlines()[0][:50])
def test_readme_block_runs_as_written(tmp_path, block):
    assert (BIN / "commsim").exists(), f"{BIN} has no commsim script: run the suite with the venv's python"
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               MPLBACKEND="Agg")
    out = subprocess.run(["sh", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"README block failed (exit {out.returncode}):\n{block}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr
