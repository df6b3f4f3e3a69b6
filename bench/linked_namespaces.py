"""Two network namespaces joined by a veth pair, for running two ranks over an emulated
link on one machine (root only): ``bench/validate_local.py``'s slow-link and fast-link
rows. The pair is optionally rate-limited both ways with a tc token bucket (the local
stand-in for a slower network such as EFA); everything is removed again on exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NS_ADDR = ("10.77.0.1", "10.77.0.2")  # private addresses, only inside the namespaces made here


def sh(*cmd: str) -> None:
    out = subprocess.run(list(cmd), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")


class LinkedNamespaces:
    """Two network namespaces joined by a veth pair, optionally rate-limited both ways
    with a tc token bucket; removed again on exit (``ip netns del`` takes the veth)."""

    def __init__(self, tag: str, rate: str | None):
        self.ns = (f"commsim-{tag}0", f"commsim-{tag}1")
        self.dev = (f"cs{tag[:6]}0", f"cs{tag[:6]}1")
        self.rate = rate

    def __enter__(self) -> "LinkedNamespaces":
        self._cleanup()
        for ns in self.ns:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, addr in zip(self.ns, self.dev, NS_ADDR):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            if self.rate:
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                   "burst", "256kb", "latency", "100ms")
        return self

    def __exit__(self, *exc) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def run_ranks(self, args: list[str], timeout: int = 1800, module: str = "commsim.cli") -> None:
        """``python -m MODULE ARGS`` (commsim by default) as rank 0 and rank 1, one per
        namespace (env:// rendezvous)."""
        port = str(29700 + os.getpid() % 200)
        procs = []
        for rank, (ns, dev) in enumerate(zip(self.ns, self.dev)):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=NS_ADDR[0],
                       MASTER_PORT=port, GLOO_SOCKET_IFNAME=dev, OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", module, *args],
                                          env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=timeout) for p in procs]
        for rank, (p, (o, e)) in enumerate(zip(procs, outs)):
            if p.returncode != 0:
                raise RuntimeError(f"rank {rank} of {module} {' '.join(args)} failed:\n{o[-1500:]}\n{e[-2500:]}")
