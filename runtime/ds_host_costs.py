"""Host (Python) cost of DeepSpeed ZeRO-3's routines, timed on this machine's CPU.

    python -m runtime.ds_host_costs --deepspeed 0.5.10 --source DIR -o costs-0.5.10.json
    python -m runtime.ds_host_costs --deepspeed 0.19.8 -o costs-0.19.8.json   # the installed one
    python -m runtime.ds_host_costs --min-of merged.json run1.json run2.json ...
    python -m runtime.ds_host_costs --derive costs-*.json
    python -m runtime.ds_host_costs --derive-before-pr1188 derived.json pr1188/deepspeed-*.json

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
world into each call's minimum (``calibrate`` times six). Separately:
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

from runtime.ds_host_old import OldRelease
from runtime.ds_host_setup import (BUCKET, FFN, HIDDEN, LAYERS, LIVE, PERSISTENCE, PREFETCH_BUCKET, REUSE, STEPS,
                                   VOCAB, WORLD, fake_world, model_config, noop_handle)
from runtime.ds_host_timing import (Recorder, clock, count_gathers, count_queue_pops, count_waits, cpu_name, fit,
                                    min_over_steps, primitives)

# The bucket flush timed alone (CurrentRelease.flush_sweep): gradients per flush, and
# repeats of each (each count's minimum is kept). Only the parameters whose elements
# divide evenly among SWEEP_RANKS ranks (40 of the model's 106: weights, embeddings):
# reduce_scatter_coalesced pads every rank's piece of an uneven tensor with a fresh
# torch.empty, which the width-16 model's biases and LayerNorms would pay at 64-128 ranks
# (a 16-element bias at 128 ranks: 112 allocations) and a real model's, thousands of
# elements wide, do not.
FLUSH_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32, 40)
FLUSH_REPEATS = 100
SWEEP_RANKS = 128

__all__ = ["CurrentRelease", "OldRelease", "derive", "fit", "measure", "model_config"]

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


def measure(release, steps: int = STEPS, log=print, flush_repeats: int = FLUSH_REPEATS) -> dict:
    rec = Recorder()
    release.build(rec)
    per_step = []
    for i in range(steps + 2):
        rec.reset()
        release.step()
        if i >= 2:
            per_step.append({k: list(v) for k, v in rec.calls.items()})
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
    return fits, calls


def min_over_runs(docs: list[dict]) -> dict:
    """One measurement from several processes' of the same release and world: each
    call's minimum over them (the same calls with the same counts in each). This
    machine's speed drifts between processes (the same flush 10-30% apart), so the
    fastest process's time of each call is what the routine costs, as each call's
    minimum over the steps is within one."""
    first = docs[0]
    assert all((d["deepspeed"], d["world"]) == (first["deepspeed"], first["world"]) for d in docs)
    for routine, rows in first["calls"].items():
        assert all([c for _, c in d["calls"][routine]] == [c for _, c in rows] for d in docs), routine
    calls = {k: [[t, c] for t, c in v] for k, v in min_over_steps([d["calls"] for d in docs]).items()}
    prims = {k: min(d["primitives"][k] for d in docs) for k in first["primitives"]}
    return {**first, "calls": calls, "primitives": prims, "processes": len(docs)}


# cudaLaunchKernel's host-side cost: back-to-back launches of a short kernel take
# 3.8 us each when they overlap the kernels' execution (NVIDIA Developer Blog, A. Gray,
# "Getting Started with CUDA Graphs", 2019: 9.6 us per kernel with a synchronize after
# each, 3.8 us without, 3.4 us as a graph, for a 2.9 us kernel).
CUDA_LAUNCH_NS = 3_800
# The p4d host's CPU (Xeon Platinum 8275CL) against this machine's, per thread: no
# single-thread benchmark of both was at hand, so taken as equal (a Zen 4 core is
# likely somewhat faster per thread than a Cascade Lake one: the p4d's costs are then
# underestimated, not overestimated).
CPU_SCALE = 1.0


def derive(paths: list[str], exact: bool = False) -> dict[str, dict[str, int]]:
    """HostCosts fields per release from the measurements at two or more world sizes:
    the calls of all of them fitted together, the loops over ranks as a per-rank term.
    Rounded to 100 ns for knobs.HOST_COSTS; ``exact``: to 1 ns (a calibration's
    figures: its per-rank terms are a few hundred ns, where 100 ns steps would be a
    20-50% quantisation)."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    out = {}
    for version in sorted({d["deepspeed"] for d in docs}):
        ds = [d for d in docs if d["deepspeed"] == version]

        def joint(routine, features, per_rank=(), rank=False, relative=False, known_rank_ns=0.0):
            """``per_rank``: features whose cost also grows with the world (a loop over
            ranks per item); ``rank``: a part of the fixed cost that does (``per_rank_ns``);
            ``known_rank_ns``: such a part measured apart, taken off each call first."""
            calls = []
            for d in ds:
                for t, c in d["calls"].get(routine, []):
                    t = t - known_rank_ns * d["world"]
                    c = dict(c)
                    for f in per_rank:
                        c[f"{f}_x_rank"] = c.get(f, 0) * d["world"]
                    if rank:
                        c["rank"] = d["world"]
                    calls.append((t, c))
            return fit(calls, list(features) + [f"{f}_x_rank" for f in per_rank] + (["rank"] if rank else []),
                       relative=relative)

        fetch = joint("fetch", ["param", "gathered", "waited"], per_rank=("gathered", "waited"))
        release = joint("release", ["param", "freed"])
        grad = joint("grad_hook", [])
        # The flush timed alone over 1-40 gradients where measured (0.19.8), fitted on
        # relative residuals; else the step's own flushes. Its fixed part grows with the
        # world too: reduce_scatter_coalesced chunks the flat buffer into one view per
        # rank once per flush. Where the run timed torch.chunk's per view (primitives),
        # that is the per-rank term, taken off before the fit; else it is fitted (the
        # stored tables: an intercept between two worlds, 39% apart over three
        # calibrations, where the chunk alone is within 1%).
        sweep = all(d["calls"].get("flush_sweep") for d in ds)
        chunk = [d["primitives"].get("chunk_view_ns") for d in ds]
        chunk_ns = float(min(chunk)) if sweep and all(v is not None for v in chunk) else None
        flush = joint("flush_sweep" if sweep else "flush", ["grad"], per_rank=("grad",), rank=chunk_ns is None,
                      relative=sweep, known_rank_ns=chunk_ns or 0.0)
        if chunk_ns is not None:
            flush["per_rank_ns"] = chunk_ns
        debug = next((d["debug_string_ns"] for d in ds if d.get("debug_string_ns")), 0)
        small = [d for d in ds if d["world"] == min(x["world"] for x in ds)][0]
        prim = small["primitives"]

        def scaled(v: float) -> int:
            return int(round(v * CPU_SCALE, 0 if exact else -2))

        out[version] = {
            "launch_ns": scaled(prim["torch_op_ns"]) + CUDA_LAUNCH_NS,
            "collective_launch_ns": scaled(prim["c10d_all_gather_ns"]) + CUDA_LAUNCH_NS,
            "module_hook_ns": scaled(fetch["fixed_ns"]),
            "fetch_param_ns": scaled(max(0, fetch["per_param_ns"] - debug)),
            "gather_param_ns": scaled(fetch["per_gathered_ns"]),
            "gather_param_rank_ns": scaled(fetch["per_gathered_x_rank_ns"]),
            "wait_param_ns": scaled(fetch["per_waited_ns"]),
            "wait_param_rank_ns": scaled(fetch["per_waited_x_rank_ns"]),
            "release_hook_ns": scaled(release["fixed_ns"]),
            "release_param_ns": scaled(release["per_param_ns"]),
            "free_param_ns": scaled(release["per_freed_ns"]),
            "grad_hook_ns": scaled(grad["fixed_ns"]),
            "reduce_flush_ns": scaled(flush["fixed_ns"]),
            "reduce_flush_rank_ns": scaled(flush["per_rank_ns"]),
            "reduce_param_ns": scaled(flush["per_grad_ns"]),
            "reduce_param_rank_ns": scaled(flush["per_grad_x_rank_ns"]),
            "debug_string_ns": scaled(debug),
            "_fit": {"fetch_r2": fetch["r2"], "release_r2": release["r2"], "flush_r2": flush["r2"],
                     "fetch_rms_ns": fetch["rms_residual_ns"], "worlds": sorted(d["world"] for d in ds),
                     "flush_timed": f"alone, {FLUSH_COUNTS[0]}-{FLUSH_COUNTS[-1]} gradients" if sweep else "in the step",
                     "flush_per_rank": "torch.chunk per view, timed alone" if chunk_ns is not None else "fitted",
                     "date": ds[0]["date"], "cpu": ds[0]["machine"]["cpu"]},
        }
    return out


