"""Starting a training command with its collectives recorded (``commsim record -- CMD``):
a ``sitecustomize`` on the child's ``PYTHONPATH`` loads ``runtime.record`` into every
Python process of the command before the framework does. Apart from ``runtime.record``
so that the launching process does not import torch (about 1.6 s of a core) only to
start another."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from commsim.ir.errors import CommsimInputError

_SITECUSTOMIZE = """# written by commsim record: wrap torch.distributed.ProcessGroup before the framework loads
import runtime.record as _commsim_record
_commsim_record.install_from_env()
"""


def run_recorded(cmd: list[str], out_dir: str | Path) -> int:
    """Run ``cmd`` (a training command, under torchrun or not) with every process's
    collectives recorded into ``out_dir`` (created; it must hold no recording yet);
    returns the command's exit status."""
    out = Path(out_dir)
    if not cmd:
        raise CommsimInputError("no command to record: give it after --, e.g. "
                                "commsim record -o rec -- torchrun --nproc-per-node 2 train.py")
    if out.exists() and any(out.glob("rank*.json")):
        raise CommsimInputError(f"{out}: already holds recorded traces (rank*.json); choose an empty folder")
    created = not out.exists()
    out.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="commsim-record-") as hook_dir:
        Path(hook_dir, "sitecustomize.py").write_text(_SITECUSTOMIZE)
        env = dict(os.environ)
        # the repository root (so `runtime` imports even when commsim is not installed)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([hook_dir, root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["COMMSIM_RECORD_DIR"] = str(out.resolve())
        try:
            return subprocess.run(cmd, env=env).returncode
        except FileNotFoundError:
            if created:
                out.rmdir()
            raise CommsimInputError(f"command not found: {cmd[0]}") from None
