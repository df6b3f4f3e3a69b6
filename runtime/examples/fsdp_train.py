"""Train a catalogue model with PyTorch FSDP2 (``fully_shard``) on CPUs (gloo) for a few steps.

    torchrun --nproc-per-node 2 -m runtime.examples.fsdp_train --model tiny --steps 3 --seq 16 \\
        --fsdp-config fsdp.json

Each transformer layer is its own FSDP unit, then the whole model (so embeddings and
the LM head form the root unit), as FSDP users shard a transformer, with the settings
of ``--fsdp-config`` (commsim.strategies.fsdp2_config: the keys of ``fully_shard``'s
arguments; the same file ``commsim schedule --strategy fsdp2 --fsdp-config`` reads).
With ``--fsdp1`` it wraps with FSDP1 (``FullyShardedDataParallel``) instead, the settings
being FSDP1's (commsim.strategies.fsdp1_config), in the same timed loop. Used under
``commsim record`` by the fidelity tests (tests/runtime/test_fsdp2_fidelity.py,
test_fsdp1_fidelity.py) and by bench/validate_local.py (``--timings``). The optimizer is torch's AdamW. The run
keeps its own records on request (``runtime.examples.records``): a torch.profiler trace
of its steps (--torch-profile-dir) and Flight Recorder dumps (--flight-recorder,
--flight-recorder-json), as tests/runtime/test_run_records.py reads them, and every
rank's garbage collections (--gc-log, ``runtime.examples.gc_log``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import time

from runtime.examples import gc_log, records
from runtime.examples.ds_train import leave_without_teardown, minor_faults


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="a preset or a Hugging Face config.json (roberta family)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--fsdp-config", help="FSDP2 settings JSON (default: FSDP2's defaults); with --fsdp1, FSDP1's "
                    "(commsim.strategies.fsdp1_config)")
    ap.add_argument("--fsdp1", action="store_true",
                    help="wrap with FSDP1 (FullyShardedDataParallel) instead of FSDP2: every layer, then the model")
    ap.add_argument("--no-checkpointing", action="store_true", help="no per-layer activation checkpointing")
    ap.add_argument("--checkpoint-style", choices=("reentrant", "non_reentrant"), default="reentrant",
                    help="torch.utils.checkpoint use_reentrant=True (Hugging Face's default) or False")
    ap.add_argument("--timings", help="write per-step wall times (JSON) here, rank 0 only")
    ap.add_argument("--mark-modules", action="store_true",
                    help="under commsim record: insert a marker per module hook (which module sent what)")
    records.add_arguments(ap)
    gc_log.add_arguments(ap)
    args = ap.parse_args()
    records.before_init(args)  # before the process group starts (in the builders)
    if args.fsdp1:
        model, cfg, gas, quiet = build_fsdp1(args)
    else:
        model, cfg, gas, quiet = build_fsdp2(args)
    if args.mark_modules:
        from runtime.record import mark

        for name, mod in model.named_modules():
            mod.register_forward_pre_hook(lambda m, a, n=name: mark(f"fwd_pre:{n}"))
            mod.register_full_backward_pre_hook(lambda m, g, n=name: mark(f"bwd_pre:{n}"))
    train(args, model, cfg, gas, quiet)


def build_fsdp2(args: argparse.Namespace):
    """FSDP2 (``fully_shard``) on every layer, then the model: (model, its config, micro-steps,
    the context each micro-step runs in)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from commsim.models import resolve_model
    from commsim.strategies.fsdp2_config import load_fsdp_config, parse_fsdp_config, shard_size
    from runtime.torch_models import build_model

    fc = load_fsdp_config(args.fsdp_config) if args.fsdp_config else parse_fsdp_config({})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world = dist.get_world_size()
    shard = shard_size(fc, world)
    if fc.hsdp_replicas > 1:
        # HSDP: a 2-D mesh, replicate x shard; shard groups are consecutive ranks
        mesh = init_device_mesh("cpu", (fc.hsdp_replicas, shard), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}
    mp = MixedPrecisionPolicy(param_dtype=dtypes[fc.mp_param_dtype], reduce_dtype=dtypes[fc.mp_reduce_dtype])
    offload = CPUOffloadPolicy(pin_memory=fc.offload_pin_memory) if fc.offload else OffloadPolicy()
    torch.manual_seed(0)
    cfg = resolve_model(args.model)
    model = build_model(cfg)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(use_reentrant=args.checkpoint_style == "reentrant")
    layers = list(model.roberta.encoder.layer)
    common = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=fc.reshard_after_forward, **common)
    fully_shard(model, reshard_after_forward=fc.root_reshard_after_forward, **common)
    if fc.forward_prefetch:
        for i, layer in enumerate(layers):
            targets = layers[i + 1:i + 1 + fc.forward_prefetch]
            if targets:
                layer.set_modules_to_forward_prefetch(targets)
    if fc.backward_prefetch:
        for i, layer in enumerate(layers):
            targets = layers[max(0, i - fc.backward_prefetch):i][::-1]
            if targets:
                layer.set_modules_to_backward_prefetch(targets)
    gas = fc.gradient_accumulation_steps

    def quiet(micro: int):
        if not fc.requires_gradient_sync:  # reduce only at the last micro-step
            model.set_requires_gradient_sync(micro == gas - 1)
        return contextlib.nullcontext()

    return model, cfg, gas, quiet


