"""The Python API the CLI and the notebooks share: describe a scenario, predict it.

    from commsim.api import Scenario, predict
    p = predict(Scenario(model="roberta-10b", nodes=8, net="efa", preset="baseline"))
    p.metrics.step_time_s, p.metrics.stalls_s
    p.trace().to_dataframe()          # every op's start / end per rank and stream

``Scenario`` holds what the ``commsim predict`` flags hold, with the same defaults
(the seed scenario: roberta-10b, 8 p4d nodes, ZeRO-3 of today's DeepSpeed (preset
``current``; ``baseline`` / ``optimized`` are DeepSpeed 0.5.10 / 0.6.0), micro-batch 16,
sequence 512, bf16, layer-wise checkpointing). ``strategy="fsdp2"`` lowers PyTorch
FSDP2 instead, with ``fsdp_config``'s settings (commsim.strategies.fsdp2_config;
default: the seed scenario's, ``default_fsdp_config()``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any

from commsim.hardware.specs import cluster_preset
from commsim.ir.errors import CommsimInputError
from commsim.ir.schedule import Schedule
from commsim.ir.serialize import schedule_hash
from commsim.ir.trace import Trace, TraceMeta, TraceRecord, TraceSource, make_trace
from commsim.models import describe, resolve_model
from commsim.profile_use import cost_model, check_profile_fits, host_costs_used
from commsim.scenario_defaults import bf16_warning, default_ds_config, default_fsdp_config, default_half
from commsim.report.metrics import Metrics, StepInfo, compute_metrics, step_info
from commsim.sim.engine import SimConfig, SimResult, Simulator, simulate
from commsim.sim.host_gc import aligned_by_default, parse_host_gc
from commsim.strategies.zero3_trace import CHECKPOINT_STYLES


@dataclass(frozen=True)
class Scenario:
    model: str = "roberta-10b"
    strategy: str = "deepspeed"  # "deepspeed" (ds_config, stage, preset, knobs), "fsdp2" or "fsdp1" (fsdp_config)
    fsdp_config: str | dict[str, Any] | None = None  # path or parsed JSON (strategies "fsdp2", "fsdp1")
    cluster: str = "p4d"
    nodes: int = 8
    gpus_per_node: int | None = None  # None: the cluster's
    net: str | None = None  # None: the cluster's own fabric
    nccl_stack: str | None = None  # None: the cluster's own software stack (hardware.stacks.STACKS)
    stage: int | None = None  # None: the config's, else 3
    preset: str = "current"  # DeepSpeed 0.19.8; "baseline" = 0.5.10, "optimized" = 0.6.0
    knobs: tuple[str, ...] = ()  # NAME=VALUE overrides
    ds_config: str | dict[str, Any] | None = None  # path or parsed JSON
    micro_batch: int | None = None  # None: the config's, else 16
    seq: int = 512
    checkpointing: bool = True
    checkpoint_style: str = "reentrant"  # torch.utils.checkpoint use_reentrant=True (HF's default) or non_reentrant
    schedule: str | None = None  # a schedule file instead of generating one
    hw_profile: str | None = None
    mode: str = "auto"
    seed: int = 0
    jitter: float | None = None
    # relative sd of each host op's time, independent per op and rank (None: the platform's,
    # 0 on every preset until measured): every synchronisation waits for the latest rank
    host_jitter: float | None = None
    # each rank's full garbage collections, "PERIOD_STEPS:PAUSE_MS[:aligned|independent]"
    # (commsim.sim.host_gc); None: none, as a loop that turned the collector off
    host_gc: str | None = None
    # steps simulated before the measured one; None: until the caching allocator settles
    # (GPUs, at most sim.warmup.SETTLE_MAX_STEPS), one on CPUs
    warmup_steps: int | None = None
    host_costs: Any = None  # HostCosts overriding the defaults / the profile's measured ones
    # how many times as long the GPU host's CPU takes for each host routine as the core
    # the host costs were measured on (Schedule.with_host_time_scaled); 1.0: as measured
    host_scale: float = 1.0
    extrapolate: bool = False  # let a profile price groups larger than (or placed unlike) those it measured
    host_heap: bool = False  # a framework's CPU tensors through the model of glibc's heap (SimConfig.host_heap)
    # what runs the schedule on a profile's machine: "framework" (DeepSpeed, FSDP2: the
    # schedule's own host ops are its whole host cost) or "executor" (commsim execute,
    # which also pays its own per-op costs, measured into the profile)
    runner: str = "framework"
    warnings: list[str] = field(default_factory=list, compare=False)

    def with_(self, **changes: Any) -> "Scenario":
        return replace(self, **changes)


@dataclass
class Prediction:
    scenario: dict[str, Any]
    schedule: Schedule
    result: SimResult
    metrics: Metrics
    info: StepInfo
    title: str
    hbm_bytes: int
    hardware: str
    sources: tuple[str, ...] = ()  # with a profile: what came from it, and what from the preset

    def trace(self) -> Trace:
        return result_trace(self.result, self.schedule, self.hardware)


def result_trace(result: SimResult, schedule: Schedule, hardware: str) -> Trace:
    from commsim.ir.ops import collective_columns, op_flops, op_kind_name, op_size_bytes

    recs = []
    for rr in result.ranks.values():
        for r in rr.records:
            # A collective starts where its rank reached it, its wait for the slowest member
            # included: where an executor's timer (or a CUDA event, a profiler's NCCL kernel)
            # starts it, so predicted and measured communication times mean the same.
            recs.append(TraceRecord(r.rank, r.stream, int(r.op.id), op_kind_name(r.op), r.op.label,
                                    r.start_ns - r.wait_peers_ns, r.end_ns, op_size_bytes(r.op), op_flops(r.op), 0,
                                    r.op.phase.value, *collective_columns(r.op)))
    extra: tuple = (("mode", result.mode), ("jitter", result.jitter))
    if result.step_samples_spans:  # a noisy prediction's seeded steps (report.compare takes medians over them)
        extra += (("step_samples", result.step_samples_spans),)
    meta = TraceMeta(TraceSource.PREDICTED, producer="commsim.sim", schedule_hash=schedule_hash(schedule),
                     hardware=hardware, seed=result.seed, extra=extra)
    return make_trace(meta, recs)


def _ds_config(sc: Scenario):
    from commsim.strategies.dsconfig import load_ds_config, parse_ds_config

    if sc.ds_config is None:
        return (parse_ds_config(default_ds_config(sc.stage, default_half(sc)), "default ds_config"),
                "default ds_config")
    if isinstance(sc.ds_config, dict):
        return parse_ds_config(sc.ds_config, "ds_config"), "ds_config"
    return load_ds_config(sc.ds_config), sc.ds_config


def _fsdp_config(sc: Scenario):
    """FSDP2's or FSDP1's settings (``sc.strategy``): the file, the object, or the seed's."""
    from commsim.strategies.fsdp1_config import load_fsdp1_config, parse_fsdp1_config
    from commsim.strategies.fsdp2_config import load_fsdp_config, parse_fsdp_config

    parse, load = (parse_fsdp_config, load_fsdp_config) if sc.strategy == "fsdp2" else \
        (parse_fsdp1_config, load_fsdp1_config)
    if sc.fsdp_config is None:
        return parse(default_fsdp_config(default_half(sc)), "default fsdp_config")
    if isinstance(sc.fsdp_config, dict):
        return parse(sc.fsdp_config, "fsdp_config")
    return load(sc.fsdp_config)


