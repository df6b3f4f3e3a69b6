"""A ``Schedule``: one training step for every rank, as programs of IR ops.

Ranks whose programs are identical share one ``Program`` (``rank_program`` maps each
global rank to an index into ``programs``), which keeps schedules of thousands of
ranks small and lets the simulator exploit the symmetry.

A program has a ``setup`` part (allocations of state that lives across steps:
parameter shards, optimizer state; run once, not timed) and a ``step`` part (one
training step; run once per measured step, so it must free what it allocates).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

from commsim.ir.ops import Alloc, HostKind, HostWork, Op, OpId

# 2: ops carry a typed phase; the meta has fields for what is not a knob
SCHEMA_VERSION = 2

KnobValue = bool | int | float | str


PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, slots=True)
class ScheduleMeta:
    """What produced a schedule, and the facts of the run it describes.

    ``knobs`` holds only the strategy's knobs (the switches a user flips, e.g. the 2022
    ZeRO-3 optimisations); ``config`` the framework settings that shaped the schedule,
    under the framework's own key names (DeepSpeed's bucket sizes, say). Everything
    else that consumers need (the world's shape, batch, precision, checkpointing,
    whether distinct programs are the same up to their groups) is a field of its own.
    """

    model: str = ""
    strategy: str = ""
    generator: str = ""
    description: str = ""
    preset: str = ""  # the knob preset the knobs started from ("" for none)
    knobs: tuple[tuple[str, KnobValue], ...] = ()
    config: tuple[tuple[str, KnobValue], ...] = ()
    nodes: int | None = None
    gpus_per_node: int | None = None
    micro_batch: int | None = None  # sequences per rank per micro-step
    seq_len: int | None = None
    grad_accum: int = 1  # micro-steps per step
    precision: str | None = None  # one of PRECISIONS; None: not stated
    checkpointing: bool = False  # layer-wise activation checkpointing
    checkpoint_style: str | None = None  # "reentrant" / "non_reentrant" when checkpointing
    # Several programs that are one program over each rank's own process groups (hpZ,
    # MiCS): the simulator may still simulate one rank for all of them.
    rank_symmetric: bool = False
    # where the host ops' durations came from (a release's table, a measured profile);
    # "" when not stated (schedules written before commsim recorded it)
    host_costs: str = ""

    def knob(self, name: str) -> KnobValue | None:
        for key, value in self.knobs:
            if key == name:
                return value
        return None

    def setting(self, name: str) -> KnobValue | None:
        """A framework setting from ``config`` (None when absent)."""
        for key, value in self.config:
            if key == name:
                return value
        return None


@dataclass(frozen=True, slots=True)
class Program:
    """One rank's ops: ``setup`` (persistent allocations) then one ``step``."""

    setup: tuple[Alloc, ...]
    step: tuple[Op, ...]

    def all_ops(self) -> Iterator[Op]:
        yield from self.setup
        yield from self.step

    def by_id(self) -> dict[OpId, Op]:
        return {op.id: op for op in self.all_ops()}


@dataclass(frozen=True, slots=True)
class Schedule:
    world_size: int
    programs: tuple[Program, ...]
    rank_program: tuple[int, ...]  # global rank -> index into programs
    meta: ScheduleMeta = field(default_factory=ScheduleMeta)
    version: int = SCHEMA_VERSION

    def program_of(self, rank: int) -> Program:
        return self.programs[self.rank_program[rank]]

    def ranks_of_program(self, index: int) -> tuple[int, ...]:
        return tuple(r for r, p in enumerate(self.rank_program) if p == index)

    def with_host_time_scaled(self, factor: float) -> "Schedule":
        """The same step on a host whose CPU takes ``factor`` times as long for each of
        its routines: every ``HostWork`` op's duration times ``factor`` (rounded to the
        nanosecond), except the host optimizer's (``HostKind.OPTIMIZER``: a CPU Adam or a
        gradient accumulation on the host is bound by the host's DRAM bandwidth, not by
        its core). Host syncs, copies and device ops are untouched."""
        assert factor > 0, factor
        if factor == 1:
            return self

        def scaled(op: Op) -> Op:
            if isinstance(op, HostWork) and op.kind is not HostKind.OPTIMIZER:
                return replace(op, duration_ns=round(op.duration_ns * factor))
            return op

        return replace(self, programs=tuple(replace(p, step=tuple(scaled(op) for op in p.step))
                                            for p in self.programs))

    @staticmethod
    def uniform(world_size: int, program: Program, meta: ScheduleMeta | None = None) -> "Schedule":
        """Every rank runs the same program."""
        return Schedule(
            world_size=world_size,
            programs=(program,),
            rank_program=(0,) * world_size,
            meta=meta or ScheduleMeta(),
        )

    @staticmethod
    def from_rank_programs(programs: list[Program], meta: ScheduleMeta | None = None) -> "Schedule":
        """Build from one program per rank, sharing equal programs."""
        unique: list[Program] = []
        index: dict[Program, int] = {}
        mapping = []
        for p in programs:
            if p not in index:
                index[p] = len(unique)
                unique.append(p)
            mapping.append(index[p])
        return Schedule(
            world_size=len(programs),
            programs=tuple(unique),
            rank_program=tuple(mapping),
            meta=meta or ScheduleMeta(),
        )