def train(args: argparse.Namespace, model, cfg, gas: int, quiet) -> None:
    """``args.steps`` steps of ``gas`` micro-steps (each inside ``quiet(micro)``), AdamW,
    timed per phase; the records and the timings file as asked."""
    import torch
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gcl = gc_log.start(args, model)
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    times = []
    phase_times: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}  # summed over micro-steps
    phase_faults: dict[str, list[int]] = {k: [] for k in phase_times}  # minor page faults (runtime.examples.ds_train)
    with records.profiling(args, args.steps) as prof:
        for i in range(args.steps):
            if gcl:
                gcl.begin_step(i)
            t = time.perf_counter()
            spent = dict.fromkeys(phase_times, 0.0)
            faults = dict.fromkeys(phase_times, 0)
            for micro in range(gas):
                ids = torch.randint(0, cfg.vocab, (args.micro_batch, args.seq), generator=g)
                with quiet(micro):
                    f0 = minor_faults()
                    if gcl:
                        gcl.phase = "forward"
                    t0 = time.perf_counter()
                    loss = model(ids, labels=ids)
                    t1, f1 = time.perf_counter(), minor_faults()
                    if gcl:
                        gcl.phase = "backward"
                    loss.backward()
                spent["forward"] += t1 - t0
                spent["backward"] += time.perf_counter() - t1
                faults["forward"] += f1 - f0
                faults["backward"] += minor_faults() - f1
            f0 = minor_faults()  # before the clock starts: the phase's time leaves it out
            if gcl:
                gcl.phase = "step"
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            spent["step"] = time.perf_counter() - t0
            faults["step"] = minor_faults() - f0
            times.append(time.perf_counter() - t)
            for k, v in spent.items():
                phase_times[k].append(v)
                phase_faults[k].append(faults[k])
            prof.step()
    if gcl:
        gcl.write(f"{args.gc_log}.rank{dist.get_rank()}.json", times)
    if args.timings and dist.get_rank() == 0:
        with open(args.timings, "w") as f:
            json.dump({"step_times_s": times, "phase_times_s": phase_times, "phase_minor_faults": phase_faults}, f)
    dist.barrier()
    records.dump_flight_recorder(args, dist.get_rank())
    dist.destroy_process_group()


def fsdp1_kwargs(fc) -> dict:
    """``FullyShardedDataParallel``'s arguments for FSDP1 settings ``fc`` (fsdp1_config's) on
    CPUs, flat parameters (``use_orig_params=False``); HYBRID_SHARD's mesh is the caller's."""
    import torch
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}
    kw = dict(device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy[fc.sharding_strategy],
              limit_all_gathers=fc.limit_all_gathers, use_orig_params=False, forward_prefetch=fc.forward_prefetch,
              backward_prefetch=BackwardPrefetch[fc.backward_prefetch] if fc.backward_prefetch else None)
    if fc.mp_param_dtype or fc.mp_reduce_dtype:
        kw["mixed_precision"] = MixedPrecision(param_dtype=dtypes[fc.mp_param_dtype],
                                               reduce_dtype=dtypes[fc.mp_reduce_dtype])
    return kw


def build_fsdp1(args: argparse.Namespace):
    """FSDP1 the usual way: ``FullyShardedDataParallel`` around every layer, then around the
    model, Hugging Face's checkpointing around each layer's call (outside its unit); every
    micro-step but the last inside ``no_sync()`` when the settings ask. Returns as
    ``build_fsdp2``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from commsim.models import resolve_model
    from commsim.strategies.fsdp1_config import load_fsdp1_config, parse_fsdp1_config
    from runtime.torch_models import build_model

    fc = load_fsdp1_config(args.fsdp_config) if args.fsdp_config else parse_fsdp1_config({})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world = dist.get_world_size()
    kw = fsdp1_kwargs(fc)
    if fc.sharding_strategy == "HYBRID_SHARD":  # on CPUs the groups come from a mesh: 2 ranks a "node"
        kw["device_mesh"] = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    cfg = resolve_model(args.model)
    model = build_model(cfg)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(use_reentrant=args.checkpoint_style == "reentrant")
    layers = model.roberta.encoder.layer
    for i in range(len(layers)):
        layers[i] = FSDP(layers[i], **kw)
    model = FSDP(model, **kw)
    gas = fc.gradient_accumulation_steps

    def quiet(micro: int):
        return model.no_sync() if fc.no_sync and micro < gas - 1 else contextlib.nullcontext()

    return model, cfg, gas, quiet


if __name__ == "__main__":
    main()
    leave_without_teardown()
