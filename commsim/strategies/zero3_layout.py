"""One rank's ZeRO-3 partitioning: what every part of the stage-3 lowering reads.

DeepSpeed's stage 3 (deepspeed/runtime/zero/partition_parameters.py, ``Init``) numbers
the parameters in ``named_parameters()`` order (``ds_id``) and splits each one into
``ceil(numel / n)`` elements on each of the n ranks of its partition group, padding the
last shard; stage3.py keeps a rank's shards in flat buffers per optimizer sub-group.
``Zero3Layout`` holds those facts with the rank's process groups, the element size
and the streams, so that the parameter coordinator (zero3_params.py), the gradient
reducer (zero3_grads.py) and the optimizer step (zero3_optimizer.py) read one
description and none of them owns it. Sizes are in elements unless named ``_bytes``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from math import ceil

from commsim.ir import ops as O
from commsim.models.spec import ParamSpec
from commsim.strategies.groups import RankGroups

COMPUTE = "compute"


@dataclass(frozen=True, slots=True, eq=False)
class Zero3Layout:
    params: tuple[ParamSpec, ...]  # registered parameters, in ds_id (named_parameters) order
    ds_id: Mapping[str, int]
    by_name: Mapping[str, ParamSpec]
    part: Mapping[str, int]  # elements of each parameter's shard on one rank (padded)
    groups: RankGroups  # rank 0's; the other ranks' programs are relabelled (groups.py)
    dt: int  # bytes per element of the 16-bit (or fp32) parameters and gradients
    dtype: O.DType
    ag_stream: str  # all-gathers: their own stream with overlap_comm, else compute
    rs_stream: str  # reduce-scatters: likewise
    offload: bool  # offload_optimizer: cpu (fp32 master, Adam state, fp32 gradients on the host)
    hpz: int  # hpZ secondary partition size; 1 without hpZ

    @staticmethod
    def build(params: Iterable[ParamSpec], groups: RankGroups, dt: int, dtype: O.DType, overlap_comm: bool,
              offload: bool, hpz: int) -> "Zero3Layout":
        ps = tuple(params)
        n = len(groups.partition)
        return Zero3Layout(
            params=ps,
            ds_id={p.name: i for i, p in enumerate(ps)},
            by_name={p.name: p for p in ps},
            part={p.name: ceil(p.numel / n) for p in ps},
            groups=groups,
            dt=dt,
            dtype=dtype,
            ag_stream="allgather" if overlap_comm else COMPUTE,
            rs_stream="reduce" if overlap_comm else COMPUTE,
            offload=offload,
            hpz=hpz,
        )

    @property
    def n_part(self) -> int:
        """Ranks a parameter is sharded over: the world, or a MiCS shard group."""
        return len(self.groups.partition)

    def in_ds_order(self, params: Iterable[ParamSpec]) -> list[ParamSpec]:
        return sorted(params, key=lambda p: self.ds_id[p.name])

    def unique_in_ds_order(self, params: Iterable[ParamSpec]) -> list[ParamSpec]:
        """A module's parameters once each (a shared one may appear twice), by ds_id."""
        return self.in_ds_order({p.name: p for p in params}.values())
