"""The local validation's grid: each row's model, ranks, framework settings and runner,
the settings file its framework reads and the scenario commsim predicts it with. Read by
bench/validate_local.py (which runs the rows), bench/repredict_local.py and
notebooks/04_predicted_vs_measured.ipynb."""

from __future__ import annotations

from dataclasses import dataclass

from commsim.api import Scenario


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    ranks: int
    zero: dict
    preset: str = "optimized"
    micro: int = 4
    seq: int = 128
    runner: str = "executor"  # executor | deepspeed | fsdp2 | fsdp1 | slow-link | fast-link
    fsdp: dict | None = None  # FSDP settings: the row runs real FSDP2 (fsdp2, or over a link) or FSDP1
    fsdp1: bool = False  # with fsdp: FSDP1 (FullyShardedDataParallel) and its settings
    bf16: bool = False  # DeepSpeed rows: bf16 mixed precision (fp32 master weights and optimizer)


GRID = [
    Row("small z3 opt", "small", 2, {"stage": 3}),
    Row("small z3 baseline", "small", 2, {"stage": 3}, preset="baseline"),
    Row("small z2", "small", 2, {"stage": 2}),
    Row("small z3 small buckets", "small", 2, {"stage": 3, "reduce_bucket_size": 200000,
                                               "stage3_prefetch_bucket_size": 100000}),
    Row("small z3 nothing live", "small", 2, {"stage": 3, "stage3_param_persistence_threshold": 0,
                                              "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}),
    Row("medium z3 opt", "medium", 2, {"stage": 3}, micro=2),
    Row("medium z2", "medium", 2, {"stage": 2}, micro=2),
    Row("small z3 opt x4", "small", 4, {"stage": 3}, micro=2),
    Row("small z2 x4", "small", 4, {"stage": 2}, micro=2),
    Row("small z3 baseline x4", "small", 4, {"stage": 3}, preset="baseline", micro=2),
    # real DeepSpeed (0.19.8): predicted with the preset that models it
    Row("DS small z3", "small", 2, {"stage": 3}, preset="current", micro=2, runner="deepspeed"),
    Row("DS small z2", "small", 2, {"stage": 2}, preset="current", micro=2, runner="deepspeed"),
    Row("DS small z3 nothing live", "small", 2, {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                 "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0},
        preset="current", micro=2, runner="deepspeed"),
    # bf16 on a CPU: GEMMs, and each class of the non-GEMM kernels, in their own dtype
    Row("DS small z2 bf16", "small", 2, {"stage": 2}, preset="current", micro=2, runner="deepspeed", bf16=True),
    # real DeepSpeed on the two other families (not the model whose hooks calibration
    # times), ZeRO-2 and ZeRO-3 with small buckets: many collectives and bucket flushes
    Row("DS small-gpt2 z2 small buckets", "small-gpt2", 2, {"stage": 2, "reduce_bucket_size": 500000,
                                                             "allgather_bucket_size": 500000},
        preset="current", micro=2, runner="deepspeed"),
    Row("DS small-gpt2 z3 small buckets", "small-gpt2", 2, {"stage": 3, "reduce_bucket_size": 200000,
                                                             "stage3_prefetch_bucket_size": 100000},
        preset="current", micro=2, runner="deepspeed"),
    Row("DS small-llama z2 small buckets", "small-llama", 2, {"stage": 2, "reduce_bucket_size": 500000,
                                                               "allgather_bucket_size": 500000},
        preset="current", micro=2, runner="deepspeed"),
    Row("DS small-llama z3 small buckets", "small-llama", 2, {"stage": 3, "reduce_bucket_size": 200000,
                                                               "stage3_prefetch_bucket_size": 100000},
        preset="current", micro=2, runner="deepspeed"),
    # real PyTorch FSDP2 (fp32, FSDP2's defaults; checkpointing as the other rows)
    Row("FSDP2 small", "small", 2, {}, micro=2, runner="fsdp2", fsdp={}),
    Row("FSDP2 small no reshard", "small", 2, {}, micro=2, runner="fsdp2", fsdp={"reshard_after_forward": False}),
    # real PyTorch FSDP1 (fp32, FSDP1's defaults: FULL_SHARD, rate limiter, BACKWARD_PRE)
    Row("FSDP1 small", "small", 2, {}, micro=2, runner="fsdp1", fsdp={}, fsdp1=True),
    # Two ranks in separate network namespaces joined by a veth pair: rate-limited with tc
    # (the local stand-in for EFA) or not (a fast fabric). Root only; skipped otherwise.
    Row("small z3 opt slow link", "small", 2, {"stage": 3}, runner="slow-link"),
    Row("small z3 baseline slow link", "small", 2, {"stage": 3}, preset="baseline", runner="slow-link"),
    Row("small z2 slow link", "small", 2, {"stage": 2}, runner="slow-link"),
    Row("small z3 opt fast link", "small", 2, {"stage": 3}, runner="fast-link"),
    Row("FSDP2 small slow link", "small", 2, {}, micro=2, runner="slow-link", fsdp={}),
]
# tc token-bucket rate of each emulated link (None: the veth pair unlimited). 1 Gbit/s
# makes the small model's ZeRO-3 step communication-bound on this machine.
LINK_RATE = {"slow-link": "1gbit", "fast-link": None}


def row_key(row: Row):
    """What a row's calibration depends on: its rank count, or its emulated link."""
    return row.runner if row.runner in LINK_RATE else row.ranks


def ds_config(row: Row) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": row.micro, "zero_optimization": row.zero}
    return {**cfg, "bf16": {"enabled": True}} if row.bf16 else cfg


def row_config(row: Row) -> dict:
    """The settings file a row's framework reads: FSDP2's, or DeepSpeed's."""
    return row.fsdp if row.fsdp is not None else ds_config(row)


def scenario(row: Row, cfg: str | dict, **kw) -> Scenario:
    if row.fsdp is not None:
        return Scenario(model=row.model, nodes=1, gpus_per_node=row.ranks, strategy="fsdp1" if row.fsdp1 else "fsdp2",
                        fsdp_config=cfg,
                        micro_batch=row.micro, seq=row.seq, **kw)
    return Scenario(model=row.model, nodes=1, gpus_per_node=row.ranks, ds_config=cfg, seq=row.seq,
                    preset=row.preset, **kw)
