"""FSDP2's units and shards for a model wrapped the usual way, and each rank's groups.

``fully_shard(block)`` on every transformer block, then ``fully_shard(model)``: each
call makes one parameter group (torch/distributed/fsdp/_fully_shard/_fsdp_init.py
``_get_managed_states``: the module's parameters not already in a nested group), so
block i's unit holds the parameters of the modules of block i and the root unit
everything else (embeddings, final norm, LM head; a tied weight once).

Each parameter is sharded on dim 0 over the shard group of S ranks, padded to a
multiple of S (_fsdp_param.py ``FSDPParam._init_sharded_param``: ``chunk`` rows of
``ceil(dim0 / S)``; rank r keeps rows ``[r * chunk, (r + 1) * chunk)``, the last ranks
fewer or none, zero-padded to ``chunk``). A unit's all-gather output and
reduce-scatter input are the concatenation of its parameters' padded sizes
(_fsdp_collectives.py ``foreach_all_gather`` / ``foreach_reduce``). The optimizer
steps on the unpadded local rows, rank 0's here (the program is shared by all ranks).

The mesh (_fsdp_init.py ``_get_mesh_info``): 1-D over the world, or HSDP's 2-D
``(replicas, S)`` whose shard groups are S consecutive ranks and replicate groups the
ranks with the same index in their shard group; an int ``reshard_after_forward`` k
keeps a shard over k consecutive ranks of the flattened mesh
(``_get_post_forward_mesh_info``: ``mesh.view(-1, k)``). Sizes are in elements
unless named ``_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, prod

from commsim.ir.errors import CommsimInputError
from commsim.models.spec import ModelDescription, ModuleSpec, ParamSpec
from commsim.strategies.fsdp2_config import FSDP2Config, post_forward_size, shard_size
from commsim.strategies.groups import RankGroups


@dataclass(frozen=True, slots=True)
class Unit:
    """One ``fully_shard`` call's parameter group."""

    name: str  # the block's module path, or "root"
    block: int | None  # the transformer block, None for the root
    params: tuple[ParamSpec, ...]
    padded: int  # all-gather output / reduce-scatter input: the parameters padded to the shard group
    local: int  # rank 0's unpadded rows: what the optimizer steps on
    numel: int  # the parameters' (and their unsharded gradients') elements
    post_forward: int | None  # ranks it stays sharded over between forward and backward; None: stays gathered

    def shard(self, group: int) -> int:
        """Elements per rank when sharded over ``group`` ranks."""
        return self.padded // group


def padded_numel(p: ParamSpec, s: int) -> int:
    rows, rest = (p.shape[0], prod(p.shape[1:])) if p.shape else (1, 1)
    return ceil(rows / s) * s * rest


def local_numel(p: ParamSpec, s: int) -> int:
    """Rank 0's rows: ``torch.chunk``'s first chunk."""
    rows, rest = (p.shape[0], prod(p.shape[1:])) if p.shape else (1, 1)
    return min(ceil(rows / s), rows) * rest


@dataclass(frozen=True, slots=True, eq=False)
class FSDP2Layout:
    units: tuple[Unit, ...]  # blocks in forward order, then the root
    world: int
    shard: int  # S
    replicas: int
    segments: tuple[tuple[Unit, tuple[ModuleSpec, ...]], ...]  # forward order: (unit, its modules run there)

    @property
    def root(self) -> Unit:
        return self.units[-1]

    @property
    def blocks(self) -> tuple[Unit, ...]:
        return self.units[:-1]

    @staticmethod
    def build(md: ModelDescription, world: int, cfg: FSDP2Config) -> "FSDP2Layout":
        s = shard_size(cfg, world)
        ints = {v for v in (cfg.reshard_after_forward, cfg.root_reshard_after_forward)
                if isinstance(v, int) and not isinstance(v, bool) and 1 < v < s}
        if len(ints) > 1:
            raise CommsimInputError(f"{cfg.source}: reshard_after_forward and root_reshard_after_forward: commsim "
                                    f"models one post-forward group size, got {sorted(ints)}")
        owner: dict[str, int | None] = {}
        for m in md.modules:
            for p in m.params:
                if p.name in owner and owner[p.name] != m.block:
                    raise CommsimInputError(f"model {md.name}: parameter {p.name} is used by block {owner[p.name]} "
                                            f"and {m.block}; fully_shard needs it in one group")
                owner.setdefault(p.name, m.block)
        by_unit: dict[int | None, list[ParamSpec]] = {}
        for p in md.registered_params():
            by_unit.setdefault(owner[p.name], []).append(p)
        names: dict[int, str] = {}
        for m in md.modules:
            if m.block is not None:
                names.setdefault(m.block, m.path)  # the block's container comes first
        units = []
        for key in sorted(k for k in by_unit if k is not None) + [None]:
            params = tuple(by_unit.get(key, ()))
            raf = cfg.reshard_after_forward if key is not None else cfg.root_reshard_after_forward
            units.append(Unit(
                name="root" if key is None else names[key], block=key, params=params,
                padded=sum(padded_numel(p, s) for p in params), local=sum(local_numel(p, s) for p in params),
                numel=sum(p.numel for p in params), post_forward=post_forward_size(raf, key is None, s)))
        if not units[-1].params:
            raise CommsimInputError(f"model {md.name}: no parameters outside the blocks; commsim models a root unit")
        unit_of = {u.block: u for u in units}
        segments: list[tuple[Unit, list[ModuleSpec]]] = []
        for m in md.modules:
            u = unit_of[m.block] if m.block in unit_of else units[-1]
            if segments and segments[-1][0] is u:
                segments[-1][1].append(m)
            else:
                segments.append((u, [m]))
        seen = [u.name for u, _ in segments if u.block is not None]
        if len(seen) != len(set(seen)):
            raise CommsimInputError(f"model {md.name}: a block's modules are not contiguous in forward order")
        return FSDP2Layout(tuple(units), world, s, cfg.hsdp_replicas, tuple((u, tuple(ms)) for u, ms in segments))

    def groups_of(self, rank: int, post_forward: int | None) -> RankGroups:
        """Rank ``rank``'s groups: shard (``partition``), the post-forward group of an
        int ``reshard_after_forward`` (``secondary``), HSDP's replicate group (``replica``)."""
        s = self.shard
        base = rank // s * s
        shard = tuple(range(base, base + s))
        secondary = None
        if post_forward is not None and post_forward < s:
            k = post_forward
            secondary = tuple(range(rank // k * k, rank // k * k + k))
        replica = tuple(range(rank % s, self.world, s)) if self.replicas > 1 else None
        return RankGroups(tuple(range(self.world)), shard, secondary, replica)