def _build_fsdp(sc: Scenario):
    """The FSDP2 or FSDP1 schedule of a scenario (``sc.strategy``), from ``--fsdp-config``;
    DeepSpeed's settings do not apply to either."""
    from commsim.strategies import CURRENT, World, generate_fsdp1, generate_fsdp2

    given = [flag for flag, v in (("--ds-config", sc.ds_config), ("--stage", sc.stage), ("--knob", sc.knobs)) if v]
    if given or sc.preset != "current":
        given += ["--preset"] if sc.preset != "current" else []
        raise CommsimInputError(f"{', '.join(given)}: DeepSpeed settings; --strategy {sc.strategy} takes its settings "
                                "from --fsdp-config")
    fsdp2 = sc.strategy == "fsdp2"
    cfg = _fsdp_config(sc)
    cluster = cluster_preset(sc.cluster, sc.nodes, sc.net, sc.gpus_per_node, sc.nccl_stack)
    world = World(sc.nodes, cluster.node.gpus_per_node)
    micro = sc.micro_batch or 16  # the seed scenario's
    md = describe_model(sc.model, micro, sc.seq, 4 if cfg.param_dtype == "fp32" else 2)
    # FSDP's launches are today's PyTorch dispatch, its hooks its own measured figure
    # (knobs.HostCosts.fsdp2_hook_ns / fsdp1_hook_ns), or a profile's
    costs, source = _host_costs(sc, CURRENT.name)
    device = _device(sc, cfg.param_dtype)
    generate = generate_fsdp2 if fsdp2 else generate_fsdp1
    schedule = generate(md, world, cfg, checkpointing=sc.checkpointing, costs=costs,
                        checkpoint_style=sc.checkpoint_style, device=device, host_blocking=_host_blocking(sc, device))
    schedule = replace(schedule, meta=replace(schedule.meta, host_costs=source))
    info = step_info(md, world.size, sc.nodes, schedule.meta.grad_accum, sc.checkpointing,
                     cluster.node.price_usd_per_hour)
    return schedule, md, info, cfg.param_dtype


