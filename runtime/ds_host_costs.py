"""Host (Python) cost of DeepSpeed ZeRO-3's routines, timed on this machine's CPU.

    python -m runtime.ds_host_costs --deepspeed 0.5.10 --source DIR -o costs-0.5.10.json
    python -m runtime.ds_host_costs --deepspeed 0.19.8 -o costs-0.19.8.json   # the installed one
    python -m runtime.ds_host_costs --min-of merged.json run1.json run2.json ...
    python -m runtime.ds_host_costs --derive costs-*.json
    python -m runtime.ds_host_costs --derive-before-pr1188 derived.json pr1188/deepspeed-*.json
    python -m runtime.ds_host_costs --derive-plumbing traces/host-costs plumbing/deepspeed-*.json

One DeepSpeed release at a time (each in its own process: two releases cannot share
one): 0.19.8 is the installed package; an older one is the unpacked source tree of
its PyPI sdist (``pip download --no-deps --no-binary :all: deepspeed==0.5.10``),
put first on ``sys.path`` and never copied into the project.

The release's own ZeRO-3 machinery is attached to a small RoBERTa-shaped model
(``runtime.torch_models``, Hugging Face's module tree, 6 layers of width 16) and run
for real on the CPU: forward and backward with layer-wise (reentrant) checkpointing,
the release's module hooks, parameter coordinator, gather and release paths,
gradient hooks, bucket flushes and epilogue. Its device calls are replaced by no-ops
(that is what "the routine's host cost" means here): CUDA streams, events and
synchronizes, ``Tensor.cuda``/``record_stream``, the collectives (functions stubbed to
return a finished handle; the process group is torch's fake backend with the seed's
world size, 64, so loops over ranks run as on the cluster), the debug-string norm
(0.5.10; timed on its own). Tensor ops run on the CPU on tensors of at most a few
thousand elements, so their cost is PyTorch's dispatch. The configuration scales the
seed's (roberta-10b, DeepSpeed's defaults) to the model: the same ratios of prefetch
bucket, reuse distance and live-parameter budget to the layers' weights, the
persistence threshold between biases and weights.

Every call of every routine is timed (the thread's CPU time, ``thread_time_ns``, which
leaves out the time other processes on a shared machine hold the core) with counts of what it did
(parameters visited, gathered, released, examined by the prefetch walk or queue); the
same calls repeat every steady-state step, so each call's minimum over the steps
(what the routine costs when nothing else on this shared machine interrupts it) is
fitted by least squares to a fixed cost plus a cost per counted item. The bucket flush
is also timed alone (0.19.8: ``CurrentRelease.flush_sweep``) holding 1-40 gradients,
since a step's few flushes cannot separate its fixed cost from its cost per gradient;
``derive`` fits those where present. ``--min-of`` merges several processes' runs of one
world into each call's minimum (``calibrate`` times six). Around the routines, each
step's forward + backward is also timed whole beside a plain step of the same model:
what neither holds is DeepSpeed's hook plumbing, per module hook call
(``runtime.ds_host_plumbing``). The fits, the merging of runs and the derivations from
stored figures are ``runtime.ds_host_derive``'s. Separately:
one PyTorch op's dispatch and one c10d collective call (the fake backend: c10d's
Python and C++ path without a network). The JSON holds every fit with its residual,
the counts, the machine, the date and the torch version.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import warnings
from pathlib import Path

from runtime.ds_host_derive import (CPU_SCALE, CUDA_LAUNCH_NS, PR1188_CHANGED, derive, derive_before_pr1188,
                                    derive_plumbing, min_over_runs)
from runtime.ds_host_old import OldRelease
from runtime.ds_host_plumbing import ForwardBackwardWindow, plain_step_ns, plumbing, wrapper_overhead_ns
from runtime.ds_host_setup import (BUCKET, FFN, FLUSH_COUNTS, HIDDEN, LAYERS, LIVE, PERSISTENCE, PREFETCH_BUCKET,
                                   REUSE, STEPS, VOCAB, WORLD, fake_world, model_config, noop_handle)
from runtime.ds_host_timing import (Recorder, clock, count_gathers, count_queue_pops, count_waits, cpu_name, fit,
                                    min_over_steps, primitives)

# The bucket flush timed alone (CurrentRelease.flush_sweep): gradients per flush
# (ds_host_setup.FLUSH_COUNTS), and repeats of each (each count's minimum is kept). Only
# the parameters whose elements divide evenly among SWEEP_RANKS ranks (40 of the model's
# 106: weights, embeddings): reduce_scatter_coalesced pads every rank's piece of an
# uneven tensor with a fresh torch.empty, which the width-16 model's biases and
# LayerNorms would pay at 64-128 ranks (a 16-element bias at 128 ranks: 112 allocations)
# and a real model's, thousands of elements wide, do not.
FLUSH_REPEATS = 100
SWEEP_RANKS = 128

# (the derivation lives in ds_host_derive; its names stay importable from here)
__all__ = ["CPU_SCALE", "CUDA_LAUNCH_NS", "CurrentRelease", "OldRelease", "PR1188_CHANGED", "derive",
           "derive_before_pr1188", "derive_plumbing", "fit", "measure", "min_over_runs", "model_config"]

# ---------------------------------------------------------------- release 0.19.8


class CurrentRelease:
    """The installed DeepSpeed on its CPU accelerator: the real Init, parameter offload
    hooks (DeepSpeedZeRoOffload) and stage-3 optimizer, built as deepspeed.initialize
    builds them, on the fake process group; collectives stubbed."""

    def __init__(self, world: int = WORLD, bucket: int = BUCKET):
        self.world, self.bucket = world, bucket
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        for k, v in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", str(world)), ("LOCAL_WORLD_SIZE", "1"),
                     ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29555")):
            os.environ.setdefault(k, v)
        warnings.simplefilter("ignore")
        import torch

        fake_world(world)
        import deepspeed
        import deepspeed.comm as dcomm

        self.torch, self.deepspeed = torch, deepspeed
        import importlib

        ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
        if hasattr(ds_comm_torch, "build_shm_op"):
            ds_comm_torch.build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="fake")
        for name in ("all_gather_into_tensor", "allgather_fn", "reduce_scatter_fn", "reduce_scatter_tensor",
                     "all_reduce", "all_gather", "broadcast", "barrier", "_all_gather_base", "_reduce_scatter_base"):
            if hasattr(dcomm, name):
                setattr(dcomm, name, noop_handle)
        self.dcomm = dcomm

    def build(self, rec: Recorder):
        torch, deepspeed = self.torch, self.deepspeed
        from runtime.torch_models import build_model

        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
               "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": PREFETCH_BUCKET,
                                     "stage3_param_persistence_threshold": PERSISTENCE - 1,
                                     "stage3_max_reuse_distance": REUSE, "stage3_max_live_parameters": LIVE,
                                     "reduce_bucket_size": self.bucket}}
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = build_model(model_config())
        model.gradient_checkpointing_enable(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        self.engine, self.model = engine, model
        zopt = engine.optimizer
        off = zopt.parameter_offload

        def n_params(args):
            m = args[0]
            return {"param": len(list(m.named_parameters(recurse=False))) + len(list(m.ds_external_parameters()))}

        for name in ("pre_sub_module_forward_function", "pre_sub_module_backward_function"):
            setattr(off, name, rec.wrap("fetch", getattr(off, name), n_params))
        for name in ("post_sub_module_forward_function", "post_sub_module_backward_function"):
            setattr(off, name, rec.wrap("release", getattr(off, name), n_params))
        import deepspeed.runtime.zero.partition_parameters as pp

        count_gathers(model, rec)
        for _, p in model.named_parameters():
            g = p.partition

            def part(*a, _g=g, **k):
                rec.count("freed")
                return _g(*a, **k)

            p.partition = part
        import deepspeed.runtime.zero.partitioned_param_coordinator as ppc

        count_queue_pops(ppc, rec)
        count_waits(pp, rec)
        grad_hook = "reduce_independent_p_g_buckets_and_remove_grads"
        setattr(zopt, grad_hook, rec.wrap("grad_hook", getattr(zopt, grad_hook), None))
        fname = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
        flush = getattr(zopt, fname)

        def flush_features(args):
            return {"grad": sum(len(b.params) for b in zopt.ipg_buckets.values())}

        setattr(zopt, fname, rec.wrap("flush", flush, flush_features))
        self.zopt = zopt

    def step(self) -> None:
        torch = self.torch
        ids = torch.randint(0, VOCAB, (2, 16))
        loss = self.engine(ids, ids)
        self.engine.backward(loss)
        self.engine.step()

    def debug_string_ns(self) -> None:
        return None

    def flush_sweep(self, counts=FLUSH_COUNTS, repeats: int = FLUSH_REPEATS) -> list[tuple[int, dict[str, int]]]:
        """The bucket flush alone, holding each of ``counts`` gradients (the model's
        evenly divisible parameters in backward order), ``repeats`` times in a
        shuffled order (a flush right after a large one measured ~0.3 ms slower at 64
        ranks); each count's minimum. A step's own flushes hold 1-25 gradients, too few
        distinct counts to separate the per-gradient cost from the fixed one. The bucket
        is enlarged to hold every gradient (DeepSpeed reads its size and buffer at each
        call); the gradients are zeros of each parameter's full shape, given to it as
        the autograd engine would (its data briefly full-sized: a partitioned parameter
        holds none)."""
        torch, zopt = self.torch, self.zopt
        cls = type(zopt)
        flush = getattr(cls, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads")
        add = getattr(cls, "_DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket")
        params = [p for p in list(self.model.parameters())[::-1] if p.ds_numel % SWEEP_RANKS == 0]
        assert counts[-1] <= len(params), (counts, len(params))
        dtype = zopt.get_param_comm_dtype(params[0])
        total = sum(p.ds_numel for p in params)
        zopt.reduce_bucket_size = total
        zopt.ipg_buckets[dtype].buffer = torch.empty(total, dtype=params[0].dtype)
        times: dict[int, list[int]] = {n: [] for n in counts}
        for r in range(repeats):
            order = list(counts)
            random.Random(r).shuffle(order)
            for n in order:
                for p in params[:n]:
                    data = p.data
                    p.data = torch.empty(p.ds_shape, dtype=p.dtype)
                    p.grad = torch.zeros(p.ds_shape, dtype=p.dtype)
                    p.data = data
                    add(zopt, p)
                t0 = clock()
                flush(zopt, dtype)
                times[n].append(clock() - t0)
        return [(min(times[n]), {"grad": n}) for n in counts]


# ---------------------------------------------------------------- main


def measure(release, steps: int = STEPS, log=print, flush_repeats: int = FLUSH_REPEATS) -> tuple[dict, dict, dict]:
    """(fits, each call's minimum, the hook plumbing per call: ds_host_plumbing)."""
    from runtime.torch_models import build_model

    rec = Recorder()
    release.build(rec)
    torch = release.torch
    plain = build_model(model_config())
    plain.gradient_checkpointing_enable(True)
    window = ForwardBackwardWindow(torch, release.model, rec)
    per_step, untimed, plain_ns = [], [], []
    for i in range(steps + 2):
        rec.reset()
        window.run(release.step)
        t_plain = plain_step_ns(torch, plain, VOCAB)  # right after, on the same minutes
        if i >= 2:
            per_step.append({k: list(v) for k, v in rec.calls.items()})
            untimed.append(window.elapsed_ns - window.routines_ns)
            plain_ns.append(t_plain)
        log(f"step {i}: " + ", ".join(f"{k} {len(v)} calls {sum(t for t, _ in v) / 1e6:.1f} ms"
                                      for k, v in sorted(rec.calls.items())))
    calls = min_over_steps(per_step)
    # (0.6.0 on: the prefetch queue pops one entry per parameter a fetch visits over a
    # step, so its pops are in the per-parameter cost; 0.5.10's walk stops at once)
    fits = {
        "fetch": fit(calls["fetch"], ["param", "gathered", "waited"]),
        "release": fit(calls["release"], ["param", "freed"]),
        "grad_hook": fit(calls["grad_hook"], []),
    }
    if calls.get("flush"):
        fits["flush"] = fit(calls["flush"], ["grad"])
    if hasattr(release, "flush_sweep"):
        calls["flush_sweep"] = release.flush_sweep(repeats=flush_repeats)
        fits["flush_sweep"] = fit(calls["flush_sweep"], ["grad"], relative=True)
        log("flush alone: " + ", ".join(f"{c['grad']} grads {t / 1e3:.0f} us" for t, c in calls["flush_sweep"]))
    hooks = plumbing(untimed, plain_ns, window.calls, wrapper_overhead_ns(plain))
    log(f"hook plumbing: {hooks['per_hook_call_ns'] / 1e3:.1f} us per module hook call")
    return fits, calls, hooks


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--derive":
        print(json.dumps(derive(argv[1:]), indent=1))
        return 0
    if argv and argv[0] == "--derive-plumbing":
        # python -m runtime.ds_host_costs --derive-plumbing STORED_DIR RUN.json ...
        stored = [json.loads(p.read_text()) for p in sorted(Path(argv[1]).glob("deepspeed-*-world*.json"))]
        print(json.dumps(derive_plumbing(stored, [json.loads(Path(p).read_text()) for p in argv[2:]]), indent=1))
        return 0
    if argv and argv[0] == "--derive-before-pr1188":
        # python -m runtime.ds_host_costs --derive-before-pr1188 STORED_0.5.10_DERIVED.json PAIR_RUNS.json ...
        stored = json.loads(Path(argv[1]).read_text())["0.5.10"]
        print(json.dumps(derive_before_pr1188(stored, argv[2:]), indent=1))
        return 0
    if argv and argv[0] == "--min-of":
        # python -m runtime.ds_host_costs --min-of OUT RUN.json RUN.json ...
        docs = [json.loads(Path(p).read_text()) for p in argv[2:]]
        Path(argv[1]).write_text(json.dumps(min_over_runs(docs), indent=1) + "\n")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed", required=True, choices=("0.5.4", "0.5.10", "0.6.0", "0.19.8"))
    ap.add_argument("--source", help="the unpacked sdist of an older release (its root, holding deepspeed/)")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--world", type=int, default=WORLD, help="ranks of the fake process group (default 64)")
    ap.add_argument("--bucket", type=int, default=BUCKET,
                    help=f"reduce bucket, elements (default {BUCKET}: the seed's ratio; smaller flushes more often)")
    ap.add_argument("--flush-repeats", type=int, default=FLUSH_REPEATS,
                    help=f"times the flush alone is timed at each gradient count (default {FLUSH_REPEATS})")
    args = ap.parse_args(argv)
    if args.deepspeed != "0.19.8" and not args.source:
        ap.error(f"--source: DeepSpeed {args.deepspeed} is read from its unpacked sdist")
    release = (CurrentRelease(args.world, args.bucket) if args.deepspeed == "0.19.8"
               else OldRelease(args.deepspeed, args.source, args.world, args.bucket))
    import torch

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    fits, calls, hooks = measure(release, args.steps, log, args.flush_repeats)
    doc = {
        "deepspeed": args.deepspeed,
        "fits": fits,
        "plumbing": hooks,
        # each call's minimum time over the steps, with its counts: what derive() fits
        "calls": {k: [[t, c] for t, c in v] for k, v in calls.items()},
        "debug_string_ns": release.debug_string_ns(),
        "primitives": primitives(torch, args.world),
        "world": args.world,
        "model": {"hidden": HIDDEN, "ffn": FFN, "layers": LAYERS, "vocab": VOCAB},
        "config": {"prefetch_bucket": PREFETCH_BUCKET, "persistence": PERSISTENCE, "reuse": REUSE, "live": LIVE,
                   "reduce_bucket": args.bucket},
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "date": datetime.date.today().isoformat(),
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
