"""Calibration of collectives: each kind by size, per group size and placement.

Every kind is measured on its own (gloo's reduce-scatter, for one, costs an all-reduce),
per group set (``group_sets``): the whole job, and when it spans nodes also every node's
ranks together (inside a node) and one rank of each node (across nodes), all groups of
a set at once, as a step runs them. Latency and bandwidth come from a fit of time over
bytes; the cost model interpolates the measured points.

Every backend: ``points``, a batch of back-to-back calls (``runtime.timing.per_call``;
CUDA events around the batch on the communication stream on GPUs), what a collective
followed by another costs.

CPU backends (kernels on the host thread) also: ``in_step_points``, each collective
**as a step issues it** (``_in_step``): started together on every rank (after a
barrier), issued asynchronously and waited for, as the executor and the frameworks do,
then followed by compute on every rank (``STEP_AFTER_S`` of matmuls), as a layer's
kernels follow its gather; its time is from the last member's call to the last
member's completion, the mean over many calls. On a CPU a collective's completion
rides on the backend's threads, which need a core; followed by compute, now and then a
completion waits about a scheduler slice for one. Back-to-back calls rarely meet that;
a layer's gather, followed by its GEMMs, often does (the figures: traces/README.md,
"Collectives as a step issues them"). The mean, not the median, because a step pays
every stall. The simulator adds the difference between the two tables to a collective whose
rank computes next (``commsim.sim.cpu_rank.followed_by_compute``).

Also on CPUs: how long each call holds the calling thread before it returns
(``call_points``; gloo's reduce-scatter does about half its work on the caller's thread).

A mixin of ``runtime.calibrate.Calibrator``: it uses the calibrator's ``world``, ``rank``,
``ranks_per_node``, ``quick``, ``queued``, ``device``, ``kernels``, ``comm_timer``,
``_together``, ``values``, ``agree`` and ``log``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from commsim.ir import ops as O
from runtime.collectives import all_gather, reduce_scatter
from runtime.timing import latency_bandwidth

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
INTRA_NODE, INTER_NODE = "intra_node", "inter_node"

# Compute after each collective timed as a step issues it: longer than one scheduler
# tick at HZ >= 250 (4 ms; Linux's common settings are 100-1000), so that a completion
# that waits for a computing rank's core waits as long as in a step, where a layer's
# GEMMs follow its gather.
STEP_AFTER_S = 0.005
# Calls per size: the stalls are rare and long, so the mean needs many calls; the large
# sizes' calls are long and their stalls a small part of them.
STEP_CALLS, STEP_CALLS_LARGE = 120, 12
STEP_CALLS_QUICK, STEP_CALLS_LARGE_QUICK = 12, 4
LARGE_BYTES = 8 << 20
# Calls averaged per size at least (after a warm-up call): a 64 MiB call on gloo takes
# 70-240 ms, so the batch's 0.2 s held 3 of them, and the point moved 72-237 ms between
# one calibration and the next within an hour (16 MiB: 9-17 ms) while the whole-model
# all-gather that ends a ZeRO-2 step is one such call (traces/README.md, "The 64 MiB
# collective point")
POINT_MIN_CALLS = 10


@dataclass(frozen=True)
class GroupSet:
    """Groups of one size and placement, measured all at once (as a step runs them:
    every node's ranks gather inside their node at the same time)."""

    placement: str  # INTRA_NODE or INTER_NODE
    size: int
    groups: tuple[tuple[int, ...], ...]


def group_sets(world: int, ranks_per_node: int) -> list[GroupSet]:
    """The process groups a calibration measures, with ranks placed on nodes in blocks
    (rank r on node r // ranks_per_node, as torchrun and srun's default distribution
    place them). One node: the whole job. Several: the whole job (across nodes), every
    node's ranks (inside a node) and one rank of each node (across nodes), so that the
    profile prices a hierarchical schedule's groups from measurements of their own
    placement. A single rank has no collective to measure."""
    if world < 2:
        return []
    nodes = -(-world // ranks_per_node)
    everyone = (tuple(range(world)),)
    if nodes == 1:
        return [GroupSet(INTRA_NODE, world, everyone)]
    out = [GroupSet(INTER_NODE, world, everyone)]
    if ranks_per_node >= 2:
        node_groups = tuple(tuple(range(n * ranks_per_node, min(world, (n + 1) * ranks_per_node)))
                            for n in range(nodes))
        out.append(GroupSet(INTRA_NODE, ranks_per_node, node_groups))
        cross = tuple(tuple(r for r in range(j, world, ranks_per_node)) for j in range(ranks_per_node))
        out.append(GroupSet(INTER_NODE, nodes, cross))
    return out


def in_step_mean_s(starts_ns: list[list[float]], ends_ns: list[list[float]], same_clock: bool) -> float:
    """Seconds per call of a collective from its members' call and completion times
    (``starts_ns[m][i]``, ``ends_ns[m][i]``: member m, call i). With one clock for all
    members (one node's monotonic clock): from the last member's call to the last
    completion, the mean over calls. Members on several nodes have clocks of their own:
    the slowest member's mean from its own call (which then also counts how much later
    its call came than the others', a small part after the barrier that starts each)."""
    members, calls = len(starts_ns), len(starts_ns[0])
    assert members >= 1 and calls >= 1 and all(len(s) == calls and len(e) == calls
                                                for s, e in zip(starts_ns, ends_ns))
    if same_clock:
        per_call = [max(e[i] for e in ends_ns) - max(s[i] for s in starts_ns) for i in range(calls)]
        return statistics.fmean(per_call) / 1e9
    return max(statistics.fmean(e[i] - s[i] for i in range(calls)) for s, e in zip(starts_ns, ends_ns)) / 1e9


class CollectiveMeasurements:
    """Collective benchmarks of a ``Calibrator``."""

    world: int
    rank: int
    ranks_per_node: int
    quick: bool
    queued: bool
    device: Any
    kernels: Any
    comm_timer: Any

    def _collective(self, kind: str, nbytes: int, group: Any = None, p: int | None = None,
                    async_op: bool = False) -> Callable[[], Any]:
        p = p or self.world
        n = max(p, nbytes // 4 // p * p)
        buf = torch.ones(n, dtype=torch.float32, device=self.device)
        shard = torch.ones(n // p, dtype=torch.float32, device=self.device)
        if kind == "all_gather":
            return lambda: all_gather(buf, shard, group=group, async_op=async_op)
        if kind == "reduce_scatter":
            return lambda: reduce_scatter(shard, buf, group=group, async_op=async_op)
        if kind == "all_reduce":
            return lambda: dist.all_reduce(buf, group=group, async_op=async_op)
        src = 0 if group is None else dist.get_global_rank(group, 0)
        return lambda: dist.broadcast(buf, src=src, group=group, async_op=async_op)

    def _call_s(self, kind: str, nbytes: int, group: Any, p: int) -> float:
        """Seconds the backend's call holds the calling thread (async_op=True, until it
        returns), the mean over a batch; the collective is then waited for. gloo does part
        of some collectives on the caller's thread (its reduce-scatter: about half)."""
        start = self._collective(kind, nbytes, group, p, async_op=True)
        held: list[float] = []

        def call() -> None:
            t = time.perf_counter()
            work = start()
            held.append(time.perf_counter() - t)
            work.wait()

        self._together(call, self.comm_timer, slowest=True)  # type: ignore[attr-defined]
        return self.agree(statistics.fmean(held[1:] or held))  # type: ignore[attr-defined] # (the first: warm-up)

    def _compute_for(self, seconds: float) -> None:
        """The rank's thread busy with matmuls for ``seconds`` (a layer's kernels)."""
        op = O.Compute(O.OpId(0), "c", "", O.ComputeKind.GEMM, 2 * 128 ** 3, 0, 0, O.GemmShape(128, 128, 128))
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.kernels.run(op)

    def _in_step(self, kind: str, nbytes: int, group: Any, gs: GroupSet) -> float:
        """Seconds per call of a collective timed as a step issues it (CPUs; see the
        module docstring): ``calls`` of barrier, call and wait, then compute; every
        rank's call and completion times gathered, and for this rank's group
        ``in_step_mean_s``; the largest over the groups of the set (every rank agrees)."""
        large = nbytes >= LARGE_BYTES
        calls = (STEP_CALLS_LARGE_QUICK if large else STEP_CALLS_QUICK) if self.quick else \
            (STEP_CALLS_LARGE if large else STEP_CALLS)
        start = self._collective(kind, nbytes, group, gs.size, async_op=True)
        start().wait()  # warm-up
        times: list[float] = []
        for _ in range(calls):
            dist.barrier()
            t0 = time.perf_counter_ns()
            start().wait()
            times += [float(t0), float(time.perf_counter_ns())]
            self._compute_for(STEP_AFTER_S)
        mine = self.values(times)  # type: ignore[attr-defined]
        everyone = torch.empty(self.world * len(times), dtype=mine.dtype, device=self.device)
        all_gather(everyone, mine)
        rows = everyone.view(self.world, len(times)).tolist()
        members = next(g for g in gs.groups if self.rank in g)
        same_clock = gs.placement == INTRA_NODE or len({m // self.ranks_per_node for m in members}) == 1
        s = in_step_mean_s([rows[m][0::2] for m in members], [rows[m][1::2] for m in members], same_clock)
        return self.agree(s)  # type: ignore[attr-defined]

    def collectives(self) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
        """kind -> placement -> group size -> fit, for every group set (``group_sets``)."""
        sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20] + ([] if self.quick else [16 << 20, 64 << 20])
        out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {kind: {} for kind in KINDS}
        for gs in group_sets(self.world, self.ranks_per_node):
            group = None
            if gs.size < self.world:
                # every rank creates every group, in the same order (new_group's rule)
                for ranks in gs.groups:
                    pg = dist.new_group(list(ranks))
                    if self.rank in ranks:
                        group = pg
            for kind in KINDS:
                pts = [(float(s), self._together(self._collective(kind, s, group, gs.size),  # type: ignore
                                                 self.comm_timer, POINT_MIN_CALLS, slowest=True)) for s in sizes]
                a, bw = latency_bandwidth(pts)
                fit = out[kind].setdefault(gs.placement, {})[str(gs.size)] = {
                    "latency_ns": int(a * 1e9), "bytes_per_s": bw, "points": [[int(x), y] for x, y in pts],
                    "concurrent_groups": len(gs.groups)}
                where = "inside a node" if gs.placement == INTRA_NODE else "across nodes"
                msg = f"{a * 1e6:.0f} us + {bw / 1e9:.2f} GB/s"
                if not self.queued:
                    # CPU backends: the call may hold the host thread (a GPU's call only
                    # enqueues), and a collective followed by compute stalls now and then
                    fit["call_points"] = [[int(s), self._call_s(kind, s, group, gs.size)] for s in sizes]
                    fit["in_step_points"] = [[int(s), self._in_step(kind, s, group, gs)] for s in sizes]
                    msg += ("; followed by compute " + ", ".join(f"{y * 1e3:.2f}" for _, y in fit["in_step_points"])
                            + " ms")
                self.log(f"{kind} over {gs.size} ranks {where} ({len(gs.groups)} group(s) at once): {msg}")  # type: ignore
        return {k: v for k, v in out.items() if v}
