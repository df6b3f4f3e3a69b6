"""Tuning advisor: the DeepSpeed (or FSDP2, FSDP1) config with the highest predicted throughput that fits.

Coordinate descent over DeepSpeed's own keys, each prediction a full simulation:
starting from the user's config (DeepSpeed's defaults where it is silent), every
dimension in turn is tried at each of its candidate values with the others held, and
the best that fits in memory is kept if it gains more than ``MIN_GAIN``; rounds repeat
until one changes nothing. The objective is tokens per second (per-GPU model TFLOPS
ranks the same way for a fixed model); a point fits when the simulated caching
allocator never runs out of device memory.

The dimensions (``DIMENSIONS``) are DeepSpeed keys written into the resulting config,
plus two model-side choices that DeepSpeed's config cannot express and the
explanation reports instead: layer-wise activation checkpointing, and (through the
micro-batch) the batch size. MiCS is left out: DeepSpeed 0.19.8 refuses its keys.

With ``strategy="fsdp2"`` the dimensions are FSDP2's (``FSDP2_DIMENSIONS``, keys of
commsim.strategies.fsdp2_config): ``reshard_after_forward`` (true, false, and
resharding to one node's GPUs when the shard group spans nodes), explicit forward and
backward prefetch depth, HSDP (sharding inside each node, replicating across nodes),
the micro-batch and checkpointing; the result is an FSDP2 config. With
``strategy="fsdp1"`` they are FSDP1's (``FSDP1_DIMENSIONS``, keys of
commsim.strategies.fsdp1_config): the sharding strategy (HYBRID_SHARD only across
several nodes), the rate limiter, backward and forward prefetch, the micro-batch and
checkpointing; the result is an FSDP1 config.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from dataclasses import dataclass, field
from typing import Any, Callable

from commsim.api import Scenario
from commsim.ir.errors import CommsimInputError
from commsim.report.metrics import STALL_CAUSES
from commsim.sweep import base_ds_config, run_point

# name -> candidate values (None: derived from the scenario). Bucket and prefetch sizes
# span DeepSpeed's documented ranges around its defaults (5e8 / 5e7 elements).
DIMENSIONS: dict[str, tuple[Any, ...] | None] = {
    "reduce_bucket_size": (int(2.5e7), int(5e7), int(1e8), int(2e8), int(5e8), int(1e9)),
    "stage3_prefetch_bucket_size": (int(1e7), int(2.5e7), int(5e7), int(1e8), int(2e8), int(4e8)),
    "stage3_max_live_parameters": (int(1e8), int(3e8), int(1e9), int(3e9)),
    "stage3_max_reuse_distance": (0, int(1e8), int(1e9), int(1e10)),
    "stage3_param_persistence_threshold": (0, int(1e4), int(1e5), int(1e6)),
    "zero_hpz_partition_size": None,  # 1, or the GPUs of a node when there are several nodes
    "train_micro_batch_size_per_gpu": None,  # half, same, double the starting micro-batch
    "checkpointing": (True, False),
}
FSDP2_DIMENSIONS: dict[str, tuple[Any, ...] | None] = {
    "reshard_after_forward": None,  # true, false, and a node's GPUs when the shard group spans nodes
    "forward_prefetch": (0, 1, 2),
    "backward_prefetch": (0, 1, 2),
    "hsdp_replicas": None,  # 1, or the nodes (shard inside each node) when there are several
    "micro_batch": None,  # half, same, double the starting micro-batch
    "checkpointing": (True, False),
}
FSDP1_DIMENSIONS: dict[str, tuple[Any, ...] | None] = {
    "sharding_strategy": None,  # FULL_SHARD, SHARD_GRAD_OP, NO_SHARD; HYBRID_SHARD across several nodes
    "limit_all_gathers": (True, False),
    "backward_prefetch": ("BACKWARD_PRE", "BACKWARD_POST", None),
    "forward_prefetch": (False, True),
    "micro_batch": None,  # half, same, double the starting micro-batch
    "checkpointing": (True, False),
}
STAGE3_ONLY = {"stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
               "stage3_param_persistence_threshold", "zero_hpz_partition_size"}
_TOP = {"train_micro_batch_size_per_gpu"}
# A change is kept only if it gains more than this: smaller differences are below what
# the model resolves (measured prediction errors are several percent), and keeping
# DeepSpeed's defaults where nothing is gained makes the advice easier to trust.
MIN_GAIN = 0.005
_MODEL_SIDE = {"checkpointing"}


@dataclass
class Evaluation:
    settings: dict[str, Any]
    row: dict[str, Any]

    @property
    def fits(self) -> bool:
        return not self.row.get("error") and not self.row.get("oom")

    @property
    def tokens_per_s(self) -> float:
        return float(self.row.get("tokens_per_s") or 0.0) if self.fits else 0.0


@dataclass
class TuneResult:
    base: Evaluation
    best: Evaluation
    config: dict[str, Any]  # the winning DeepSpeed (or FSDP) config, as written
    steps: list[tuple[str, Any, Any, Evaluation, Evaluation]] = field(default_factory=list)  # dim, old, new, before, after
    evaluations: int = 0
    rounds: int = 0
    strategy: str = "deepspeed"

    @property
    def ds_config(self) -> dict[str, Any]:
        return self.config

    @property
    def speedup(self) -> float:
        return self.best.tokens_per_s / self.base.tokens_per_s if self.base.tokens_per_s else float("inf")

    def explain(self) -> str:
        return explain(self)

    def to_json(self) -> dict[str, Any]:
        return {
            ("ds_config" if self.strategy == "deepspeed" else "fsdp_config"): self.config,
            "checkpointing": self.best.settings["checkpointing"],
            "base": _summary(self.base), "best": _summary(self.best), "speedup": self.speedup,
            "changes": [{"key": d, "from": a, "to": b, "tokens_per_s_before": x.tokens_per_s,
                         "tokens_per_s_after": y.tokens_per_s} for d, a, b, x, y in self.steps],
            "evaluations": self.evaluations, "rounds": self.rounds,
        }


def _summary(e: Evaluation) -> dict[str, Any]:
    keys = ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "peak_reserved_bytes", "oom", "error")
    return {"settings": e.settings, **{k: e.row.get(k) for k in keys},
            "stalls_s": {c: e.row.get(f"stall_{c}_s", 0.0) for c in STALL_CAUSES}}


def _start(base: Scenario) -> tuple[dict[str, Any], dict[str, Any]]:
    """(base DeepSpeed config, starting settings of every dimension)."""
    ds = base_ds_config(base)
    zero = ds.setdefault("zero_optimization", {})
    if base.stage is not None:
        zero["stage"] = base.stage
    zero.setdefault("stage", 3)
    micro = base.micro_batch or ds.get("train_micro_batch_size_per_gpu") or 16
    ds.pop("train_batch_size", None)  # the micro-batch is searched; the global batch follows it
    from commsim.strategies.dsconfig import parse_zero

    z = parse_zero(zero, "ds_config")
    start = {
        "reduce_bucket_size": z.reduce_bucket_size,
        "stage3_prefetch_bucket_size": z.prefetch_bucket_size,
        "stage3_max_live_parameters": z.max_live_parameters,
        "stage3_max_reuse_distance": z.max_reuse_distance,
        "stage3_param_persistence_threshold": z.param_persistence_threshold,
        "zero_hpz_partition_size": max(1, z.zero_hpz_partition_size),
        "train_micro_batch_size_per_gpu": micro,
        "checkpointing": base.checkpointing,
    }
    return ds, start


def _candidates(dim: str, start: dict[str, Any], gpus_per_node: int, nodes: int) -> list[Any]:
    if dim == "zero_hpz_partition_size":
        return [1, gpus_per_node] if nodes > 1 and gpus_per_node > 1 else [1]
    if dim == "train_micro_batch_size_per_gpu":
        m = start[dim]
        return sorted({max(1, m // 2), m, m * 2})
    values = list(DIMENSIONS[dim] or ())
    if start[dim] not in values:
        values.append(start[dim])
    return sorted(values, key=lambda v: (isinstance(v, bool), v))


def ds_config_for(ds: dict[str, Any], settings: dict[str, Any], stage: int) -> dict[str, Any]:
    """The base config with the settings written in, as DeepSpeed reads it."""
    out = json.loads(json.dumps(ds))
    zero = out.setdefault("zero_optimization", {})
    for k, v in settings.items():
        if k in _MODEL_SIDE:
            continue
        if k in _TOP:
            out[k] = v
        elif k in STAGE3_ONLY and stage != 3:
            continue
        elif k == "zero_hpz_partition_size" and v == 1:
            zero.pop(k, None)
        else:
            zero[k] = v
    return out


def _scenario(base: Scenario, ds: dict[str, Any], settings: dict[str, Any], stage: int) -> Scenario:
    return base.with_(ds_config=ds_config_for(ds, settings, stage), micro_batch=None, stage=None,
                      checkpointing=bool(settings["checkpointing"]))


@dataclass
class _Space:
    """What one strategy searches: where it starts, which dimensions, each one's values,
    the scenario of a point and the config it writes."""

    start: dict[str, Any]
    dims: list[str]
    candidates: Callable[[str, dict[str, Any]], list[Any]]
    scenario: Callable[[dict[str, Any]], Scenario]
    config: Callable[[dict[str, Any]], dict[str, Any]]


def _deepspeed_space(base: Scenario, dimensions: list[str] | None, gpn: int) -> _Space:
    ds, start = _start(base)
    stage = int(ds["zero_optimization"]["stage"])
    if stage not in (1, 2, 3):
        raise CommsimInputError(f"ZeRO stage {stage} has nothing to tune; use stage 1, 2 or 3")
    dims = dimensions or [d for d in DIMENSIONS if stage == 3 or d not in STAGE3_ONLY]
    for d in dims:
        if d not in DIMENSIONS:
            raise CommsimInputError(f"--search {d}: allowed: {', '.join(DIMENSIONS)}")
        if d in STAGE3_ONLY and stage != 3:
            raise CommsimInputError(f"--search {d}: applies to ZeRO stage 3 only (the config has stage {stage})")
    return _Space(start, dims, lambda d, cur: _candidates(d, cur, gpn, base.nodes),
                  lambda st: _scenario(base, ds, st, stage), lambda st: ds_config_for(ds, st, stage))


def _fsdp_space(base: Scenario, strategy: str, table: dict[str, tuple[Any, ...] | None], start: dict[str, Any],
                dimensions: list[str] | None, special: dict[str, Callable[[dict[str, Any]], list[Any]]],
                cfg_obj: dict[str, Any]) -> _Space:
    """An FSDP search: ``table``'s dimensions, ``special`` candidates for the derived ones,
    half / same / double the micro-batch; the config is the base one with the settings."""
    dims = dimensions or list(table)
    for d in dims:
        if d not in table:
            raise CommsimInputError(f"--search {d}: allowed with --strategy {strategy}: {', '.join(table)}")

    def candidates(d: str, cur: dict[str, Any]) -> list[Any]:
        if d in special:
            out = special[d](cur)
        elif d == "micro_batch":
            return sorted({max(1, cur[d] // 2), cur[d], cur[d] * 2})
        else:
            out = list(table[d] or ())
        return out if cur[d] in out else out + [cur[d]]

    def config(st: dict[str, Any]) -> dict[str, Any]:
        out = dict(cfg_obj)
        out.update({k: v for k, v in st.items() if k not in ("micro_batch", "checkpointing")})
        return out

    def scenario(st: dict[str, Any]) -> Scenario:
        return base.with_(fsdp_config=config(st), micro_batch=st["micro_batch"],
                          checkpointing=bool(st["checkpointing"]))

    return _Space(start, dims, candidates, scenario, config)


def _config_name(base: Scenario) -> str:
    return str(base.fsdp_config) if isinstance(base.fsdp_config, str) else "fsdp_config"


def _fsdp2_space(base: Scenario, dimensions: list[str] | None, gpn: int) -> _Space:
    from commsim.strategies.fsdp2_config import parse_fsdp_config
    from commsim.sweep import base_fsdp_config

    cfg_obj = base_fsdp_config(base)
    cfg = parse_fsdp_config(cfg_obj, _config_name(base))
    start = {"reshard_after_forward": cfg.reshard_after_forward, "forward_prefetch": cfg.forward_prefetch,
             "backward_prefetch": cfg.backward_prefetch, "hsdp_replicas": cfg.hsdp_replicas,
             "micro_batch": base.micro_batch or 16, "checkpointing": base.checkpointing}
    world = base.nodes * gpn

    def reshard(cur: dict[str, Any]) -> list[Any]:
        shard = world // cur["hsdp_replicas"]
        return [True, False] + ([gpn] if shard > gpn > 1 and shard % gpn == 0 else [])

    def hsdp(cur: dict[str, Any]) -> list[Any]:
        return sorted({1, base.nodes, cur["hsdp_replicas"]}) if gpn > 1 else [cur["hsdp_replicas"]]

    return _fsdp_space(base, "fsdp2", FSDP2_DIMENSIONS, start, dimensions,
                       {"reshard_after_forward": reshard, "hsdp_replicas": hsdp}, cfg_obj)


def _fsdp1_space(base: Scenario, dimensions: list[str] | None, gpn: int) -> _Space:
    from commsim.strategies.fsdp1_config import parse_fsdp1_config
    from commsim.sweep import base_fsdp_config

    cfg_obj = base_fsdp_config(base)
    cfg = parse_fsdp1_config(cfg_obj, _config_name(base))
    start = {"sharding_strategy": cfg.sharding_strategy, "limit_all_gathers": cfg.limit_all_gathers,
             "backward_prefetch": cfg.backward_prefetch, "forward_prefetch": cfg.forward_prefetch,
             "micro_batch": base.micro_batch or 16, "checkpointing": base.checkpointing}

    def strategies(cur: dict[str, Any]) -> list[Any]:
        out = ["FULL_SHARD", "SHARD_GRAD_OP"] + ([] if cfg.gradient_accumulation_steps > 1 else ["NO_SHARD"])
        return out + (["HYBRID_SHARD"] if base.nodes > 1 and gpn > 1 else [])  # NO_SHARD: no accumulation here

    return _fsdp_space(base, "fsdp1", FSDP1_DIMENSIONS, start, dimensions, {"sharding_strategy": strategies}, cfg_obj)


def tune(base: Scenario, dimensions: list[str] | None = None, jobs: int = 2, max_rounds: int = 3,
         progress: Callable[[str], None] | None = None) -> TuneResult:
    """Search ``dimensions`` (default: all that apply) from ``base``; see the module doc."""
    from commsim.hardware.specs import cluster_preset

    cluster = cluster_preset(base.cluster, base.nodes, base.net, base.gpus_per_node, base.nccl_stack)
    gpn = cluster.node.gpus_per_node
    space = {"fsdp2": _fsdp2_space, "fsdp1": _fsdp1_space}.get(base.strategy, _deepspeed_space)(base, dimensions, gpn)
    cache: dict[str, Evaluation] = {}
    ctx = mp.get_context("spawn")
    with ctx.Pool(max(1, jobs)) as pool:
        def evaluate(batch: list[dict[str, Any]]) -> list[Evaluation]:
            todo = []
            for s in batch:
                key = json.dumps(s, sort_keys=True)
                if key not in cache and key not in {k for k, _ in todo}:
                    todo.append((key, s))
            rows = pool.map(run_point, [(space.scenario(s), {}, k) for k, s in todo]) if todo else []
            for (key, s), row in zip(todo, rows):
                cache[key] = Evaluation(s, row)
            return [cache[json.dumps(s, sort_keys=True)] for s in batch]

        current = evaluate([dict(space.start)])[0]
        base_eval = current
        if base_eval.row.get("error"):
            raise CommsimInputError(f"the starting point does not predict: {base_eval.row['error']}")
        steps: list[tuple[str, Any, Any, Evaluation, Evaluation]] = []
        rounds = 0
        for rounds in range(1, max_rounds + 1):
            changed = False
            for d in space.dims:
                values = space.candidates(d, current.settings)
                if len(values) < 2:
                    continue
                evals = evaluate([{**current.settings, d: v} for v in values])
                best = max(evals, key=lambda e: e.tokens_per_s)
                if progress:
                    progress(f"round {rounds} {d}: " + ", ".join(
                        f"{e.settings[d]}={'OOM' if not e.fits else f'{e.tokens_per_s:,.0f}'}" for e in evals))
                if best.fits and best.tokens_per_s > current.tokens_per_s * (1 + MIN_GAIN):
                    steps.append((d, current.settings[d], best.settings[d], current, best))
                    current = best
                    changed = True
            if not changed:
                break
    return TuneResult(base_eval, current, space.config(current.settings), steps, len(cache), rounds, base.strategy)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, int) and v >= 10**6:
        return f"{v:.0e}".replace("e+0", "e").replace("e+", "e")
    return str(v)


def explain(r: TuneResult) -> str:
    """Why the winner wins: each change with its predicted effect, then the stall causes
    and memory of the start and of the winner."""
    b, w = r.base, r.best
    lines = []
    if not b.fits:
        lines.append(f"the starting config does not fit: {b.row.get('oom') or b.row.get('error')}")
    else:
        lines.append(f"start:  {b.row['step_time_s']:.3f} s/step, {b.tokens_per_s:,.0f} tokens/s, "
                     f"{b.row['model_tflops_per_gpu']:.1f} model TFLOPS/GPU, peak reserved "
                     f"{b.row['peak_reserved_bytes'] / 1e9:.1f} GB")
    lines.append(f"tuned:  {w.row['step_time_s']:.3f} s/step, {w.tokens_per_s:,.0f} tokens/s, "
                 f"{w.row['model_tflops_per_gpu']:.1f} model TFLOPS/GPU, peak reserved "
                 f"{w.row['peak_reserved_bytes'] / 1e9:.1f} GB"
                 + (f"  ({r.speedup:.3f}x the start's throughput)" if b.fits else ""))
    lines.append(f"searched {r.evaluations} configurations in {r.rounds} round(s) of coordinate descent")
    if not r.steps:
        lines.append("no change beats the starting config: it is already the best the search found")
    for d, old, new, x, y in r.steps:
        gain = y.tokens_per_s / x.tokens_per_s - 1 if x.tokens_per_s else float("inf")
        moved = []
        for c in STALL_CAUSES:
            s0, s1 = float(x.row.get(f"stall_{c}_s") or 0), float(y.row.get(f"stall_{c}_s") or 0)
            if abs(s1 - s0) >= 0.002:
                moved.append(f"{c} stall {s0:.3f} -> {s1:.3f} s")
        why = "; ".join(moved) or "compute-stream stalls unchanged (the gain is in compute per token)"
        if not x.fits:
            why = f"the previous setting ran out of memory ({x.row.get('oom')})"
        lines.append(f"  {d}: {_fmt(old)} -> {_fmt(new)}: {gain:+.1%} tokens/s ({why})")
    framework = {"fsdp2": "an FSDP2 setting", "fsdp1": "an FSDP1 setting"}.get(r.strategy, "a DeepSpeed key")
    if w.settings["checkpointing"] != b.settings["checkpointing"]:
        lines.append("  note: activation checkpointing is a model setting (e.g. Hugging Face's "
                     f"gradient_checkpointing_{'enable' if w.settings['checkpointing'] else 'disable'}()), not "
                     f"{framework}; the config does not carry it")
    micro = "train_micro_batch_size_per_gpu" if r.strategy == "deepspeed" else "micro_batch"
    if w.settings[micro] != b.settings[micro]:
        lines.append("  note: a different micro-batch changes the global batch; adjust the learning rate "
                     "or gradient_accumulation_steps if the global batch must stay")
    return "\n".join(lines)
