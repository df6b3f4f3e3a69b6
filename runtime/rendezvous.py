"""Where a rank is, when a launcher started it: torchrun, srun, or variables set by hand.

``launch_env(environ)`` reads a rank's environment into a ``LaunchEnv``: its rank, the
world size, its rank on its node, the ranks per node and the nodes, and the rendezvous
address (``MASTER_ADDR`` / ``MASTER_PORT``). Pure functions of a mapping, so that every
launcher's forms are tested without one:

* **torchrun** sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR`` and ``MASTER_PORT``;
* **srun** sets ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
  the node list (``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST``, in Slurm's compact form
  ``node[01-04,07]``), the tasks per node (``SLURM_NTASKS_PER_NODE`` only when asked
  for; ``SLURM_TASKS_PER_NODE`` always, as ``2(x2)`` or ``4,2``) and ``SLURM_JOB_ID``,
  but no rendezvous: the address is the first host of the node list, the port one
  derived from the job id, so every task of the job computes the same one. Variables
  set by hand (``MASTER_ADDR``, ``MASTER_PORT``) win over both.

``cuda_device_index`` picks the GPU a rank drives: the only one it sees when srun gave
each task its own (``--gpus-per-task=1`` sets ``CUDA_VISIBLE_DEVICES`` to one device per
task, which the task sees as device 0), else its rank on the node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from commsim.ir.errors import CommsimInputError

# Ports derived from a Slurm job id: below Linux's ephemeral range (32768-60999, from
# /proc/sys/net/ipv4/ip_local_port_range's default), so an outgoing connection of
# another program on the node does not hold the port, and above the registered
# services most sites run.
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 15000


@dataclass(frozen=True)
class LaunchEnv:
    """One rank of a job a launcher started."""

    rank: int
    world: int
    local_rank: int  # the rank's index among the ranks of its node
    ranks_per_node: int
    nodes: int
    master_addr: str | None
    master_port: int | None
    launcher: str  # "torchrun" (or hand-set RANK / WORLD_SIZE) or "srun"

    @property
    def init_method(self) -> str:
        """The rendezvous URL every rank of the job computes alike. Under torchrun,
        ``env://``: torchrun's agent already serves the store at MASTER_ADDR:MASTER_PORT
        and tells the ranks to join it as clients (rank 0 must not open a second one)."""
        if self.launcher == "torchrun":
            return "env://"
        if self.master_addr is None or self.master_port is None:
            raise CommsimInputError(f"rank {self.rank}: no rendezvous address: set MASTER_ADDR and MASTER_PORT "
                                    "(or run under srun, which names the nodes and the job)")
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host list in full: ``node[01-03,07],gpu5`` -> node01, node02,
    node03, node07, gpu5 (ranges keep their zero padding; several bracket groups in
    one name expand as their product, ``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2)."""
    out: list[str] = []
    for name in _split_top(nodelist.strip()):
        if name:
            out.extend(_expand_name(name, nodelist))
    if not out:
        raise CommsimInputError(f"Slurm node list {nodelist!r}: names no host")
    return out


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _expand_name(name: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        if "[" in name or "]" in name:
            raise CommsimInputError(f"Slurm node list {whole!r}: unbalanced brackets in {name!r}")
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    out = []
    for item in m.group(1).split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise CommsimInputError(f"Slurm node list {whole!r}: {item!r} is not a number or a range a-b")
        if not sep:
            values = [lo]
        else:
            if int(hi) < int(lo):
                raise CommsimInputError(f"Slurm node list {whole!r}: range {item!r} runs backwards")
            values = [str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1)]
        for v in values:
            out.extend(_expand_name(head + v + tail, whole))
    return out