def _host_blocking(sc: Scenario, device: str) -> bool:
    """Whether the framework's ``async_op=False`` collectives block the host: the
    framework's own run (not commsim's executor, which replays a schedule as a GPU runs
    it) on a CPU backend (strategies/builder.py)."""
    return device == "cpu" and sc.runner == "framework"


def _device(sc: Scenario, precision: str) -> str:
    """Where the scenario's model lives: "cpu" on a platform that runs kernels on the host
    (a gloo profile), else "cuda" (every cluster preset, an NCCL profile)."""
    if not sc.hw_profile:
        return "cuda"
    from commsim.hardware.profile_doc import load_profile

    return "cpu" if load_profile(sc.hw_profile, precision).platform.inline_kernels else "cuda"


def build_schedule(sc: Scenario):
    """(schedule, model description, step info, precision) for a scenario that generates its schedule."""
    from commsim.strategies import CURRENT, STRATEGIES, World, generate
    from commsim.strategies.dsconfig import check_batch
    from commsim.strategies.dsversions import apply_version_rules, version_of
    from commsim.strategies.knobs import knobs_from

    if sc.strategy not in STRATEGIES:
        raise CommsimInputError(f"--strategy {sc.strategy!r}: allowed: {', '.join(STRATEGIES)}")
    if sc.strategy in ("fsdp2", "fsdp1"):
        return _build_fsdp(sc)
    if sc.fsdp_config is not None:
        raise CommsimInputError("--fsdp-config: FSDP settings; give --strategy fsdp2 or fsdp1 with it")
    ds, where = _ds_config(sc)
    if sc.stage is not None and sc.ds_config is not None and sc.stage != ds.zero.stage:
        raise CommsimInputError(f"--stage {sc.stage} contradicts {where}: zero_optimization.stage {ds.zero.stage}")
    sc.warnings.extend(ds.warnings)
    cluster = cluster_preset(sc.cluster, sc.nodes, sc.net, sc.gpus_per_node, sc.nccl_stack)
    world = World(sc.nodes, cluster.node.gpus_per_node)
    micro, gas = check_batch(ds, world.size, where)
    if sc.micro_batch is not None:
        if ds.train_micro_batch_size_per_gpu not in (None, sc.micro_batch):
            raise CommsimInputError(f"--micro-batch {sc.micro_batch} contradicts {where}: "
                                    f"train_micro_batch_size_per_gpu {ds.train_micro_batch_size_per_gpu}")
        micro = sc.micro_batch
    elif ds.train_micro_batch_size_per_gpu is None and ds.train_batch_size is None:
        micro = 16  # the seed scenario
    md = describe_model(sc.model, micro, sc.seq, ds.param_dtype_bytes)
    knobs = knobs_from(sc.preset, list(sc.knobs))
    version = version_of(sc.preset)
    if ds.zero.stage == 3:
        ds, notes = apply_version_rules(ds, version)
        sc.warnings.extend(notes)
    costs, source = _host_costs(sc, version.name if ds.zero.stage == 3 else CURRENT.name)
    schedule = generate(md, world, ds, knobs, checkpointing=sc.checkpointing, grad_accum=gas, preset=sc.preset,
                        checkpoint_style=sc.checkpoint_style, version=version, costs=costs,
                        host_blocking=_host_blocking(sc, _device(sc, ds.precision)))
    schedule = replace(schedule, meta=replace(schedule.meta, host_costs=source))
    info = step_info(md, world.size, sc.nodes, gas, sc.checkpointing, cluster.node.price_usd_per_hour)
    return schedule, md, info, ds.precision  # (the precision the release runs)


