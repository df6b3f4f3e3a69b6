"""DeepSpeed 0.5.4, 0.5.10 and 0.6.0's ZeRO-3 attached to the host-cost model by hand, for
``runtime.ds_host_costs``: each release's sdist on ``sys.path``, its real parameter
conversion, hooks, coordinator and gradient path, device calls as no-ops."""

from __future__ import annotations

import collections
import sys
import warnings

from runtime.ds_host_setup import (BUCKET, LIVE, PERSISTENCE, PREFETCH_BUCKET, REUSE, VOCAB, NoopEvent, NoopStream,
                                   fake_world, model_config, noop_handle, shim_old_release, stub_cuda)
from runtime.ds_host_timing import Recorder, count_gathers, count_queue_pops, count_waits, time_call

# ---------------------------------------------------------------- releases 0.5.4, 0.5.10 and 0.6.0

# the releases before 0.6.0's coordinator (PrefetchCoordinator, per-module fetch in stage3.py)
PRE_COORDINATOR = ("0.5.4", "0.5.10")


class OldRelease:
    """DeepSpeed 0.5.4, 0.5.10 or 0.6.0 attached to the model by hand: the real Init's
    parameter conversion, the real stage-3 optimizer class's hooks and gradient path,
    its own coordinator; only the optimizer's constructor (CUDA allocations) is
    replaced by setting the attributes those routines read."""

    def __init__(self, version: str, source: str, world: int, bucket: int = BUCKET):
        self.world, self.bucket = world, bucket
        sys.path.insert(0, source)
        import torch

        shim_old_release(torch)
        stub_cuda(torch)
        fake_world(world)
        warnings.simplefilter("ignore")
        import deepspeed.runtime.zero.partition_parameters as pp
        import deepspeed.runtime.zero.stage3 as s3

        self.version, self.torch, self.pp, self.s3 = version, torch, pp, s3
        self.new = version not in PRE_COORDINATOR
        # collectives: no-ops returning a finished handle
        if self.new:
            pp.torch_allgather_fn = noop_handle
            s3.Event = NoopEvent
            s3.Stream = NoopStream
            # the first reset_step's cross-rank check of the trace (once per run: a collective)
            s3.assert_ints_same_as_other_ranks = lambda ints: None
            import deepspeed.runtime.comm.coalesced_collectives as cc

            cc.torch_reduce_scatter_fn = noop_handle
            self.cc = cc
        # (0.5.4's partition_parameters.py calls torch.distributed directly: the same module)
        for name in ("_all_gather_base", "all_gather", "reduce_scatter", "_reduce_scatter_base", "all_reduce"):
            setattr(torch.distributed, name, noop_handle)
        self.Stage3 = next(c for c in vars(s3).values()
                           if isinstance(c, type) and hasattr(c, "pre_sub_module_forward_function"))

    def build(self, rec: Recorder):
        torch, pp, s3 = self.torch, self.pp, self.s3
        from runtime.torch_models import build_model

        init = pp.Init.__new__(pp.Init)
        init.ds_process_group = torch.distributed.group.WORLD
        init.rank, init.world_size = 0, self.world
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
                                                       allgather_stream=NoopStream())
        else:
            coord = s3.PartitionedParameterCoordinator(comm_stream=NoopStream(), max_reuse_distance_in_numel=REUSE,
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
        opt.reduce_bucket_size = self.bucket
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
        opt.reduction_stream = opt.copy_grad_stream = NoopStream()
        opt.grad_position = {}
        S.set_grad_positions(opt)
        if self.new:
            prefix = "_DeepSpeedZeroOptimizer_Stage3__"
            flat = torch.zeros(sum(p.ds_tensor.ds_numel for p in params))
            parts, off = {}, 0
            for p in params:
                parts[p.ds_id] = flat.narrow(0, off, p.ds_tensor.numel())
                off += p.ds_tensor.numel()
            for name, value in (("ipg_bucket_flat_buffer", torch.empty(self.bucket)),
                                ("param_id_to_grad_partition", parts), ("params_in_ipg_bucket", []),
                                ("param_reduce_events", collections.deque()), ("max_param_reduce_events", 2),
                                ("reduce_and_partition_stream", NoopStream()), ("allgather_stream", NoopStream()),
                                ("inf_or_nan_tracker", torch.zeros(1, dtype=torch.bool))):
                setattr(opt, prefix + name, value)
            opt.communication_data_type = torch.float32
            opt.postscale_gradients = True
        S.create_reduce_and_remove_grad_hooks(opt)

    # -- timers and counters on the routines
    def _instrument(self, opt, coord, init, rec: Recorder) -> None:
        s3 = self.s3

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
            # the synchronous path: one call per parameter list (0.5.10's coalesced
            # _all_gather_base calls, pp:918-986; 0.5.4's list all_gather with the
            # Python-side copies after it, pp:884-938)
            sync_name = "_allgather_params_coalesced" if hasattr(init, "_allgather_params_coalesced") \
                else "_allgather_params"
            orig_coal = getattr(init, sync_name)

            def coal(plist, *a, **k):
                rec.count("gathered", len(plist))
                return orig_coal(plist, *a, **k)

            setattr(init, sync_name, coal)
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
            opt.ipg_buffer = [torch.empty(self.bucket), torch.empty(self.bucket)]
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
