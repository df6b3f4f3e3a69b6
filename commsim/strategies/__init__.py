"""Generators that lower a model + a framework's config into a schedule.

``generate()`` is the entry point for DeepSpeed (a config + knobs): stage 3 follows
DeepSpeed's coordinator (``zero3``); stages 0-2 its bucketed gradient reduction
(``zero12``). ``generate_fsdp2()`` lowers PyTorch FSDP2 (``fsdp2``) with its settings
(``fsdp2_config``), ``generate_fsdp1()`` PyTorch FSDP1 (``fsdp1``, ``fsdp1_config``).
``STRATEGIES`` names the front ends' choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from commsim.ir.errors import CommsimInputError
from commsim.ir.schedule import Schedule, ScheduleMeta
from commsim.models.spec import ModelDescription
from commsim.strategies.dsconfig import DeepSpeedConfig
from commsim.strategies.dsversions import CURRENT, VERSIONS, DeepSpeedVersion
from commsim.strategies.fsdp1 import FSDP1Lowering
from commsim.strategies.fsdp1_config import FSDP1Config
from commsim.strategies.fsdp2 import FSDP2Lowering
from commsim.strategies.fsdp2_config import FSDP2Config
from commsim.strategies.groups import per_rank_schedule
from commsim.strategies.knobs import PRESET_VERSIONS, HostCosts, Knobs, host_costs_for
from commsim.strategies.zero3 import Zero3Lowering
from commsim.strategies.zero12 import Zero12Lowering

GENERATOR_VERSION = "commsim.strategies 0.1"
STRATEGIES = ("deepspeed", "fsdp2", "fsdp1")
DEVICES = ("cuda", "cpu")  # what an FSDP2 model's parameters live on


@dataclass(frozen=True, slots=True)
class World:
    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.nodes <= 0 or self.gpus_per_node <= 0:
            raise CommsimInputError("--nodes and --gpus-per-node must be positive integers")

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node


def generate(md: ModelDescription, world: World, ds: DeepSpeedConfig, knobs: Knobs,
             checkpointing: bool = True, grad_accum: int = 1, costs: HostCosts | None = None,
             preset: str = "", checkpoint_style: str = "reentrant",
             version: DeepSpeedVersion | None = None, host_blocking: bool = False) -> Schedule:
    """One step of ``md`` under ``ds`` on ``world``. ZeRO-3 follows ``version`` (by
    default the release ``preset`` names, else the current one) with ``knobs``; host
    costs default to that release's measured ones. ``host_blocking``: DeepSpeed itself
    on a backend that completes collectives on the host (gloo on CPUs): its
    ``async_op=False`` collectives block the host (strategies/builder.py)."""
    stage = ds.zero.stage
    if version is None:
        version = VERSIONS[PRESET_VERSIONS[preset]] if preset in PRESET_VERSIONS else CURRENT
    lowering = None
    if stage == 3:
        costs = costs or host_costs_for(version.name)
        lowering = Zero3Lowering(md, world.size, ds, knobs, costs, checkpointing, grad_accum,
                                 checkpoint_style, world.gpus_per_node, version)
        lowering.b.host_blocking = host_blocking
        program = lowering.program()
    else:  # the ZeRO-3 knobs have nothing to act on in stages 0-2, which follow 0.19
        z12 = Zero12Lowering(md, world.size, ds, costs or host_costs_for(CURRENT.name), checkpointing, grad_accum,
                             checkpoint_style)
        z12.b.host_blocking = host_blocking
        program = z12.program()
    z = ds.zero
    meta = ScheduleMeta(
        model=md.name,
        strategy=f"zero{stage}",
        generator=GENERATOR_VERSION,
        description=f"DeepSpeed ZeRO-{stage} step of {md.name} on {world.nodes}x{world.gpus_per_node} GPUs",
        preset=preset,
        knobs=knobs.as_pairs(),
        # the DeepSpeed settings that shaped the schedule, under DeepSpeed's key names
        # (zero_optimization's; "optimizer" is the implementation that runs)
        config=(
            ("overlap_comm", z.overlap_comm), ("reduce_bucket_size", z.reduce_bucket_size),
            ("stage3_prefetch_bucket_size", z.prefetch_bucket_size),
            ("stage3_max_live_parameters", z.max_live_parameters),
            ("stage3_max_reuse_distance", z.max_reuse_distance),
            ("stage3_param_persistence_threshold", z.param_persistence_threshold),
            ("offload_optimizer.device", z.offload_optimizer.device),
            ("zero_hpz_partition_size", z.zero_hpz_partition_size), ("mics_shard_size", z.mics_shard_size),
            ("optimizer", ds.optimizer_impl), ("deepspeed", version.name if stage == 3 else CURRENT.name),
        ),
        nodes=world.nodes,
        gpus_per_node=world.gpus_per_node,
        micro_batch=md.micro_batch,
        seq_len=md.seq_len,
        grad_accum=grad_accum,
        precision=ds.precision,
        checkpointing=checkpointing,
        checkpoint_style=checkpoint_style if checkpointing else None,
    )
    if lowering is not None:
        return per_rank_schedule(world.size, program, lowering.groups_of, meta)
    return Schedule.uniform(world.size, program, meta)


def generate_fsdp2(md: ModelDescription, world: World, cfg: FSDP2Config, checkpointing: bool = True,
                   costs: HostCosts | None = None, checkpoint_style: str = "reentrant",
                   device: str = "cuda", host_blocking: bool | None = None) -> Schedule:
    """PyTorch FSDP2's step: one ``fully_shard`` per block plus the root, ``cfg``'s settings,
    on ``device`` ("cuda" or "cpu": torch's AdamW runs foreach on the one, single-tensor
    on the other, torch/optim/optimizer.py ``_default_to_fused_or_foreach``; gloo on CPU
    tensors completes FSDP2's ``async_op=False`` collectives before the call returns,
    NCCL only orders them on the stream: strategies/fsdp2_comm.py; ``host_blocking``
    None: on "cpu")."""
    if device not in DEVICES:
        raise CommsimInputError(f"device {device!r}: allowed: {', '.join(DEVICES)}")
    foreach = device == "cuda"
    lowering = FSDP2Lowering(md, world.size, cfg, costs or HostCosts(), checkpointing, checkpoint_style, foreach,
                             host_blocking=device == "cpu" if host_blocking is None else host_blocking)
    program = lowering.program()
    lay = lowering.layout
    how = f"HSDP {lay.replicas} x {lay.shard}" if lay.replicas > 1 else f"sharded over {lay.shard}"
    meta = _fsdp_meta(md, world, "fsdp2", f"PyTorch FSDP2 step of {md.name} on {world.nodes}x{world.gpus_per_node} "
                      f"GPUs ({how})", cfg.as_pairs(), foreach, cfg.gradient_accumulation_steps, cfg.param_dtype,
                      checkpointing, checkpoint_style)
    return per_rank_schedule(world.size, program, lowering.groups_of, meta)


def generate_fsdp1(md: ModelDescription, world: World, cfg: FSDP1Config, checkpointing: bool = True,
                   costs: HostCosts | None = None, checkpoint_style: str = "reentrant",
                   device: str = "cuda", host_blocking: bool | None = None) -> Schedule:
    """PyTorch FSDP1's step (``FullyShardedDataParallel`` on every block and the root),
    ``cfg``'s settings, on ``device`` (as ``generate_fsdp2``). The rate limiter's queue
    outlives a step: the steady-state step starts with as many (long complete) free
    events queued as the step before left, found by lowering until that count repeats."""
    if device not in DEVICES:
        raise CommsimInputError(f"device {device!r}: allowed: {', '.join(DEVICES)}")
    foreach = device == "cuda"
    blocking = device == "cpu" if host_blocking is None else host_blocking
    stale = 0
    for _ in range(8):
        lowering = FSDP1Lowering(md, world.size, world.gpus_per_node, cfg, costs or HostCosts(), checkpointing,
                                 checkpoint_style, foreach, blocking, stale)
        program = lowering.program()
        if len(lowering.queue) == stale:
            break
        stale = len(lowering.queue)
    lay = lowering.layout
    how = f", {lay.replicas} replicas" if lay.replicas > 1 else ""
    meta = _fsdp_meta(md, world, "fsdp1", f"PyTorch FSDP1 ({cfg.sharding_strategy}) step of {md.name} on "
                      f"{world.nodes}x{world.gpus_per_node} GPUs (sharded over {lay.shard}{how})", cfg.as_pairs(),
                      foreach, cfg.gradient_accumulation_steps, cfg.param_dtype, checkpointing, checkpoint_style)
    return per_rank_schedule(world.size, program, lowering.groups_of, meta)


def _fsdp_meta(md: ModelDescription, world: World, strategy: str, description: str, settings, foreach: bool,
               grad_accum: int, precision: str, checkpointing: bool, checkpoint_style: str) -> ScheduleMeta:
    """An FSDP schedule's meta: the settings that shaped it under their config keys (unset
    ones left out) and the optimizer that runs."""
    return ScheduleMeta(
        model=md.name, strategy=strategy, generator=GENERATOR_VERSION, description=description,
        config=tuple((k, v) for k, v in settings if v is not None)
        + (("optimizer", "torch" if foreach else "torch single-tensor"),),
        nodes=world.nodes, gpus_per_node=world.gpus_per_node, micro_batch=md.micro_batch, seq_len=md.seq_len,
        grad_accum=grad_accum, precision=precision, checkpointing=checkpointing,
        checkpoint_style=checkpoint_style if checkpointing else None)


__all__ = ["STRATEGIES", "World", "generate", "generate_fsdp1", "generate_fsdp2", "GENERATOR_VERSION"]