def _host_costs(sc: Scenario, version: str):
    """(host costs, where they came from): a scenario's own; else those measured into
    the hardware profile, over the DeepSpeed release's (``version``); else (None, ...):
    the release's table, the generator's defaults."""
    from commsim.strategies.knobs import host_costs_for, host_costs_from
    from commsim.util.files import read_json

    if sc.host_costs is not None:
        return sc.host_costs, "given with the scenario"
    table = f"DeepSpeed {version}'s table (commsim.strategies.knobs.HOST_COSTS)"
    if sc.hw_profile:
        obj = read_json(sc.hw_profile, CommsimInputError)
        if isinstance(obj, dict) and "host_costs" in obj:
            how = obj["host_costs"].get("source") if isinstance(obj["host_costs"], dict) else None
            return (host_costs_from(obj["host_costs"], sc.hw_profile, host_costs_for(version)),
                    f"measured into {sc.hw_profile}" + (f" ({how})" if how else "") + f", over {table}")
    if sc.strategy in ("fsdp2", "fsdp1"):
        return None, (f"{table}'s launches and {sc.strategy.upper()}'s own hook figure ({sc.strategy}_hook_ns, "
                      f"timed by runtime/{sc.strategy}_host_costs.py)")
    return None, table


def describe_model(model: str, micro_batch: int, seq: int, dtype_bytes: int = 2):
    """A preset, a Hugging Face config.json, or ``module:function`` returning an nn.Module
    (walked on the meta device by commsim.models.torch_walk; needs torch)."""
    from pathlib import Path

    if ":" in model and not Path(model).exists():
        try:
            from commsim.models.torch_walk import describe_module
        except ImportError as e:
            raise CommsimInputError(f"--model {model!r}: reading a torch module needs torch "
                                    f"(pip install 'commsim[runtime]'): {e}") from None
        return describe_module(model, micro_batch, seq, dtype_bytes)
    return describe(resolve_model(model), micro_batch, seq, dtype_bytes)


def _info_from_schedule(schedule: Schedule, nodes: int, price: float) -> StepInfo:
    """Throughput facts of a schedule file: from its metadata when the model is known,
    else from its ops (hardware flops = all compute flops; model flops without recompute)."""
    from commsim.ir import ops as O

    meta = schedule.meta
    if meta.micro_batch is not None and meta.seq_len is not None:
        try:
            md = describe(resolve_model(meta.model), meta.micro_batch, meta.seq_len)
            return step_info(md, schedule.world_size, nodes, meta.grad_accum, meta.checkpointing, price)
        except (CommsimInputError, ValueError):
            pass  # a model this commsim does not know: count the ops
    prog = schedule.program_of(0)
    hw = sum(op.flops for op in prog.step if isinstance(op, O.Compute))
    model = sum(op.flops for op in prog.step if isinstance(op, O.Compute) and op.phase is not O.Phase.RECOMPUTE)
    return StepInfo(schedule.world_size, nodes, 0, float(model), float(hw), price, "ops")




