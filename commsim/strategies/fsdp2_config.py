"""FSDP2 settings, read from a small JSON object whose keys follow ``fully_shard``'s arguments.

The model is wrapped the usual way: ``fully_shard(block, ...)`` on every transformer
block, then ``fully_shard(model, ...)`` on the root (embeddings, final norm, LM head).
The keys, with FSDP2's defaults (torch/distributed/fsdp/_fully_shard/_fully_shard.py
``fully_shard``, _fsdp_api.py ``MixedPrecisionPolicy`` / ``CPUOffloadPolicy``):

* ``reshard_after_forward`` (true): the blocks' argument: true frees the gathered
  parameters after forward and gathers them again in backward; false keeps them;
  an int k (a divisor of the shard group) keeps a 1/k shard over k consecutive ranks
  and gathers over those k in backward;
* ``root_reshard_after_forward`` (null): the root's argument; null is FSDP2's
  default, which keeps the root gathered (``FSDPState._lazy_init``);
* ``mp_param_dtype`` / ``mp_reduce_dtype`` (null): ``MixedPrecisionPolicy``'s
  ``param_dtype`` (compute and all-gather dtype) and ``reduce_dtype`` (gradient
  reduction dtype); null keeps the parameters' own dtype, fp32;
* ``offload`` (false), ``offload_pin_memory`` (true): ``CPUOffloadPolicy(pin_memory)``;
* ``hsdp_replicas`` (1): HSDP's 2-D mesh ``(hsdp_replicas, world / hsdp_replicas)``:
  shard over consecutive ranks (a node), all-reduce across the replicas;
* ``forward_prefetch`` (0): each block prefetches the next N blocks explicitly
  (``set_modules_to_forward_prefetch``); 0 leaves FSDP2's implicit prefetching;
* ``backward_prefetch`` (0): each block prefetches the previous N blocks explicitly
  (``set_modules_to_backward_prefetch``); 0 leaves FSDP2's default (the previous
  module in post-forward order);
* ``gradient_accumulation_steps`` (1) and ``requires_gradient_sync`` (true): with
  false, ``set_requires_gradient_sync(False)`` on every micro-step but the last, so
  gradients accumulate unsharded and are reduced once.

Activation checkpointing is the scenario's (``--no-checkpointing``,
``--checkpoint-style``), as for DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from commsim.ir.errors import CommsimInputError
from commsim.util.files import read_json

# the dtype names a config may use, and the one commsim writes
_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
           "fp32": "fp32", "float32": "fp32", "float": "fp32"}


@dataclass(frozen=True, slots=True)
class FSDP2Config:
    reshard_after_forward: bool | int = True
    root_reshard_after_forward: bool | int | None = None
    mp_param_dtype: str | None = None  # "bf16" | "fp16" | "fp32" | None
    mp_reduce_dtype: str | None = None
    offload: bool = False
    offload_pin_memory: bool = True
    hsdp_replicas: int = 1
    forward_prefetch: int = 0
    backward_prefetch: int = 0
    gradient_accumulation_steps: int = 1
    requires_gradient_sync: bool = True
    source: str = "fsdp_config"  # the file (or "fsdp_config"), named in errors found later

    @property
    def orig_dtype(self) -> str:
        """The parameters' own dtype: the sharded parameters, the optimizer's."""
        return "fp32"

    @property
    def param_dtype(self) -> str:
        """Compute and all-gather dtype (``FSDPParam.init_dtype_attrs``)."""
        return self.mp_param_dtype or self.orig_dtype

    @property
    def reduce_dtype(self) -> str:
        """Gradient reduction dtype: ``reduce_dtype``, else the gradients' (param) dtype."""
        return self.mp_reduce_dtype or self.param_dtype

    def as_pairs(self) -> tuple[tuple[str, Any], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "source")

    def to_json(self) -> dict[str, Any]:
        return dict(self.as_pairs())


KEYS = tuple(f.name for f in fields(FSDP2Config) if f.name != "source")


def _bad(where: str, key: str, msg: str) -> CommsimInputError:
    return CommsimInputError(f"{where}: {key}: {msg}")