def tasks_per_node(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` per node: ``2(x3),1`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise CommsimInputError(f"SLURM_TASKS_PER_NODE {spec!r}: expected counts like 2(x3),1")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def slurm_port(job_id: str) -> int:
    """The rendezvous port of a Slurm job: every task derives the same one from the
    job id; jobs sharing a node get different ones unless their ids differ by a
    multiple of the span."""
    digits = re.match(r"\d+", job_id.strip())
    if digits is None:
        raise CommsimInputError(f"SLURM_JOB_ID {job_id!r}: not a job number; set MASTER_PORT")
    return SLURM_PORT_BASE + int(digits.group()) % SLURM_PORT_SPAN


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise CommsimInputError(f"{key}={env[key]!r}: not an integer") from None


def launch_env(env: Mapping[str, str]) -> LaunchEnv | None:
    """The launcher's view of this rank; None when no launcher started it (no
    ``RANK`` / ``WORLD_SIZE``, no ``SLURM_PROCID`` / ``SLURM_NTASKS``)."""
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or set by hand
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        per_node = world  # unknown: every rank on one machine
        if env.get("LOCAL_WORLD_SIZE", "").isdigit() and int(env["LOCAL_WORLD_SIZE"]) > 0:
            per_node = int(env["LOCAL_WORLD_SIZE"])
        elif "SLURM_NTASKS_PER_NODE" in env:  # torchrun started by srun: one torchrun per node
            per_node = _slurm_per_node(env, world)
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
        return _checked(LaunchEnv(rank, world, local, per_node, -(-world // per_node), env.get("MASTER_ADDR"), port,
                                  "torchrun"))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        per_node = _slurm_per_node(env, world)
        addr = env.get("MASTER_ADDR")
        if addr is None:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            addr = expand_nodelist(nodelist)[0] if nodelist else None
        port: int | None = None
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        elif "SLURM_JOB_ID" in env or "SLURM_JOBID" in env:
            port = slurm_port(env.get("SLURM_JOB_ID") or env["SLURM_JOBID"])
        nodes = -(-world // per_node)
        if env.get("SLURM_NNODES", "").isdigit():
            nodes = int(env["SLURM_NNODES"])
        return _checked(LaunchEnv(rank, world, local, per_node, nodes, addr, port, "srun"))
    return None


def _slurm_per_node(env: Mapping[str, str], world: int) -> int:
    """Tasks per node: ``SLURM_NTASKS_PER_NODE`` when the job asked for it, else
    ``SLURM_TASKS_PER_NODE``, which must be the same on every node (a profile is of
    nodes alike); else the tasks over the nodes."""
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        return int(env["SLURM_NTASKS_PER_NODE"])
    if env.get("SLURM_TASKS_PER_NODE"):
        counts = tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        if len(set(counts)) > 1:
            raise CommsimInputError(f"SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']}: nodes run different "
                                    "numbers of tasks; run the same number on every node (srun --ntasks-per-node)")
        return counts[0]
    nodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or ""
    if nodes.isdigit() and int(nodes) > 0:
        return -(-world // int(nodes))
    return world


def _checked(e: LaunchEnv) -> LaunchEnv:
    if not (0 <= e.rank < e.world) or not (0 <= e.local_rank < e.ranks_per_node) or e.ranks_per_node < 1:
        raise CommsimInputError(f"launcher environment: rank {e.rank} of {e.world}, local rank {e.local_rank} of "
                                f"{e.ranks_per_node} per node: out of range")
    return e


def cuda_device_index(local_rank: int, visible_devices: int) -> int:
    """The GPU a rank drives: the only one it sees (srun --gpus-per-task=1, or
    ``CUDA_VISIBLE_DEVICES`` naming one device), else its rank on the node (all of the
    node's GPUs visible to every rank: torchrun, srun without GPU binding)."""
    if visible_devices == 1:
        return 0
    if local_rank >= visible_devices:
        raise CommsimInputError(f"local rank {local_rank} needs GPU {local_rank}, but this task sees "
                                f"{visible_devices} GPU(s); give each task one GPU (srun --gpus-per-task=1) or run "
                                "at most one rank per visible GPU")
    return local_rank