def predict(sc: Scenario) -> Prediction:
    """Generate (or load) the schedule, simulate it, compute the metrics."""
    check_host_scale(sc.host_scale)
    if sc.checkpoint_style not in CHECKPOINT_STYLES:
        raise CommsimInputError(f"--checkpoint-style {sc.checkpoint_style!r}: allowed: {', '.join(CHECKPOINT_STYLES)}")
    cluster = cluster_preset(sc.cluster, sc.nodes, sc.net, sc.gpus_per_node, sc.nccl_stack)
    if sc.schedule:
        from commsim.ir.validate import check_valid
        from commsim.ir.load import load_schedule_any

        schedule = load_schedule_any(sc.schedule)
        check_valid(schedule, sc.schedule)
        if schedule.world_size != cluster.world_size and not sc.hw_profile:
            raise CommsimInputError(f"--schedule {sc.schedule}: has {schedule.world_size} ranks but the cluster "
                                    f"has {cluster.world_size} GPUs ({sc.nodes} nodes x {cluster.node.gpus_per_node});"
                                    " set --nodes / --gpus-per-node to match")
        precision = schedule.meta.precision or "bf16"
        info = _info_from_schedule(schedule, sc.nodes, cluster.node.price_usd_per_hour)
        what = f"{sc.schedule} ({schedule.meta.description or schedule.meta.model})"
    else:
        schedule, md, info, precision = build_schedule(sc)
        fsdp = sc.strategy in ("fsdp2", "fsdp1")
        bf16_warning(sc, precision, f"the {sc.strategy.upper()} config" if fsdp else "the DeepSpeed config")
        how = (f"{sc.strategy.upper()}" if fsdp else f"ZeRO-{schedule.meta.strategy[-1]} ({sc.preset})")
        what = (f"{md.name}, {how}, micro-batch {md.micro_batch} x "
                f"{md.seq_len}, {precision}{', checkpointing' if sc.checkpointing else ''}")
    cost, hardware = cost_model(sc, precision)
    sources = check_profile_fits(cost, sc.hw_profile, sc, schedule, cluster) if sc.hw_profile else ()
    if sc.hw_profile or sc.schedule:
        sources += (f"host costs: {host_costs_used(sc, schedule)}",)
    if sc.host_scale != 1:
        schedule = schedule.with_host_time_scaled(sc.host_scale)
        sources += (f"host: every host routine takes {sc.host_scale:g}x its time (--host-scale), the host "
                    "optimizer's (memory-bound) excepted",)
    if sc.jitter is not None and sc.jitter < 0:
        raise CommsimInputError(f"--jitter {sc.jitter}: must be >= 0")
    if sc.warmup_steps is not None and (isinstance(sc.warmup_steps, bool) or not isinstance(sc.warmup_steps, int)
                                        or sc.warmup_steps < 0):
        raise CommsimInputError(f"--warmup-steps {sc.warmup_steps!r}: an integer >= 0, the steps simulated before "
                                "the measured one")
    if sc.host_jitter is not None and not 0 <= sc.host_jitter < 1:
        raise CommsimInputError(f"--host-jitter {sc.host_jitter}: a relative standard deviation in [0, 1)")
    try:
        host_gc = parse_host_gc(sc.host_gc, aligned_by_default(schedule.meta.strategy)) \
            if sc.host_gc is not None else None
    except ValueError as e:
        raise CommsimInputError(f"--host-gc {e}") from None
    if sc.host_heap and cost.fresh_page_ns_per_byte() is None:
        raise CommsimInputError("--host-heap: models a framework's tensors on CPUs; it needs a CPU (gloo) "
                                "--hw-profile and --runner framework")
    config = SimConfig(mode=sc.mode, seed=sc.seed, jitter=sc.jitter, host_heap=sc.host_heap,
                       host_jitter=sc.host_jitter, host_gc=host_gc, warmup_steps=sc.warmup_steps)
    try:
        sim = Simulator(schedule, cost, config)
    except ValueError as e:
        raise CommsimInputError(f"--mode {sc.mode}: {e}") from None
    result = simulate(sim)
    metrics = compute_metrics(result, info)
    if sc.mode == "auto" and result.mode == "symmetric" and not metrics.oom and metrics.alloc_flushes:
        result, metrics, note = _per_rank_after_flushes(schedule, cost, config, info, result, metrics)
        sources += (note,)
    title = f"commsim predict: {what} on {hardware} = {schedule.world_size} GPUs"
    scen = {k: v for k, v in sc.__dict__.items() if k not in ("warnings", "host_costs")}
    scen.update(_resolved(sc, schedule, cluster))
    return Prediction(scen, schedule, result, metrics, info, title, cost.hbm_bytes, hardware, sources)


# The largest world ``predict`` re-simulates rank by rank when the allocator flushes:
# a per-rank step of roberta-50b costs about 0.67 s per rank on this 2-core VM (bench/sim_speed.py:
# 64 ranks in 42.7 s).
PER_RANK_AFTER_FLUSH_MAX_RANKS = 64


