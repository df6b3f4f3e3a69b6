"""A real DeepSpeed config JSON, read with DeepSpeed's key names and defaults.

Defaults and rules follow deepspeed/runtime/zero/config.py (0.19.x): the
``zero_optimization`` section forbids unknown keys (DeepSpeed's pydantic models use
``extra="forbid"``) and accepts both the ``stage3_``-prefixed aliases and the plain
field names; ``overlap_comm`` defaults to true for stage 3 only; the model-wide
persistence budget is divided among the partitions (partition_parameters.py,
``Init._update_persist_config``). Top-level keys commsim does not use are reported as
warnings, the way DeepSpeed ignores keys it does not know.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commsim.ir.errors import CommsimInputError
from commsim.util.files import read_json

# zero_optimization fields: name -> (aliases, default, kind)
_ZERO_FIELDS: dict[str, tuple[tuple[str, ...], Any, str]] = {
    "stage": ((), 0, "stage"),
    "contiguous_gradients": ((), True, "bool"),
    "reduce_scatter": ((), True, "bool"),
    "reduce_bucket_size": ((), int(5e8), "pos"),
    "use_multi_rank_bucket_allreduce": ((), True, "bool"),
    "allgather_partitions": ((), True, "bool"),
    "allgather_bucket_size": ((), int(5e8), "nonneg"),
    "overlap_comm": ((), None, "bool?"),
    "compute_grad_norm": ((), True, "bool"),
    "load_from_fp32_weights": ((), True, "bool"),
    "elastic_checkpoint": ((), False, "bool"),
    "offload_param": ((), None, "offload"),
    "offload_optimizer": ((), None, "offload"),
    "sub_group_size": ((), int(1e9), "nonneg"),
    "prefetch_bucket_size": (("stage3_prefetch_bucket_size",), int(5e7), "nonneg"),
    "param_persistence_threshold": (("stage3_param_persistence_threshold",), int(1e5), "nonneg"),
    "model_persistence_threshold": (("stage3_model_persistence_threshold",), sys.maxsize, "nonneg"),
    "max_live_parameters": (("stage3_max_live_parameters",), int(1e9), "nonneg"),
    "max_reuse_distance": (("stage3_max_reuse_distance",), int(1e9), "nonneg"),
    "gather_16bit_weights_on_model_save": (("stage3_gather_16bit_weights_on_model_save",
                                            "stage3_gather_fp16_weights_on_model_save"), False, "bool"),
    "module_granularity_threshold": (("stage3_module_granularity_threshold",), 0, "nonneg"),
    "use_all_reduce_for_fetch_params": (("stage3_use_all_reduce_for_fetch_params",), False, "bool"),
    "allgather_sequential": (("stage3_allgather_sequential",), False, "bool"),
    "ignore_unused_parameters": ((), True, "bool"),
    "legacy_stage1": ((), False, "bool"),
    "round_robin_gradients": ((), False, "bool"),
    "parameter_alignment": ((), False, "bool"),
    "zero_hpz_partition_size": ((), 1, "nonneg"),
    "zero_quantized_weights": ((), False, "bool"),
    "zero_quantized_nontrainable_weights": ((), False, "bool"),
    "zero_quantized_gradients": ((), False, "bool"),
    "mics_shard_size": ((), -1, "int"),
    "mics_hierarchical_params_gather": ((), False, "bool"),
    "memory_efficient_linear": ((), True, "bool"),
    "pipeline_loading_checkpoint": ((), False, "bool"),
    "override_module_apply": ((), True, "bool"),
    "log_trace_cache_warnings": ((), False, "bool"),
    "enable_sanity_checks": ((), False, "bool"),
    "cpu_offload": ((), None, "bool?"),
    "cpu_offload_param": ((), None, "bool?"),
    "cpu_offload_use_pin_memory": ((), None, "bool?"),
}
_ZERO_ALIASES = {alias: name for name, (aliases, _, _) in _ZERO_FIELDS.items() for alias in aliases}

# Top-level keys DeepSpeed knows that do not change the communication schedule.
_KNOWN_UNUSED_TOP = {
    "scheduler", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
    "communication_data_type", "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "amp",
    "flops_profiler", "comms_logger", "tensorboard", "wandb", "csv_monitor", "dump_state", "checkpoint",
    "data_types", "compression_training", "aio", "zero_force_ds_cpu_optimizer", "memory_breakdown",
    "train_batch_size", "seed", "disable_allgather", "torch_autocast", "compile", "monitor_config",
    "log_level",  # runtime/constants.py LOG_LEVEL (0.19.8)
}
# Blocks DeepSpeed 0.19.8 refuses (runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS); older
# versions accepted them. commsim warns rather than refusing: the schedule does not
# depend on them, and the config may be meant for an older DeepSpeed.
_REMOVED_TOP = {"elasticity", "sparse_attention", "eigenvalue", "progressive_layer_drop", "curriculum_learning",
                "graph_harvesting"}
_USED_TOP = {"optimizer", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16", "bfloat16", "fp16",
             "gradient_clipping", "zero_optimization", "activation_checkpointing"}


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    device: str = "none"  # none | cpu | nvme
    pin_memory: bool = False


@dataclass(frozen=True, slots=True)
class ZeroConfig:
    stage: int = 0
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = int(5e8)
    allgather_bucket_size: int = int(5e8)
    prefetch_bucket_size: int = int(5e7)
    param_persistence_threshold: int = int(1e5)
    model_persistence_threshold: int = sys.maxsize
    max_live_parameters: int = int(1e9)
    max_reuse_distance: int = int(1e9)
    sub_group_size: int = int(1e9)
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    zero_hpz_partition_size: int = 1
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False


@dataclass(frozen=True, slots=True)
class DeepSpeedConfig:
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int = 1
    train_batch_size: int | None = None
    precision: str = "fp32"  # fp32 | bf16 | fp16
    # ZeRO-1/2's overflow check before the step (engine._configure_zero_optimizer): fp16
    # always, bf16 unless bf16.check_grad_overflow is false, fp32 never
    check_grad_overflow: bool = False
    gradient_clipping: float = 0.0
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    activation_checkpointing: dict[str, Any] | None = None
    # "fused": an optimizer section, so DeepSpeed's own fused Adam; "torch": none, so
    # the script's client optimizer, taken to be torch.optim.AdamW (strategies/optimizer.py)
    optimizer_impl: str = "fused"
    warnings: tuple[str, ...] = ()
    source: str = "ds_config"  # the file (or "ds_config"): names it in errors found later

    @property
    def param_dtype_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


def _bad(where: str, key: str, msg: str) -> CommsimInputError:
    return CommsimInputError(f"{where}: {key}: {msg}")


def _typed(where: str, key: str, value: Any, kind: str) -> Any:
    if kind in ("bool", "bool?"):
        if value is None and kind == "bool?":
            return None
        if not isinstance(value, bool):
            raise _bad(where, key, f"must be true or false, got {value!r}")
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # DeepSpeed configs write 5e8
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(where, key, f"must be an integer, got {value!r}")
    if kind == "pos" and value <= 0:
        raise _bad(where, key, f"must be > 0, got {value}")
    if kind == "nonneg" and value < 0:
        raise _bad(where, key, f"must be >= 0, got {value}")
    if kind == "stage" and value not in (0, 1, 2, 3):
        raise _bad(where, key, f"must be 0, 1, 2 or 3, got {value}")
    return value


def _offload(where: str, key: str, value: Any) -> OffloadConfig:
    if value is None:
        return OffloadConfig()
    if not isinstance(value, dict):
        raise _bad(where, key, "must be an object like {\"device\": \"cpu\"}")
    device = value.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise _bad(where, f"{key}.device", f"must be one of none, cpu, nvme, got {device!r}")
    return OffloadConfig(device=device, pin_memory=bool(value.get("pin_memory", False)))


def parse_zero(obj: Any, where: str) -> ZeroConfig:
    if obj is None:
        obj = {}
    if not isinstance(obj, dict):
        raise _bad(where, "zero_optimization", "must be an object")
    values: dict[str, Any] = {}
    for raw_key, value in obj.items():
        name = _ZERO_ALIASES.get(raw_key, raw_key)
        if name not in _ZERO_FIELDS:
            raise _bad(where, f"zero_optimization.{raw_key}",
                       "unknown key (DeepSpeed rejects it too); see deepspeed/runtime/zero/config.py")
        if name in values:
            raise _bad(where, f"zero_optimization.{raw_key}", f"given twice (also as {name!r})")
        kind = _ZERO_FIELDS[name][2]
        values[name] = _offload(where, f"zero_optimization.{raw_key}", value) if kind == "offload" else \
            _typed(where, f"zero_optimization.{raw_key}", value, kind)
    stage = values.get("stage", 0)
    overlap = values.get("overlap_comm")
    if overlap is None:
        overlap = stage == 3  # DeepSpeed's dynamic default
    if values.get("cpu_offload"):
        raise _bad(where, "zero_optimization.cpu_offload", "deprecated; use offload_optimizer: {\"device\": \"cpu\"}")
    kw = {k: v for k, v in values.items() if k in ZeroConfig.__dataclass_fields__ and v is not None}
    kw["overlap_comm"] = overlap
    kw["stage"] = stage
    zero = ZeroConfig(**kw)
    if zero.offload_param.device != "none":
        where_key = "zero_optimization.offload_param"
        if stage != 3:
            raise _bad(where, where_key, f"needs stage 3 (stage is {stage})")
        raise _bad(where, where_key, "parameter offload is not modelled yet; allowed: device none "
                   "(offload_optimizer with device cpu is modelled)")
    if zero.offload_optimizer.device == "nvme":
        raise _bad(where, "zero_optimization.offload_optimizer.device",
                   "nvme is not modelled yet; allowed: none, cpu")
    if zero.offload_optimizer.device == "cpu" and stage == 0:
        raise _bad(where, "zero_optimization.offload_optimizer", "needs stage 1, 2 or 3 (stage is 0)")
    if zero.zero_hpz_partition_size > 1 and stage != 3:
        raise _bad(where, "zero_optimization.zero_hpz_partition_size", f"needs stage 3 (stage is {stage})")
    if zero.mics_shard_size > 0 and stage != 3:
        raise _bad(where, "zero_optimization.mics_shard_size", f"needs stage 3 (stage is {stage})")
    if zero.mics_shard_size == 0 or zero.mics_shard_size < -1:
        raise _bad(where, "zero_optimization.mics_shard_size", f"must be -1 (off) or >= 1, got {zero.mics_shard_size}")
    if zero.mics_shard_size > 0 and zero.offload_optimizer.device != "none":
        # mics.py allreduce_mics_shard_grads: "Local sharding has no support for CPU offloading"
        raise _bad(where, "zero_optimization.mics_shard_size", "cannot be combined with offload_optimizer "
                   "(DeepSpeed's MiCS has no CPU offload)")
    if zero.zero_hpz_partition_size > 1 and zero.mics_shard_size > 0:
        raise _bad(where, "zero_optimization.mics_shard_size", "cannot be combined with zero_hpz_partition_size")
    return zero


def parse_ds_config(obj: Any, where: str = "ds_config") -> DeepSpeedConfig:
    if not isinstance(obj, dict):
        raise CommsimInputError(f"{where}: a DeepSpeed config is one JSON object")
    warnings = [f"{where}: {k}: not a DeepSpeed key commsim knows; ignored"
                for k in obj if k not in _USED_TOP and k not in _KNOWN_UNUSED_TOP and k not in _REMOVED_TOP]
    warnings += [f"{where}: {k}: removed in DeepSpeed 0.19.8, which refuses it (older versions accept it); "
                 "ignored" for k in obj if k in _REMOVED_TOP]
    zero_obj = obj.get("zero_optimization")
    if isinstance(zero_obj, dict) and any(k in zero_obj for k in ("mics_shard_size", "mics_hierarchical_params_gather")):
        warnings.append(f"{where}: zero_optimization.mics_shard_size: MiCS was removed in DeepSpeed 0.19.8, which "
                        "refuses the key; commsim models MiCS as DeepSpeed 0.9-0.18 ran it")
    bf16 = obj.get("bf16", obj.get("bfloat16", {})) or {}
    fp16 = obj.get("fp16", {}) or {}
    for key, sect in (("bf16", bf16), ("fp16", fp16)):
        if not isinstance(sect, dict):
            raise _bad(where, key, "must be an object like {\"enabled\": true}")
    if bf16.get("enabled") and fp16.get("enabled"):
        raise _bad(where, "bf16.enabled", "cannot be combined with fp16.enabled (DeepSpeed refuses both)")
    precision = "bf16" if bf16.get("enabled") else "fp16" if fp16.get("enabled") else "fp32"
    check_overflow = bf16.get("check_grad_overflow", True)
    if not isinstance(check_overflow, bool):
        raise _bad(where, "bf16.check_grad_overflow", f"must be true or false, got {check_overflow!r}")
    micro = obj.get("train_micro_batch_size_per_gpu")
    if micro is not None:
        micro = _typed(where, "train_micro_batch_size_per_gpu", micro, "pos")
    gas = _typed(where, "gradient_accumulation_steps", obj.get("gradient_accumulation_steps", 1), "pos")
    tbs = obj.get("train_batch_size")
    if tbs is not None:
        tbs = _typed(where, "train_batch_size", tbs, "pos")
    clip = obj.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise _bad(where, "gradient_clipping", f"must be a number >= 0, got {clip!r}")
    opt = obj.get("optimizer")
    if opt is not None:
        if not isinstance(opt, dict) or not isinstance(opt.get("type"), str):
            raise _bad(where, "optimizer", "must be an object with a \"type\", like {\"type\": \"AdamW\"}")
        if opt["type"].lower() not in ("adam", "adamw", "fusedadam", "cpuadam"):
            warnings.append(f"{where}: optimizer.type: {opt['type']!r} is modelled with Adam's memory traffic")
    ac = obj.get("activation_checkpointing")
    if ac is not None and not isinstance(ac, dict):
        raise _bad(where, "activation_checkpointing", "must be an object")
    return DeepSpeedConfig(
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        train_batch_size=tbs,
        precision=precision,
        check_grad_overflow=precision == "fp16" or (precision == "bf16" and check_overflow),
        gradient_clipping=float(clip),
        zero=parse_zero(obj.get("zero_optimization"), where),
        activation_checkpointing=ac,
        optimizer_impl="fused" if opt is not None else "torch",
        warnings=tuple(warnings),
        source=where,
    )


def load_ds_config(path: str | Path) -> DeepSpeedConfig:
    return parse_ds_config(read_json(path, CommsimInputError), str(path))


def check_batch(cfg: DeepSpeedConfig, world_size: int, where: str = "ds_config") -> tuple[int, int]:
    """(micro-batch, accumulation steps), checked as DeepSpeed checks train_batch_size."""
    micro, gas, tbs = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size
    if micro is None and tbs is not None:
        if tbs % (gas * world_size):
            raise _bad(where, "train_batch_size", f"{tbs} is not divisible by gradient_accumulation_steps x world size")
        micro = tbs // (gas * world_size)
    if micro is None:
        micro = 1
    if tbs is not None and tbs != micro * gas * world_size:
        raise _bad(where, "train_batch_size",
                   f"{tbs} != micro-batch {micro} x accumulation {gas} x world size {world_size}")
    return micro, gas
