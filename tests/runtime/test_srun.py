"""`commsim execute` and `commsim calibrate` as srun starts them on 2 nodes x 2 ranks:
four processes on this machine, each with the variables srun sets on two hosts (the
node list's hosts are 127.0.0.1 and 127.0.0.2, both this machine's loopback), and none
of MASTER_ADDR, MASTER_PORT, RANK or WORLD_SIZE: the ranks meet at the node list's first
host, on the port derived from the job id, and know their node from the task counts."""

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

from commsim.hardware.profile_doc import load_profile
from commsim.ir.trace import Trace
from runtime.rendezvous import SLURM_PORT_BASE, SLURM_PORT_SPAN

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def _job_id() -> str:
    """A job id whose derived port is free on this machine now."""
    for _ in range(200):
        port = SLURM_PORT_BASE + random.randrange(SLURM_PORT_SPAN)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(700000 + port - SLURM_PORT_BASE + SLURM_PORT_SPAN * random.randrange(1, 50))
    raise RuntimeError("no free port in the Slurm port range")


def _srun(args: list[str], timeout: int) -> list[subprocess.CompletedProcess]:
    """Start 4 tasks as `srun -N 2 --ntasks-per-node 2 commsim ARGS` would."""
    job = _job_id()
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    procs = []
    for rank in range(4):
        env = dict(base, SLURM_JOB_ID=job, SLURM_NTASKS="4", SLURM_NNODES="2", SLURM_JOB_NODELIST="127.0.0.[1-2]",
                   SLURM_TASKS_PER_NODE="2(x2)", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % 2),
                   SLURM_NODEID=str(rank // 2), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "commsim.cli", *args], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_execute_and_calibrate_under_srun_on_two_nodes(tmp_path):
    sched, meas, prof = tmp_path / "s.json", tmp_path / "m.json", tmp_path / "p.json"
    out = subprocess.run([sys.executable, "-m", "commsim.cli", "schedule", "--model", "tiny", "--nodes", "2",
                          "--gpus-per-node", "2", "--micro-batch", "1", "--seq", "8", "-o", str(sched)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]

    runs = _srun(["execute", str(sched), "--steps", "1", "--warmup", "0", "--check-data", "--timeout", "60",
                  "-o", str(meas)], timeout=300)
    assert [r.returncode for r in runs] == [0] * 4, [r.stderr[-1500:] for r in runs]
    t = Trace.load(meas)
    assert {r.rank for r in t.records} == {0, 1, 2, 3}
    assert (t.meta.get("world_size"), t.meta.get("ranks_per_node"), t.meta.get("nodes")) == (4, 2, 2)

    runs = _srun(["calibrate", "--quick", "-o", str(prof)], timeout=600)
    assert [r.returncode for r in runs] == [0] * 4, [r.stderr[-1500:] for r in runs]
    assert "hardware profile of 4 gloo ranks (from the environment)" in runs[0].stdout
    p = load_profile(prof)
    assert (p.world_size, p.ranks_per_node, p.nodes) == (4, 2, 2)
    # the whole job across the nodes, each node's two ranks, one rank of each node
    assert p.groups_measured == (("inter_node", 2), ("inter_node", 4), ("intra_node", 2))
    doc = json.loads(prof.read_text())
    assert {k: sorted(v) for k, v in doc["collectives"]["all_reduce"].items()} == \
        {"inter_node": ["2", "4"], "intra_node": ["2"]}
    assert doc["collectives"]["all_reduce"]["intra_node"]["2"]["concurrent_groups"] == 2
