"""Host (Python) cost of DeepSpeed ZeRO-3's routines, timed on this machine's CPU.

    python -m runtime.ds_host_costs --deepspeed 0.5.10 --source DIR -o costs-0.5.10.json
    python -m runtime.ds_host_costs --deepspeed 0.19.8 -o costs-0.19.8.json   # the installed one

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
fitted by least squares to a fixed cost plus a cost per counted item. Separately:
one PyTorch op's dispatch and one c10d collective call (the fake backend: c10d's
Python and C++ path without a network). The JSON holds every fit with its residual,
the counts, the machine, the date and the torch version.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

WORLD = 64  # the seed's world; --world changes it (per-rank loops scale with it)
STEPS = 20  # after 2 warm-up steps (the trace is recorded in the first)

# The model and the config: the seed's ratios at width 16. roberta-10b: attention
# weights 26.2M elements, FFN weights 104.9M, 10.35G in all; DeepSpeed's defaults:
# prefetch bucket 5e7 (~2 attention weights), reuse distance and live budget 1e9
# (~0.1 of the model), persistence 1e5 (biases and LayerNorms persist, weights not).
HIDDEN, FFN, LAYERS, VOCAB = 16, 64, 6, 128
PREFETCH_BUCKET = 2 * HIDDEN * HIDDEN  # two attention weights
PERSISTENCE = HIDDEN * HIDDEN  # below a weight, above a bias
REUSE = LIVE = 2200  # about 0.1 of the model's 22k elements
BUCKET = 19 * HIDDEN * HIDDEN  # reduce bucket 5e8: about 19 attention weights


def model_config():
    from commsim.models.transformer import TransformerConfig

    return TransformerConfig("hostcost", family="roberta", layers=LAYERS, hidden=HIDDEN, heads=2, ffn=FFN,
                             vocab=VOCAB, max_positions=64)


# ---------------------------------------------------------------- no-op device calls


class _Stream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


class _Event:
    def __init__(self, *a, **k) -> None:
        pass

    def record(self, *a, **k) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Handle:
    def wait(self, *a, **k) -> None:
        pass

    def is_completed(self) -> bool:
        return True


def _handle(*a, **k) -> _Handle:
    return _Handle()


def stub_cuda(torch) -> None:
    """torch.cuda's stream / event / synchronize API as no-ops on a CPU-only torch."""
    cuda = torch.cuda
    cuda.synchronize = lambda *a, **k: None
    cuda.stream = lambda s=None: contextlib.nullcontext()
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_device = lambda: torch.device("cpu")
    cuda.is_available = lambda: True
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.record_stream = lambda self, *a, **k: None


def shim_old_release(torch) -> None:
    """What 0.5.x / 0.6.0 import that torch 2 and numpy 2 no longer have."""
    six = types.ModuleType("torch._six")
    six.inf = float("inf")
    six.string_classes = (str, bytes)
    six.int_classes = int
    sys.modules["torch._six"] = six
    import numpy

    if not hasattr(numpy, "BUFSIZE"):
        numpy.BUFSIZE = 8192


