"""Train a catalogue model with real DeepSpeed (CPU accelerator, gloo) for a few steps.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 -m runtime.examples.ds_train \\
        --model tiny --ds-config ds.json --steps 3 --micro-batch 2 --seq 16

Used by the fidelity tests under ``commsim record`` and by bench/validate_local.py. The
model is ``runtime.torch_models.build_model`` (Hugging Face's RobertaForMaskedLM tree);
activation checkpointing per layer as in the seed scenario unless --no-checkpointing.
The optimizer is torch's AdamW (DeepSpeed's own CPU Adam needs a compiled op). With the
ds_config's ``comms_logger`` enabled it prints ``deepspeed.comm.log_summary()`` at the end
and, with --comms-raw-json, saves the logger's raw data (tests/runtime/test_run_records.py
reads both into calibration points).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import resource
import sys
import time

from runtime.examples import gc_log


def leave_without_teardown() -> None:
    """Exit once every output is written, without the interpreter's teardown (the exit
    handlers, commsim record's among them, run first): a thread of DeepSpeed's or
    gloo's still joinable when C++ statics are destroyed aborts the process after its
    work is done ("terminate called without an active exception", now and then on a
    loaded 2-core machine even after destroy_process_group; seen in this runner and in
    fsdp_train), and the launcher then reports a run that succeeded as failed."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def minor_faults() -> int:
    """This process's minor page faults so far (all its threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--checkpoint-style", choices=("reentrant", "non_reentrant"), default="reentrant",
                    help="torch.utils.checkpoint use_reentrant=True (Hugging Face's default) or False")
    ap.add_argument("--timings", help="write per-step wall times (JSON) here, rank 0 only")
    ap.add_argument("--profile", action="store_true", help="cProfile the last step on rank 0 (top 25 by time)")
    ap.add_argument("--torch-profile", metavar="TRACE_JSON",
                    help="torch.profiler on the last step on rank 0: print the time per phase and the top 30 ops "
                         "by self time, and write the Chrome trace (with input shapes; each phase a "
                         "ds_train.forward / .backward / .step range) here")
    ap.add_argument("--profile-memory", action="store_true",
                    help="with --torch-profile: record every tensor allocation and free too (profile_memory; "
                         "bench/host_heap_check.py reads them phase by phase)")
    ap.add_argument("--mark-modules", action="store_true",
                    help="under commsim record: insert a marker per module hook (which module sent what)")
    ap.add_argument("--comms-raw-json", metavar="FILE",
                    help="with the ds_config's comms_logger enabled: write its get_raw_data() here (rank 0) before "
                    "log_summary() prints the table")
    gc_log.add_arguments(ap)
    ap.add_argument("--build-shm-comm", action="store_true",
                    help="let DeepSpeed build its CPU shared-memory all-reduce op (inference only; skipped by default)")
    args = ap.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    from commsim.models import resolve_model
    from runtime.torch_models import build_model, import_for

    with open(args.ds_config) as f:
        ds_cfg = json.load(f)
    ds_cfg.setdefault("zero_allow_untested_optimizer", True)
    micro = ds_cfg.get("train_micro_batch_size_per_gpu", 1)
    if os.environ["DS_ACCELERATOR"] == "cpu" and not args.build_shm_comm:
        # DeepSpeed's CPU backend JIT-compiles its shared-memory all-reduce at start-up
        # (deepspeed/comm/torch.py build_shm_op; about 50 s on 2 cores on a fresh
        # machine). Only inference_all_reduce (tensor-parallel inference) calls it;
        # ZeRO training communicates through torch.distributed, so skipping the build
        # changes nothing that is measured.
        import importlib

        # (not ``import deepspeed.comm.torch as``: deepspeed.comm's name ``torch`` is torch)
        ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
        if hasattr(ds_comm_torch, "build_shm_op"):
            ds_comm_torch.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", timeout=__import__("datetime").timedelta(seconds=120))
    torch.manual_seed(0)
    cfg = resolve_model(args.model)
    stage = ds_cfg.get("zero_optimization", {}).get("stage", 0)
    if stage == 3:
        # dtype from the config: DeepSpeed 0.19's Init(dtype=...) on the CPU accelerator
        # ignores an explicit dtype (an operator-precedence slip) and picks bf16
        import_for(cfg)
        with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
            model = build_model(cfg)
    else:
        model = build_model(cfg)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(use_reentrant=args.checkpoint_style == "reentrant")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
    if args.mark_modules:
        from runtime.record import mark

        for name, mod in engine.module.named_modules():
            mod.register_forward_pre_hook(lambda m, a, n=name: mark(f"fwd_pre:{n}"))
            mod.register_full_backward_pre_hook(lambda m, g, n=name: mark(f"bwd_pre:{n}"))
    gcl = gc_log.start(args, engine.module)
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    times = []
    phase_times: dict[str, list[float]] = {}  # forward / backward / step (engine.step) per step
    # this process's minor page faults per phase: fresh pages' first touches (each costs a
    # fault and the kernel's zeroing), to check what allocations cost in a real step
    phase_faults: dict[str, list[int]] = {}
    import cProfile
    import pstats

    for i in range(args.steps):
        ids = torch.randint(0, cfg.vocab, (micro, args.seq), generator=g)
        last = i == args.steps - 1 and dist.get_rank() == 0
        prof = cProfile.Profile() if args.profile and last else None
        tprof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                       profile_memory=args.profile_memory) \
            if args.torch_profile and last else contextlib.nullcontext()

        def phase(name: str):
            # each phase a range of the profiled step's trace (host_heap_check and phase breakdowns read them)
            return torch.profiler.record_function(f"ds_train.{name}") if args.torch_profile and last \
                else contextlib.nullcontext()

        if gcl:
            gcl.begin_step(i)
        phases, faults = {}, [minor_faults()]
        t = time.perf_counter()
        if prof:
            prof.enable()
        with tprof:
            if gcl:
                gcl.phase = "forward"
            with phase("forward"):
                loss = engine(ids, labels=ids)
            phases["forward"] = time.perf_counter()
            faults.append(minor_faults())
            if gcl:
                gcl.phase = "backward"
            with phase("backward"):
                engine.backward(loss)
            phases["backward"] = time.perf_counter()
            faults.append(minor_faults())
            if gcl:
                gcl.phase = "step"
            with phase("step"):
                engine.step()
            phases["step"] = time.perf_counter()
            faults.append(minor_faults())
        if prof:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        times.append(phases["step"] - t)  # not the reports below
        ends = list(phases.values())
        for name, t0, t1 in zip(phases, [t] + ends, ends):
            phase_times.setdefault(name, []).append(t1 - t0)
        for name, f0, f1 in zip(phases, faults, faults[1:]):
            phase_faults.setdefault(name, []).append(f1 - f0)
        if args.torch_profile and last:
            for name, durs in phase_times.items():
                print(f"phase {name}: {durs[-1] * 1e3:.1f} ms")
            print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            tprof.export_chrome_trace(args.torch_profile)
    if gcl:
        gcl.write(f"{args.gc_log}.rank{dist.get_rank()}.json", times)
    if args.timings and dist.get_rank() == 0:
        with open(args.timings, "w") as f:
            json.dump({"step_times_s": times, "phase_times_s": phase_times, "phase_minor_faults": phase_faults}, f)
    if ds_cfg.get("comms_logger", {}).get("enabled"):
        # DeepSpeed's comms logger: its raw per-op values, then the summary table on rank
        # 0's stdout (with "verbose" the per-op lines were logged as the ops ran)
        if args.comms_raw_json and dist.get_rank() == 0:
            with open(args.comms_raw_json, "w") as f:
                json.dump(deepspeed.comm.comms_logger.get_raw_data(), f)
        deepspeed.comm.log_summary()
    dist.barrier()
    # tear the process group down before the interpreter does: left to exit, gloo's
    # threads were once destroyed still joinable ("terminate called without an active
    # exception", rank 0 aborted after its last step under a loaded CI run)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()