def _per_rank_after_flushes(schedule: Schedule, cost, config: SimConfig, info: StepInfo, sym_result: SimResult,
                            sym: Metrics) -> tuple[SimResult, Metrics, str]:
    """The symmetric run flushed the caching allocator: in it every rank flushes at the
    same instant, while on a real cluster each rank flushes on its own and every
    collective it joins waits for it. Every rank is simulated (with the per-rank mode's
    jitter, so that their flushes fall apart), up to PER_RANK_AFTER_FLUSH_MAX_RANKS;
    returns the result, its metrics and the line that says so. ``config``: the symmetric
    run's, whose other settings the per-rank run keeps."""
    n = schedule.world_size
    flushes = f"the caching allocator flushed {sym.alloc_flushes} time(s) in the symmetric run"
    if n > PER_RANK_AFTER_FLUSH_MAX_RANKS:
        note = (f"mode: {flushes}; {n} ranks are too many to simulate one by one (at most "
                f"{PER_RANK_AFTER_FLUSH_MAX_RANKS}; --mode per-rank forces it): the flushes are priced as if every "
                "rank flushed at the same instant, which understates their cost")
        return sym_result, sym, note
    print(f"commsim: {flushes}; simulating each of the {n} ranks (a flush on one rank stalls every collective "
          "it joins) ...", file=sys.stderr, flush=True)
    sim = Simulator(schedule, cost, replace(config, mode="per-rank"))
    result = simulate(sim)
    note = (f"mode: per-rank because {flushes}: a flush on one rank stalls every collective it joins "
            f"(symmetric step {sym.step_time_s:.3f} s)")
    return result, compute_metrics(result, info), note


def _resolved(sc: Scenario, schedule: Schedule, cluster) -> dict[str, Any]:
    """The values a prediction used where the scenario left them to defaults: the fabric
    kind ("profile" when a measured profile replaces the preset's), the ZeRO stage and
    micro-batch of the schedule (None when a schedule file does not say), the node's GPUs."""
    import re

    stage = re.fullmatch(r"zero(\d)", schedule.meta.strategy or "")
    return {"net": "profile" if sc.hw_profile else cluster.node.fabric.kind,
            "strategy": schedule.meta.strategy if schedule.meta.strategy in ("fsdp2", "fsdp1") else sc.strategy,
            "stage": int(stage.group(1)) if stage else None,
            "gpus_per_node": cluster.node.gpus_per_node,
            "micro_batch": schedule.meta.micro_batch}


def scenario_from_args(args: Any) -> Scenario:
    """The CLI's predict flags as a Scenario."""
    return Scenario(
        model=args.model, strategy=args.strategy, fsdp_config=args.fsdp_config, cluster=args.cluster, nodes=args.nodes,
        gpus_per_node=args.gpus_per_node, net=args.net, nccl_stack=getattr(args, "nccl_stack", None),
        stage=args.stage, preset=args.preset,
        knobs=tuple(args.knob or ()), ds_config=args.ds_config, micro_batch=args.micro_batch, seq=args.seq,
        checkpointing=not args.no_checkpointing, checkpoint_style=args.checkpoint_style, schedule=args.schedule, hw_profile=args.hw_profile,
        mode=args.mode, seed=args.seed, jitter=args.jitter, host_jitter=getattr(args, "host_jitter", None),
        host_gc=getattr(args, "host_gc", None), warmup_steps=getattr(args, "warmup_steps", None),
        extrapolate=getattr(args, "extrapolate", False),
        runner=getattr(args, "runner", "framework"), host_heap=getattr(args, "host_heap", False),
        host_scale=getattr(args, "host_scale", 1.0),
    )


def check_host_scale(scale: Any) -> None:
    """--host-scale: a finite number > 0."""
    import math

    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise CommsimInputError(f"--host-scale {scale!r}: must be a number > 0, how many times as long the host's CPU "
                                "takes for each host routine as the core the host costs were measured on (1: as "
                                "measured)")


def predict_scenario(args: Any) -> Prediction:
    """The CLI's flags as a Scenario, predicted; warnings go to stderr."""
    sc = scenario_from_args(args)
    pred = predict(sc)
    for w in sc.warnings:
        print(f"commsim: warning: {w}", file=sys.stderr)
    return pred
