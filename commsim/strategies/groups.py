"""Process groups of hierarchical ZeRO-3 partitioning, and one program per group set.

Plain ZeRO-3 runs every collective over the whole world, so all ranks share one
program. Hierarchical partitioning gives each rank its own groups:

* **hpZ** (ZeRO++ ``zero_hpz_partition_size = h``): a secondary copy of each released
  parameter is kept sharded over h consecutive ranks (normally one node), and later
  gathers of that parameter in the same step run inside that group
  (deepspeed/utils/groups.py ``_create_zero_param_parallel_group``: groups of h
  consecutive ranks);
* **MiCS** (``mics_shard_size = S``): parameters are sharded over S consecutive ranks
  and replicated across the W/S shard groups; gradients are reduce-scattered inside the
  shard group and all-reduced across the replication group (ranks with the same
  index in their shard group); with ``mics_hierarchical_params_gather`` (the shard
  group must span nodes), a gather runs first across nodes (ranks with the same local
  rank) and then inside the node (DeepSpeed 0.18.9 ``mics.py`` / ``mics_utils.py``, read
  for this; MiCS, Zhang et al., VLDB 2023, section 3).

A generator lowers rank 0's program with rank 0's groups; every other rank runs the
same program with its own groups (``relabel``). Ranks with equal groups share one
program, and the schedule is marked rank-symmetric so the simulator may simulate rank
0 alone.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

from commsim.ir import ops as O
from commsim.ir.errors import CommsimInputError
from commsim.ir.schedule import Program, Schedule, ScheduleMeta

Group = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RankGroups:
    """The groups one rank's collectives use (None where the scheme has no such group)."""

    world: Group
    partition: Group  # parameters sharded over it: the world, or a MiCS shard group
    secondary: Group | None = None  # hpZ: secondary partition group
    replica: Group | None = None  # MiCS: ranks holding the same shard
    inter: Group | None = None  # MiCS hierarchical gather, step 1: same local rank, across nodes
    intra: Group | None = None  # MiCS hierarchical gather, step 2: inside the node


def check_hierarchy(world_size: int, gpus_per_node: int, hpz: int, mics: int, where: str = "ds_config",
                    hierarchical: bool = False) -> None:
    """Clear errors for group sizes DeepSpeed would refuse."""
    if hpz > 1:
        key = f"{where}: zero_optimization.zero_hpz_partition_size"
        if hpz > world_size or world_size % hpz:
            raise CommsimInputError(f"{key}: {hpz} must divide the world size {world_size}")
    if mics > 0:
        key = f"{where}: zero_optimization.mics_shard_size"
        if mics > world_size or world_size % mics:
            raise CommsimInputError(f"{key}: {mics} must divide the world size {world_size}")
        if mics > gpus_per_node and mics % gpus_per_node:
            raise CommsimInputError(f"{key}: {mics} spans nodes, so it must be a multiple of the "
                                    f"{gpus_per_node} GPUs per node")
        if hierarchical and mics <= gpus_per_node:
            # mics_utils.create_mics_comm_groups asserts the shard group spans nodes
            raise CommsimInputError(f"{where}: zero_optimization.mics_hierarchical_params_gather: the shard group "
                                    f"({mics}) lies inside one node of {gpus_per_node} GPUs; DeepSpeed refuses "
                                    "a hierarchical gather there")


def rank_groups(rank: int, world_size: int, gpus_per_node: int, hpz: int = 1, mics: int = -1,
                hierarchical: bool = False) -> RankGroups:
    world = tuple(range(world_size))
    if mics > 0:
        base = rank // mics * mics
        shard = tuple(range(base, base + mics))
        index = rank - base
        replica = tuple(range(index, world_size, mics)) if world_size > mics else None
        inter = intra = None
        if hierarchical and mics > gpus_per_node:
            local = rank % gpus_per_node
            inter = tuple(range(base + local, base + mics, gpus_per_node))
            node = rank // gpus_per_node * gpus_per_node
            intra = tuple(range(node, node + gpus_per_node))
        return RankGroups(world, shard, None, replica, inter, intra)
    secondary = None
    if hpz > 1:
        base = rank // hpz * hpz
        secondary = tuple(range(base, base + hpz))
    return RankGroups(world, world, secondary)


def relabel(program: Program, mapping: dict[Group, Group]) -> Program:
    """The same program with every collective's group replaced through ``mapping``
    (ops without a mapped group are shared, not copied)."""
    if all(a == b for a, b in mapping.items()):
        return program
    step = tuple(replace(op, group=mapping[op.group]) if isinstance(op, O.Collective) and op.group in mapping
                 else op for op in program.step)
    return Program(program.setup, step)


def per_rank_schedule(world_size: int, program: Program, groups_of: Callable[[int], RankGroups],
                      meta: ScheduleMeta) -> Schedule:
    """Rank 0's ``program`` run by every rank with its own groups."""
    base = groups_of(0)
    names = [f.name for f in fields(RankGroups)]
    programs: list[Program] = []
    index: dict[tuple, int] = {}
    rank_program: list[int] = []
    for r in range(world_size):
        mine = groups_of(r)
        key = tuple(getattr(mine, n) for n in names)
        if key not in index:
            mapping: dict[Group, Group] = {}
            for n in names:
                src, dst = getattr(base, n), getattr(mine, n)
                if src is None:
                    continue
                assert mapping.get(src, dst) == dst, f"group {src} of rank 0 maps two ways for rank {r}"
                assert len(src) == len(dst), (n, src, dst)
                mapping[src] = dst
            index[key] = len(programs)
            programs.append(relabel(program, mapping))
        rank_program.append(index[key])
    if len(programs) > 1:
        meta = replace(meta, rank_symmetric=True)
    return Schedule(world_size, tuple(programs), tuple(rank_program), meta)