def _bool(where: str, key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _bad(where, key, f"must be true or false, got {v!r}")
    return v


def _int(where: str, key: str, v: Any, low: int) -> int:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise _bad(where, key, f"must be an integer >= {low}, got {v!r}")
    return v


def _reshard(where: str, key: str, v: Any, allow_null: bool) -> bool | int | None:
    if v is None and allow_null:
        return None
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v >= 1:
        return v
    raise _bad(where, key, f"must be true, false{', null' if allow_null else ''} or a group size >= 1, got {v!r}")


def _dtype(where: str, key: str, v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or v.lower() not in _DTYPES:
        raise _bad(where, key, f"must be null or one of bf16, fp16, fp32, got {v!r}")
    return _DTYPES[v.lower()]


def parse_fsdp_config(obj: Any, where: str = "fsdp_config") -> FSDP2Config:
    """An ``FSDP2Config`` from a JSON object (unknown keys refused, with the allowed ones)."""
    if obj is None:
        obj = {}
    if not isinstance(obj, dict):
        raise CommsimInputError(f"{where}: an FSDP2 config is one JSON object, like "
                                "{\"reshard_after_forward\": true}")
    for k in obj:
        if k not in KEYS:
            raise _bad(where, k, f"unknown key; allowed: {', '.join(KEYS)}")
    g = obj.get
    return FSDP2Config(
        reshard_after_forward=_reshard(where, "reshard_after_forward", g("reshard_after_forward", True), False),
        root_reshard_after_forward=_reshard(where, "root_reshard_after_forward", g("root_reshard_after_forward"), True),
        mp_param_dtype=_dtype(where, "mp_param_dtype", g("mp_param_dtype")),
        mp_reduce_dtype=_dtype(where, "mp_reduce_dtype", g("mp_reduce_dtype")),
        offload=_bool(where, "offload", g("offload", False)),
        offload_pin_memory=_bool(where, "offload_pin_memory", g("offload_pin_memory", True)),
        hsdp_replicas=_int(where, "hsdp_replicas", g("hsdp_replicas", 1), 1),
        forward_prefetch=_int(where, "forward_prefetch", g("forward_prefetch", 0), 0),
        backward_prefetch=_int(where, "backward_prefetch", g("backward_prefetch", 0), 0),
        gradient_accumulation_steps=_int(where, "gradient_accumulation_steps", g("gradient_accumulation_steps", 1), 1),
        requires_gradient_sync=_bool(where, "requires_gradient_sync", g("requires_gradient_sync", True)),
        source=where,
    )


def load_fsdp_config(path: str | Path) -> FSDP2Config:
    return parse_fsdp_config(read_json(path, CommsimInputError), str(path))


def shard_size(cfg: FSDP2Config, world_size: int) -> int:
    """Ranks a parameter is sharded over (the mesh's shard dimension), checked as
    ``fully_shard`` and ``init_device_mesh`` check it."""
    r = cfg.hsdp_replicas
    if world_size % r:
        raise _bad(cfg.source, "hsdp_replicas", f"{r} must divide the world size {world_size}")
    s = world_size // r
    if s < 2:
        raise _bad(cfg.source, "hsdp_replicas", f"{r} leaves {s} rank per shard group; commsim models sharding "
                   "over at least 2 ranks (use fewer replicas)")
    for key in ("reshard_after_forward", "root_reshard_after_forward"):
        v = getattr(cfg, key)
        # _fsdp_init._get_post_forward_mesh_info: an int must divide the shard group
        if isinstance(v, int) and not isinstance(v, bool) and (v > s or s % v):
            raise _bad(cfg.source, key, f"{v} must divide the shard group size {s} (world {world_size} / "
                       f"hsdp_replicas {r}), as fully_shard requires")
    return s


def post_forward_size(v: bool | int | None, is_root: bool, shard: int) -> int | None:
    """The group a unit stays sharded over between forward and backward, as
    ``_get_post_forward_mesh_info`` resolves ``reshard_after_forward``: None when it
    stays gathered (False, the int 1, or the root's default), ``shard`` for True (or
    the shard size as an int), else the int."""
    if v is None:
        v = not is_root  # FSDPState._lazy_init: the root keeps its parameters
    if isinstance(v, bool):
        return shard if v else None
    if v == 1:
        return None
    return v