def fake_world(world: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


# ---------------------------------------------------------------- timing

# The calling thread's CPU time: what the routine itself costs, even while other
# processes on this (shared) machine take the core away from it now and then.
_clock = time.thread_time_ns


class Recorder:
    """Per-call times and counts of wrapped routines, per step."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[int, dict[str, int]]]] = collections.defaultdict(list)
        self.counts: collections.Counter = collections.Counter()
        self.exclude_ns = 0

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] += n

    def wrap(self, name: str, fn, features):
        """A wrapper timing ``fn``; ``features(args)`` gives counts known before the call
        (the counters bumped inside add the rest). Nested timed calls are excluded from
        the outer one (a flush inside a gradient hook is timed as a flush)."""
        rec = self

        def timed(*args, **kwargs):
            outer_counts, outer_excl = rec.counts, rec.exclude_ns
            rec.counts = collections.Counter(features(args) if features else {})
            rec.exclude_ns = 0
            t0 = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = _clock() - t0
                rec.calls[name].append((dt - rec.exclude_ns, dict(rec.counts)))
                rec.counts, rec.exclude_ns = outer_counts, outer_excl + dt

        return timed

    def reset(self) -> None:
        self.calls.clear()


def min_over_steps(per_step: list[dict[str, list]]) -> dict[str, list[tuple[int, dict[str, int]]]]:
    """Each call's minimum time over the steps (calls repeat in the same order with the
    same counts in every steady-state step)."""
    out = {}
    for name in per_step[0]:
        runs = [s[name] for s in per_step if len(s.get(name, ())) == len(per_step[0][name])]
        out[name] = [(min(r[i][0] for r in runs), runs[0][i][1]) for i in range(len(runs[0]))]
    return out


def fit(calls: list[tuple[int, dict[str, int]]], features: list[str]) -> dict:
    """Least squares: time = fixed + sum(coef x count), coefficients kept >= 0 (a
    negative one is dropped and the rest refitted)."""
    import numpy as np

    names = list(features)
    y = np.array([float(t) for t, _ in calls])
    intercept = True
    while True:
        X = np.array([([1.0] if intercept else []) + [float(c.get(f, 0)) for f in names] for _, c in calls])
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        if intercept and coef[0] < 0 and names:
            intercept = False
            continue
        neg = [f for f, v in zip(names, coef[1 if intercept else 0:]) if v < 0]
        if not neg:
            break
        names = [f for f in names if f not in neg]
    pred = X @ coef
    if not intercept:
        coef = np.concatenate([[0.0], coef])
    resid = y - pred
    out = {"fixed_ns": round(float(coef[0])), "calls": len(calls),
           "median_call_ns": round(float(np.median(y))),
           "rms_residual_ns": round(float(np.sqrt(np.mean(resid ** 2)))),
           "r2": round(float(1 - np.sum(resid ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-9)), 3)}
    for f in features:
        out[f"per_{f}_ns"] = round(float(coef[1 + names.index(f)])) if f in names else 0
    out["total_counts"] = {f: int(sum(c.get(f, 0) for _, c in calls)) for f in features}
    return out


def time_call(fn, n: int = 20000, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean time of ``n`` calls, in ns."""
    for _ in range(n // 10):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = _clock()
        for _ in range(n):
            fn()
        runs.append((_clock() - t0) / n)
    return statistics.median(runs)


def primitives(torch) -> dict:
    """One small PyTorch op's dispatch and one c10d collective call on the fake backend."""
    import torch.distributed as dist

    x = torch.zeros(256)
    y = torch.zeros(WORLD * 4)
    z = torch.zeros(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c10d = time_call(lambda: dist.all_gather_into_tensor(y, z, async_op=True), n=2000)
    return {"torch_op_ns": round(time_call(lambda: x.mul_(1.0))),
            "torch_empty_ns": round(time_call(lambda: torch.empty(256))),
            "c10d_all_gather_ns": round(c10d)}


def count_gathers(model, rec: Recorder) -> None:
    """Count the parameters each ``all_gather_coalesced`` call gathers (every parameter's
    bound method wrapped; the call itself unchanged)."""
    for _, p in model.named_parameters():
        f = p.all_gather_coalesced

        def agc(params, *a, _f=f, **k):
            params = list(params)
            rec.count("gathered", len(params))
            return _f(params, *a, **k)

        p.all_gather_coalesced = agc


def count_queue_pops(module, rec: Recorder) -> None:
    """Count the trace-queue pops of a release's coordinator ``module``: its ``collections``
    name replaced by a copy whose deque counts ``popleft`` (the module's own code is
    untouched, and other modules keep the real deque)."""
    base = collections.deque

    class CountingDeque(base):
        def popleft(self):
            rec.count("scanned")
            return base.popleft(self)

    module.collections = types.SimpleNamespace(**{k: getattr(collections, k) for k in dir(collections)
                                                  if not k.startswith("__")})
    module.collections.deque = CountingDeque


def count_waits(pp, rec: Recorder) -> None:
    """Count the parameters whose gather a fetch completes: a coalesced handle's first
    wait() unflattens each of its parameters (a loop over the ranks each), so that cost
    falls on the fetch that waits, not on the one that gathered."""
    for cls_name in ("AllGatherCoalescedHandle", "AllGatherHandle"):
        cls = getattr(pp, cls_name, None)
        if cls is None or getattr(cls.wait, "_counted", False):
            continue
        orig = cls.wait

        def wait(self, *a, _orig=orig, _name=cls_name, **k):
            done = getattr(self, "complete", None)
            if done is None:
                done = getattr(self, f"_{_name}__complete", False)
            if not done:
                params = getattr(self, "params", None) or getattr(self, f"_{_name}__params", None)
                rec.count("waited", len(params) if params is not None else 1)
            return _orig(self, *a, **k)

        wait._counted = True
        cls.wait = wait


# ---------------------------------------------------------------- releases 0.5.10 and 0.6.0


class OldRelease:
    """DeepSpeed 0.5.10 or 0.6.0 attached to the model by hand: the real Init's
    parameter conversion, the real stage-3 optimizer class's hooks and gradient path,
    its own coordinator; only the optimizer's constructor (CUDA allocations) is
    replaced by setting the attributes those routines read."""

    def __init__(self, version: str, source: str):
        sys.path.insert(0, source)
        import torch

        shim_old_release(torch)
        stub_cuda(torch)
        fake_world(WORLD)
        warnings.simplefilter("ignore")
        import deepspeed.runtime.zero.partition_parameters as pp
        import deepspeed.runtime.zero.stage3 as s3

        self.version, self.torch, self.pp, self.s3 = version, torch, pp, s3
        self.new = version != "0.5.10"
        # collectives: no-ops returning a finished handle
        if self.new:
            pp.torch_allgather_fn = _handle
            s3.Event = _Event
            s3.Stream = _Stream
            # the first reset_step's cross-rank check of the trace (once per run: a collective)
            s3.assert_ints_same_as_other_ranks = lambda ints: None
            import deepspeed.runtime.comm.coalesced_collectives as cc

            cc.torch_reduce_scatter_fn = _handle
            self.cc = cc
        for name in ("_all_gather_base", "all_gather", "reduce_scatter", "_reduce_scatter_base", "all_reduce"):
            setattr(pp.dist, name, _handle)
        self.Stage3 = next(c for c in vars(s3).values()
                           if isinstance(c, type) and hasattr(c, "pre_sub_module_forward_function"))

    def build(self, rec: Recorder):
        torch, pp, s3 = self.torch, self.pp, self.s3
        from runtime.torch_models import build_model

        init = pp.Init.__new__(pp.Init)
        init.ds_process_group = torch.distributed.group.WORLD
        init.rank, init.world_size = 0, WORLD
        init.local_device = init.remote_device = torch.device("cpu")
        init.pin_memory, init.param_swapper, init.use_all_gather_base = False, None, True
        init.dtype = torch.float32
        model = build_model(model_config())
        model.gradient_checkpointing_enable(True)
        for _, p in model.named_parameters():
            init._convert_to_deepspeed_param(p)
            init._partition([p])
        for m in model.modules():
            pp._init_external_params(m)
        opt = self.Stage3.__new__(self.Stage3)
        opt.module = model
        if self.new:
            s3._inject_parameters(model, s3.ZeROOrderedDict)
            coord = s3.PartitionedParameterCoordinator(prefetch_bucket_sz=PREFETCH_BUCKET,
                                                       max_reuse_distance_in_numel=REUSE,
                                                       max_available_parameters_in_numel=LIVE,
                                                       allgather_stream=_Stream())
        else:
            coord = s3.PartitionedParameterCoordinator(comm_stream=_Stream(), max_reuse_distance_in_numel=REUSE,
                                                       max_available_parameters_in_numel=LIVE)
        opt.param_coordinator = coord
        opt.prefetch_elements = PREFETCH_BUCKET
        opt.params_in_nvme_and_cpu = False
        opt.persistence_threshold = PERSISTENCE
        opt.persistent_parameters = self.Stage3.persistent_parameters(opt)
        opt.setup_zero_stage3_hooks()
        pers = opt.persistent_parameters
        pers[0].all_gather(pers)
        self._gradient_state(opt, model)
        self._instrument(opt, coord, init, rec)
        self.model, self.opt, self.init, self.coord = model, opt, init, coord

    # -- the gradient path's state, as the constructor leaves it
    def _gradient_state(self, opt, model) -> None:
        torch, S = self.torch, self.Stage3
        params = [p for _, p in model.named_parameters()]
        opt.fp16_groups = [params]
        opt.dtype = torch.float32
        opt.device = torch.device("cpu")
        opt.overlap_comm = opt.contiguous_gradients = True
        opt.reduce_bucket_size = BUCKET
        opt.reduce_scatter = True
        opt.offload_optimizer = opt.offload_param = opt.swap_optimizer = opt.offload_param_pin_memory = False
        opt.dp_process_group = torch.distributed.group.WORLD
        opt.micro_step_id = 0
        opt.is_gradient_accumulation_boundary = True
        opt.param_id, opt.param_dict = {}, {}
        opt.params_already_reduced = []
        for i, p in enumerate(params):
            opt.param_id[id(p)] = i
            opt.param_dict[i] = p
            opt.params_already_reduced.append(False)
        opt.extra_large_param_to_reduce = None
        opt.grads_in_ipg_bucket, opt.params_in_ipg_bucket = [], []
        if not self.new:  # a property over the bucket from 0.6.0 (s3:1009-1011)
            opt.elements_in_ipg_bucket = 0
        opt.previous_reduced_grads = None
        opt.grads_in_partition = None
        opt.averaged_gradients = {}
        opt.postscale_gradients, opt.gradient_predivide_factor = True, 1.0
        opt.communication_data_type = torch.float32
        opt.reduction_stream = opt.copy_grad_stream = _Stream()
        opt.grad_position = {}
        S.set_grad_positions(opt)
        if self.new:
            prefix = "_DeepSpeedZeroOptimizer_Stage3__"
            flat = torch.zeros(sum(p.ds_tensor.ds_numel for p in params))
            parts, off = {}, 0
            for p in params:
                parts[p.ds_id] = flat.narrow(0, off, p.ds_tensor.numel())
                off += p.ds_tensor.numel()
            for name, value in (("ipg_bucket_flat_buffer", torch.empty(BUCKET)),
                                ("param_id_to_grad_partition", parts), ("params_in_ipg_bucket", []),
                                ("param_reduce_events", collections.deque()), ("max_param_reduce_events", 2),
                                ("reduce_and_partition_stream", _Stream()), ("allgather_stream", _Stream()),
                                ("inf_or_nan_tracker", torch.zeros(1, dtype=torch.bool))):
                setattr(opt, prefix + name, value)
            opt.communication_data_type = torch.float32
            opt.postscale_gradients = True
        S.create_reduce_and_remove_grad_hooks(opt)

    # -- timers and counters on the routines
    def _instrument(self, opt, coord, init, rec: Recorder) -> None:
        s3, S = self.s3, self.Stage3

        def n_params(args):
            m = args[0]
            ext = list(m.ds_external_parameters()) if hasattr(m, "ds_external_parameters") else []
            return {"param": len(list(m.named_parameters(recurse=False))) + len(ext)}

        for name in ("pre_sub_module_forward_function", "pre_sub_module_backward_function"):
            setattr(opt, name, rec.wrap("fetch", getattr(opt, name), n_params))
        for name in ("post_sub_module_forward_function", "post_sub_module_backward_function"):
            setattr(opt, name, rec.wrap("release", getattr(opt, name), n_params))
        # what a hook did: parameters gathered, released, examined for prefetch
        if self.new:
            count_gathers(opt.module, rec)
            orig_free = self.pp.free_param

            def free(param):
                rec.count("freed")
                return orig_free(param)

            self.pp.free_param = free
            count_queue_pops(s3, rec)
            count_waits(self.pp, rec)
        else:
            orig_one = init._allgather_param

            def one(param, *a, **k):
                rec.count("gathered")
                return orig_one(param, *a, **k)

            init._allgather_param = one
            orig_coal = init._allgather_params_coalesced

            def coal(plist, *a, **k):
                rec.count("gathered", len(plist))
                return orig_coal(plist, *a, **k)

            init._allgather_params_coalesced = coal
            orig_part = init._partition_param

            def part(param, *a, **k):
                if param.ds_status is self.pp.ZeroParamStatus.AVAILABLE:
                    rec.count("freed")
                return orig_part(param, *a, **k)

            init._partition_param = part
            orig_gap = s3.get_all_parameters

            def gap(m, recurse=False):
                ps = list(orig_gap(m, recurse))
                rec.count("scanned", len(ps))
                return iter(ps)

            s3.get_all_parameters = gap
            # the debug norm is a device op (a kernel and a host read), timed apart:
            # here it returns a ready 0-d tensor, whose formatting reads it (.item())
            zero = self.torch.zeros(())
            for _, p in opt.module.named_parameters():
                p.norm = lambda *a, _z=zero, **k: _z
        # gradient hooks and flushes
        grad_hook = "reduce_independent_p_g_buckets_and_remove_grads"
        setattr(opt, grad_hook, rec.wrap("grad_hook", getattr(opt, grad_hook), None))
        if self.new:
            fname = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
        else:
            fname = "reduce_ipg_grads"
        flush = getattr(opt, fname)

        def flush_features(args):
            n = len(getattr(opt, "_DeepSpeedZeroOptimizer_Stage3__params_in_ipg_bucket", None) or
                    opt.params_in_ipg_bucket)
            return {"grad": n}

        setattr(opt, fname, rec.wrap("flush", flush, flush_features))

    def step(self) -> None:
        """One forward + backward + the end-of-backward work, as the engine runs it."""
        torch, opt, S = self.torch, self.opt, self.Stage3
        ids = torch.randint(0, VOCAB, (2, 16))
        if not self.new:
            # backward(): the bucket buffers made per backward (s3:2929-2942)
            opt.ipg_buffer = [torch.empty(BUCKET), torch.empty(BUCKET)]
            opt.ipg_index = 0
            opt.param_coordinator.reset_step()
        loss = self.model(ids, ids)
        loss.backward()
        if self.new:
            opt.param_coordinator.reset_step()
            S.independent_gradient_partition_epilogue(opt)
            opt.param_coordinator.release_and_reset_all(opt.module) if hasattr(
                opt.param_coordinator, "release_and_reset_all") else None
        else:
            S._partition_all_parameters(opt)
            S.independent_gradient_partition_epilogue(opt)
            opt.param_coordinator.finish_tracing(print_trace=True)
        for p in self.model.parameters():
            p.grad = None
        pers = opt.persistent_parameters
        pers[0].all_gather(pers)
        for i in range(len(opt.params_already_reduced)):
            opt.params_already_reduced[i] = False

    def debug_string_ns(self) -> int | None:
        """0.5.10's fetch formats f"Param {...} norm={param.norm()}" per parameter: the
        f-string with a 0-d tensor (formatting reads it), passed to print_rank_0."""
        if self.new:
            return None
        from deepspeed.utils.debug import debug_param2name_id_shape_device

        p = next(self.model.parameters())
        t = self.torch.zeros(())
        s3 = self.s3
        return round(time_call(lambda: s3.print_rank_0(f"Param {debug_param2name_id_shape_device(p)} norm={t}",
                                                     force=False), n=5000))


# ---------------------------------------------------------------- release 0.19.8


class CurrentRelease:
    """The installed DeepSpeed on its CPU accelerator: the real Init, parameter offload
    hooks (DeepSpeedZeRoOffload) and stage-3 optimizer, built as deepspeed.initialize
    builds them, on the fake process group; collectives stubbed."""

    def __init__(self):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        for k, v in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", str(WORLD)), ("LOCAL_WORLD_SIZE", "1"),
                     ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29555")):
            os.environ.setdefault(k, v)
        warnings.simplefilter("ignore")
        import torch

        fake_world(WORLD)
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
                setattr(dcomm, name, _handle)
        self.dcomm = dcomm

    def build(self, rec: Recorder):
        torch, deepspeed = self.torch, self.deepspeed
        from runtime.torch_models import build_model

        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
               "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": PREFETCH_BUCKET,
                                     "stage3_param_persistence_threshold": PERSISTENCE - 1,
                                     "stage3_max_reuse_distance": REUSE, "stage3_max_live_parameters": LIVE,
                                     "reduce_bucket_size": BUCKET}}
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = build_model(model_config())
        model.gradient_checkpointing_enable(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        self.engine, self.model = engine, model
        zopt = engine.optimizer
        off = zopt.parameter_offload
        coord = off.get_param_coordinator()

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


# ---------------------------------------------------------------- main


def measure(release, steps: int = STEPS, log=print) -> dict:
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
    return fits, calls


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


def derive(paths: list[str]) -> dict[str, dict[str, int]]:
    """HostCosts fields per release from the measurements at two or more world sizes:
    the calls of all of them fitted together, the loops over ranks as a per-rank term."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    out = {}
    for version in sorted({d["deepspeed"] for d in docs}):
        ds = [d for d in docs if d["deepspeed"] == version]

        def joint(routine, features, per_rank=()):
            calls = []
            for d in ds:
                for t, c in d["calls"].get(routine, []):
                    c = dict(c)
                    for f in per_rank:
                        c[f"{f}_x_rank"] = c.get(f, 0) * d["world"]
                    calls.append((t, c))
            return fit(calls, list(features) + [f"{f}_x_rank" for f in per_rank])

        fetch = joint("fetch", ["param", "gathered", "waited"], per_rank=("gathered", "waited"))
        release = joint("release", ["param", "freed"])
        grad = joint("grad_hook", [])
        flush = joint("flush", ["grad"], per_rank=("grad",))
        debug = next((d["debug_string_ns"] for d in ds if d.get("debug_string_ns")), 0)
        small = [d for d in ds if d["world"] == min(x["world"] for x in ds)][0]
        prim = small["primitives"]

        def scaled(v: float) -> int:
            return int(round(v * CPU_SCALE, -2))

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
            "reduce_param_ns": scaled(flush["per_grad_ns"]),
            "reduce_param_rank_ns": scaled(flush["per_grad_x_rank_ns"]),
            "debug_string_ns": scaled(debug),
            "_fit": {"fetch_r2": fetch["r2"], "release_r2": release["r2"], "flush_r2": flush["r2"],
                     "fetch_rms_ns": fetch["rms_residual_ns"], "worlds": sorted(d["world"] for d in ds),
                     "date": ds[0]["date"], "cpu": ds[0]["machine"]["cpu"]},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    global WORLD
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--derive":
        print(json.dumps(derive(argv[1:]), indent=1))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed", required=True, choices=("0.5.10", "0.6.0", "0.19.8"))
    ap.add_argument("--source", help="the unpacked sdist of an older release (its root, holding deepspeed/)")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--world", type=int, default=WORLD, help="ranks of the fake process group (default 64)")
    args = ap.parse_args(argv)
    WORLD = args.world
    if args.deepspeed != "0.19.8" and not args.source:
        ap.error(f"--source: DeepSpeed {args.deepspeed} is read from its unpacked sdist")
    release = CurrentRelease() if args.deepspeed == "0.19.8" else OldRelease(args.deepspeed, args.source)
    import torch

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    fits, calls = measure(release, args.steps, log)
    doc = {
        "deepspeed": args.deepspeed,
        "fits": fits,
        # each call's minimum time over the steps, with its counts: what derive() fits
        "calls": {k: [[t, c] for t, c in v] for k, v in calls.items()},
        "debug_string_ns": release.debug_string_ns(),
        "primitives": primitives(torch),
        "world": WORLD,
        "model": {"hidden": HIDDEN, "ffn": FFN, "layers": LAYERS, "vocab": VOCAB},
        "config": {"prefetch_bucket": PREFETCH_BUCKET, "persistence": PERSISTENCE, "reuse": REUSE, "live": LIVE},
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "date": datetime.date.today().isoformat(),
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    fields = {}
    for line in info:
        k, _, v = line.partition(":")
        fields.setdefault(k.strip(), v.strip())
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model "
            f"{fields.get('model', '?')}, {fields.get('cpu MHz', '?')} MHz)")


if __name__ == "__main__":
    sys.exit(main())
