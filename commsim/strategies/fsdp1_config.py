"""FSDP1 settings, read from a small JSON object whose keys follow ``FullyShardedDataParallel``'s arguments.

The model is wrapped the usual way: ``FullyShardedDataParallel`` around every transformer
block (an auto-wrap policy on the block class), then around the whole model (the root:
embeddings, final norm, LM head), ``use_orig_params`` either way (it changes no device
work). The keys, with torch 2.13's defaults (torch/distributed/fsdp/
fully_sharded_data_parallel.py ``FullyShardedDataParallel.__init__``, api.py):

* ``sharding_strategy`` ("FULL_SHARD"): ``FULL_SHARD`` frees the blocks' gathered
  parameters after forward and gathers them again in backward; ``SHARD_GRAD_OP`` keeps
  them until the block's post-backward; ``HYBRID_SHARD`` is ``FULL_SHARD`` inside a node
  with the reduced shards all-reduced across the nodes; ``NO_SHARD`` keeps every
  parameter on every rank and all-reduces each unit's gradient (DDP's work, FSDP's
  hooks);
* ``mp_param_dtype`` / ``mp_reduce_dtype`` (null): ``MixedPrecision``'s ``param_dtype``
  (compute and all-gather dtype) and ``reduce_dtype`` (null: the param dtype);
* ``limit_all_gathers`` (true): the rate limiter, the host waiting for a free two
  back before it issues an all-gather (_runtime_utils.py ``_unshard``);
* ``backward_prefetch`` ("BACKWARD_PRE"): the next unit's all-gather issued in the
  current unit's pre-backward hook; "BACKWARD_POST" in its post-backward hook; null
  none;
* ``gradient_accumulation_steps`` (1): forward and backward this many times a step,
  the optimizer once; ``no_sync`` (false): every micro-step but the last runs inside
  ``model.no_sync()`` (what Hugging Face Accelerate does under FSDP1 unless told to
  sync each batch), so the unsharded gradients accumulate and are reduced once;
  without it each micro-step reduces and the shards accumulate;
* ``forward_prefetch`` (false): each unit's pre-forward gathers the next unit of the
  first iteration's forward order after its own wait.

Not modelled (refused with the key named): CPU offload; gradient accumulation under
``NO_SHARD``. Activation checkpointing is the scenario's, as Hugging Face places it:
around each block's call, outside its FSDP unit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from commsim.ir.errors import CommsimInputError
from commsim.strategies.fsdp2_config import _DTYPES
from commsim.util.files import read_json

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", None)


@dataclass(frozen=True, slots=True)
class FSDP1Config:
    sharding_strategy: str = "FULL_SHARD"
    mp_param_dtype: str | None = None  # "bf16" | "fp16" | "fp32" | None
    mp_reduce_dtype: str | None = None
    limit_all_gathers: bool = True
    backward_prefetch: str | None = "BACKWARD_PRE"
    gradient_accumulation_steps: int = 1
    no_sync: bool = False
    forward_prefetch: bool = False
    source: str = "fsdp_config"  # the file (or "fsdp_config"), named in errors found later

    @property
    def param_dtype(self) -> str:
        """Compute and all-gather dtype; the flat parameters themselves stay fp32."""
        return self.mp_param_dtype or "fp32"

    @property
    def reduce_dtype(self) -> str:
        return self.mp_reduce_dtype or self.param_dtype

    @property
    def reshard_after_forward(self) -> bool:
        """RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES (_init_utils.py)."""
        return self.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")

    def shard_size(self, world: int, gpus_per_node: int) -> int:
        """HYBRID_SHARD shards inside a node (_init_utils.py ``_init_intra_and_inter_node_groups``);
        NO_SHARD keeps every parameter on every rank."""
        return {"HYBRID_SHARD": gpus_per_node, "NO_SHARD": 1}.get(self.sharding_strategy, world)

    def as_pairs(self) -> tuple[tuple[str, Any], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "source")


_NOT_MODELLED = {"cpu_offload": False}


def parse_fsdp1_config(obj: Any, where: str = "fsdp_config") -> FSDP1Config:
    """Settings from a parsed JSON object; a clear error naming the key otherwise."""
    if not isinstance(obj, dict):
        raise CommsimInputError(f"{where}: must be a JSON object of FullyShardedDataParallel settings")
    names = {f.name for f in fields(FSDP1Config)} - {"source"}
    values: dict[str, Any] = {}
    for key, v in obj.items():
        if key in _NOT_MODELLED:
            if v != _NOT_MODELLED[key]:
                raise CommsimInputError(f"{where}: {key} {v!r}: not modelled for FSDP1 (only "
                                        f"{_NOT_MODELLED[key]!r})")
            continue
        if key not in names:
            raise CommsimInputError(f"{where}: {key}: unknown; allowed: {', '.join(sorted(names | set(_NOT_MODELLED)))}")
        if key == "sharding_strategy":
            if v not in STRATEGIES:
                raise CommsimInputError(f"{where}: sharding_strategy {v!r}: allowed: {', '.join(STRATEGIES)}")
        elif key in ("mp_param_dtype", "mp_reduce_dtype"):
            if v is not None and v not in _DTYPES:
                raise CommsimInputError(f"{where}: {key} {v!r}: allowed: null, {', '.join(_DTYPES)}")
            v = None if v is None else _DTYPES[v]
        elif key in ("limit_all_gathers", "no_sync", "forward_prefetch"):
            if not isinstance(v, bool):
                raise CommsimInputError(f"{where}: {key} {v!r}: true or false")
        elif key == "gradient_accumulation_steps":
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CommsimInputError(f"{where}: gradient_accumulation_steps {v!r}: an integer >= 1")
        elif key == "backward_prefetch":
            if v not in PREFETCH:
                raise CommsimInputError(f"{where}: backward_prefetch {v!r}: allowed: \"BACKWARD_PRE\", "
                                        "\"BACKWARD_POST\", null")
        values[key] = v
    cfg = FSDP1Config(**values, source=where)
    if cfg.sharding_strategy == "NO_SHARD" and cfg.gradient_accumulation_steps > 1:
        raise CommsimInputError(f"{where}: gradient_accumulation_steps {cfg.gradient_accumulation_steps} with "
                                "sharding_strategy NO_SHARD: not modelled (only 1)")
    return cfg


def load_fsdp1_config(path: str | Path) -> FSDP1Config:
    return parse_fsdp1_config(read_json(str(path), CommsimInputError), str(path))