# DeepSpeed 0.5.4's routines that differ from 0.5.10's (its gather path builds the
# output list in a loop over the ranks; its release makes torch.ones(1) on the host):
# field -> the field whose machine ratio scales it where 0.5.10 has no such term
PR1188_CHANGED = {"gather_param_ns": "gather_param_ns", "gather_param_rank_ns": "gather_param_ns",
                  "free_param_ns": "free_param_ns"}


def derive_before_pr1188(stored_0510: dict[str, int], paths: list[str]) -> dict[str, int]:
    """0.5.4's HostCosts fields from a run of 0.5.4 beside 0.5.10 on one machine
    (``paths``: both releases, two worlds each) and 0.5.10's stored figures from
    another: 0.5.10's figures, with each routine whose code differs scaled by the two
    releases' ratio on the common machine (a term 0.5.10 lacks, by the ratio of that
    routine between the two machines), so that the releases differ by their code."""
    both = derive(paths)
    new, old = both["0.5.4"], both["0.5.10"]
    out = {k: v for k, v in stored_0510.items() if not k.startswith("_")}
    for field, base in PR1188_CHANGED.items():
        if old[field]:
            value = stored_0510[field] * new[field] / old[field]
        else:
            value = new[field] * stored_0510[base] / old[base]
        out[field] = int(round(value, -2))
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--derive":
        print(json.dumps(derive(argv[1:]), indent=1))
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
    fits, calls = measure(release, args.steps, log, args.flush_repeats)
    doc = {
        "deepspeed": args.deepspeed,
        "fits": fits,
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
