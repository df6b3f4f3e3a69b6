"""ZeRO stage 3 lowered to IR, following DeepSpeed's coordinator step by step.

Models the steady state (the parameter trace is complete, so prefetching is on) of
deepspeed/runtime/zero/partitioned_param_coordinator.py and stage3.py (0.19.x), as
summarised in reference/deepspeed-zero3.md:

* the module trace of one step: forward in order; backward in reverse, each
  checkpointed layer re-running its forward (fetching again) before its backward;
* fetch of a submodule: one coalesced all-gather of its parameters that are not
  available, on the all-gather stream; waiting on in-flight parameters records an
  event and blocks the host on the oldest when more than 2 are outstanding; then the
  compute stream waits on the whole all-gather stream;
* prefetch: pop this module's entries from the parameter queue, then walk the queue
  up to min(max_live - available numel, prefetch bucket) elements, gathering the
  parameters not yet available in one more coalesced call;
* release after use unless persistent, prefetched for a later use, or used again
  within ``max_reuse_distance`` elements of upcoming trace;
* gradients into a bucket flushed before it would exceed ``reduce_bucket_size``: the
  reduce stream waits on compute, copies into the contiguous buffer, interleaves
  (torch.cat) and runs one reduce-scatter; 2 outstanding reduce events at most; end
  of backward flushes and syncs the reduce stream;
* optimizer step: release everything, (fp16) overflow all-reduce, per-parameter
  gradient norms in fp64 (each shard converted into a fresh tensor), the norm
  all-reduce; per sub-group the gradients flattened into a fresh fp32 tensor, Adam,
  copy-back, that tensor released; synchronous gather of persistent parameters.

Every gathered parameter, flat buffer, gradient, bucket and activation is an
alloc / free with its real size, so the allocator model sees DeepSpeed's pattern.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from math import ceil

from commsim.ir import ops as O
from commsim.ir.ops import Phase
from commsim.ir.errors import CommsimInputError
from commsim.models.spec import Kernel, ModelDescription, ModuleSpec, ParamSpec
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.dsconfig import DeepSpeedConfig
from commsim.strategies.groups import check_hierarchy, rank_groups
from commsim.strategies.knobs import HostCosts, Knobs
from commsim.strategies.optimizer import adam_step, fp64_norms
from commsim.strategies.zero3_trace import CHECKPOINT_STYLES, TraceEntry, module_trace

COMPUTE = "compute"
NA, INFLIGHT, AVAILABLE = "not_available", "inflight", "available"


@dataclass
class _Handle:
    params: list[ParamSpec]
    flat_buffer: str | None  # coalesced flat output, unflattened and freed on wait
    out_bytes: int
    waited: bool = False


class Zero3Lowering:
    """One rank's program (all ranks are symmetric in plain ZeRO-3)."""

    def __init__(self, md: ModelDescription, world_size: int, ds: DeepSpeedConfig, knobs: Knobs,
                 costs: HostCosts, checkpointing: bool, grad_accum: int, checkpoint_style: str = "reentrant",
                 gpus_per_node: int | None = None):
        z = ds.zero
        if z.offload_param.device != "none" or z.offload_optimizer.device not in ("none", "cpu"):
            raise CommsimInputError("ds_config: zero_optimization: only offload_optimizer to cpu is modelled")
        gpn = gpus_per_node or world_size
        self.hpz = z.zero_hpz_partition_size if z.zero_hpz_partition_size > 1 else 1
        check_hierarchy(world_size, gpn, self.hpz, z.mics_shard_size, ds.source,
                        hierarchical=z.mics_hierarchical_params_gather)
        self.md, self.W, self.ds, self.z, self.knobs, self.costs = md, world_size, ds, z, knobs, costs
        self.checkpointing, self.grad_accum = checkpointing, grad_accum
        self.groups_of = lambda r: rank_groups(r, world_size, gpn, self.hpz, z.mics_shard_size,
                                               z.mics_hierarchical_params_gather)
        self.groups = self.groups_of(0)
        self.group = self.groups.world  # gradient norm, overflow
        self.pgroup = self.groups.partition  # parameter shards (world, or a MiCS shard group)
        self.n_part = len(self.pgroup)
        self.offload = z.offload_optimizer.device == "cpu"
        self.dt = ds.param_dtype_bytes
        self.dtype = {"bf16": O.DType.BF16, "fp16": O.DType.FP16, "fp32": O.DType.FP32}[ds.precision]
        self.ag_stream = "allgather" if z.overlap_comm else COMPUTE
        self.rs_stream = "reduce" if z.overlap_comm else COMPUTE
        self.b = ProgramBuilder()
        self.params = md.registered_params()  # ds_id / named_parameters order
        self.ds_id = {p.name: i for i, p in enumerate(self.params)}
        self.part = {p.name: ceil(p.numel / self.n_part) for p in self.params}
        self.persistent = self._persistent()
        self.trace = module_trace(md, checkpointing, checkpoint_style)
        self.n_ag = 0
        self.n_rs = 0

    # ------------------------------------------------------------ setup
    def _persistent(self) -> set[str]:
        thr, budget = self.z.param_persistence_threshold, self.z.model_persistence_threshold // self.n_part
        out, used = set(), 0
        for p in self.params:
            if p.numel <= thr and used + p.numel <= budget:
                out.add(p.name)
                used += p.numel
        return out

    def sub_groups(self) -> list[list[ParamSpec]]:
        """Parameters split into optimizer sub-groups of at most sub_group_size elements."""
        groups: list[list[ParamSpec]] = [[]]
        size = 0
        for p in self.params:
            if groups[-1] and size + p.numel > self.z.sub_group_size:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel
        return groups

    def _emit_setup(self) -> None:
        b = self.b
        for g, params in enumerate(self.sub_groups()):
            n = sum(self.part[p.name] for p in params)
            b.setup_alloc(f"flat16[{g}]", n * self.dt, f"16-bit parameter partition, sub-group {g}")
            # the reduced gradients' partition (grad_partitions_flat_buffer), in the
            # parameters' dtype
            b.setup_alloc(f"grad16[{g}]", n * self.dt, f"16-bit gradient partition, sub-group {g}")
            if self.offload:  # fp32 master, Adam state and fp32 gradients live in host memory
                continue
            # (the fp32 gradient is made per step: _prepare_fp32_grad_for_sub_group)
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                b.setup_alloc(f"{state}[{g}]", n * 4, f"fp32 {state} partition, sub-group {g}")
        if self.z.contiguous_gradients:
            b.setup_alloc("ipg_bucket", self.z.reduce_bucket_size * self.dt, "contiguous gradient bucket")
        pers = [p for p in self.params if p.name in self.persistent]
        if pers and self.knobs.defragment_persistent:
            b.setup_alloc("persistent", sum(p.numel for p in pers) * self.dt, "persistent parameters (contiguous)")
        else:
            for p in pers:
                b.setup_alloc(self._pbuf(p), self.part[p.name] * self.n_part * self.dt, f"persistent {p.name}")

    def _pbuf(self, p: ParamSpec) -> str:
        if p.name in self.persistent and self.knobs.defragment_persistent:
            return "persistent"
        return f"param:{p.name}"

    # ------------------------------------------------------------ all-gather
    def _all_gather(self, params: list[ParamSpec], why: str) -> None:
        params = sorted((p for p in params if self.status[p.name] == NA), key=lambda p: self.ds_id[p.name])
        if not params:
            return
        self.n_available += sum(p.numel for p in params)
        # hpZ: parameters with a secondary copy gather inside its group, first
        # (partitioned_param_coordinator.__all_gather_params_); the others over the partition group.
        sec = [p for p in params if p.name in self.secondary]
        for part in (sec, [p for p in params if p.name not in self.secondary]):
            if not part:
                continue
            batches = [part] if self.knobs.coalesced_collectives else [[p] for p in part]
            for batch in batches:
                self._all_gather_call(batch, why, secondary=part is sec)

    def _all_gather_call(self, batch: list[ParamSpec], why: str, secondary: bool = False) -> None:
        b, c, s = self.b, self.costs, self.ag_stream
        self.n_ag += 1
        k = self.n_ag
        shard = sum(self.part[p.name] for p in batch)
        out_bytes = shard * self.n_part * self.dt
        for p in batch:
            if self._pbuf(p) == "persistent":
                continue
            size = self.part[p.name] * self.n_part * self.dt  # storage of the padded full parameter
            b.alloc(self._pbuf(p), size, s, f"gathered {p.name}")
        names = tuple(dict.fromkeys(self._pbuf(p) for p in batch))
        flat = None
        if len(batch) > 1:
            flat = f"agflat[{k}]"
            b.alloc(flat, out_bytes, s, f"coalesced all-gather buffer {k}")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(s, f"ag{k}.copy_in", O.CopyDirection.D2D, shard * self.dt, buffers=(flat, "flat16[0]"))
        target = (flat,) if flat else names
        tmp = None
        if not self.knobs.flat_collectives:
            tmp = f"agtmp[{k}]"
            b.alloc(tmp, out_bytes, s, f"all-gather flatten buffer {k}")
            target = (tmp,)
        label = f"{self.b.phase.value}.ag{k}.{why}:{batch[0].name}" + (f"+{len(batch) - 1}" if len(batch) > 1 else "")
        g = self.groups
        if secondary:
            b.host("all_gather launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(s, label + ".hpz", O.CollectiveKind.ALL_GATHER, out_bytes, self.dtype, g.secondary,
                         buffers=target)
        elif g.inter is not None:
            # MiCS hierarchical (mics.py _hierarchical_all_gather_params): across nodes
            # (same local rank) into the output, a clone of that part copied to where the
            # intra-node gather expects it, then the gather inside the node
            stage = f"aghier[{k}]"
            mid = out_bytes // len(g.intra)
            b.host("all_gather launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(s, label + ".inter", O.CollectiveKind.ALL_GATHER, mid, self.dtype, g.inter, buffers=target)
            b.alloc(stage, mid, s, f"hierarchical all-gather clone {k}")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(s, f"ag{k}.hier_clone", O.CopyDirection.D2D, mid, buffers=target + (stage,))
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(s, f"ag{k}.hier_place", O.CopyDirection.D2D, mid, buffers=(stage,) + target)
            b.free(stage, s, f"hierarchical all-gather clone {k}")
            b.host("all_gather launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(s, label + ".intra", O.CollectiveKind.ALL_GATHER, out_bytes, self.dtype, g.intra,
                         buffers=target)
        else:
            b.host("all_gather launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(s, label, O.CollectiveKind.ALL_GATHER, out_bytes, self.dtype, self.pgroup, buffers=target)
        if tmp:
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(s, f"ag{k}.unflatten_list", O.CopyDirection.D2D, out_bytes, buffers=(tmp,) + ((flat,) if flat else names))
            b.free(tmp, s, f"all-gather flatten buffer {k}")
        if not self.knobs.fine_grained_sync:
            b.sync_device(f"ag{k}: device-wide synchronize after all-gather")
        handle = _Handle(batch, flat, out_bytes)
        for p in batch:
            self.status[p.name] = INFLIGHT
            self.handle[p.name] = handle

    def _wait(self, p: ParamSpec) -> None:
        """Wait on an in-flight parameter (the host-side part of fetch's wait loop)."""
        b, s = self.b, self.ag_stream
        m = self.knobs.max_outstanding_coalesced
        if m and len(self.fetch_events) > m:
            b.sync_ops((self.fetch_events[-(m + 1)],), "fetch back-pressure: oldest outstanding all-gather")
        h = self.handle.pop(p.name)
        if not h.waited:
            h.waited = True
            if h.flat_buffer is not None:
                names = tuple(dict.fromkeys(self._pbuf(q) for q in h.params))
                b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
                b.copy(s, f"unflatten {h.params[0].name}+{len(h.params) - 1}", O.CopyDirection.D2D,
                       sum(q.numel for q in h.params) * self.dt, buffers=(h.flat_buffer,) + names)
                b.free(h.flat_buffer, s, "coalesced all-gather buffer")
        self.status[p.name] = AVAILABLE
        last = b.last_on_stream.get(s)
        if last is not None:
            self.fetch_events.append(last)

    # ------------------------------------------------------------ fetch / release
    def _fetch(self, i: int, e: TraceEntry) -> tuple[O.OpId, ...]:
        b, c = self.b, self.costs
        m = e.module
        b.host(f"hook {m.path}", O.HostKind.MODULE_HOOK, c.module_hook_ns)
        params = sorted({p.name: p for p in m.params}.values(), key=lambda p: self.ds_id[p.name])
        for p in params:
            self.holders[p.name].add(m.path)
        examined = len(params)
        self._all_gather(params, "fetch")
        for p in params:
            if self.status[p.name] == INFLIGHT:
                self._wait(p)
        deps = b.wait_stream(self.ag_stream) if self.knobs.fine_grained_sync and self.ag_stream != COMPUTE else ()
        # Prefetch (trace complete in the steady state).
        not_fetched = {p.name for p in params if self.most_recent[p.name] < i}
        discarded: set[str] = set()
        while self.queue and len(discarded) < len(not_fetched):
            name, used_at = self.queue.popleft()
            self.most_recent[name] = used_at
            discarded.add(name)
        assert discarded == not_fetched, (i, m.path, discarded, not_fetched)
        if self.z.prefetch_bucket_size > 0:
            budget = min(self.z.max_live_parameters - self.n_available, self.z.prefetch_bucket_size)
            chosen: dict[str, ParamSpec] = {}
            numel = 0
            while self.queue and numel < budget:
                name, used_at = self.queue.popleft()
                examined += 1
                self.most_recent[name] = max(self.most_recent[name], used_at)
                if self.status[name] == NA and name not in chosen:
                    chosen[name] = self.by_name[name]
                    numel += self.by_name[name].numel
            if chosen:
                self._all_gather(list(chosen.values()), "prefetch")
        if not self.knobs.precomputed_fetch:
            b.host(f"fetch decisions {m.path}", O.HostKind.PYTHON, c.fetch_decision_per_param_ns * max(examined, 1))
        if self.knobs.debug_string_ops and params:
            b.host("debug string", O.HostKind.DEBUG, c.debug_string_ns)
            norm = b.compute(COMPUTE, f"{m.path}.debug_norm", O.ComputeKind.ELEMENTWISE, sum(p.numel for p in params),
                             sum(p.numel for p in params) * self.dt, 4, deps=deps,
                             buffers=tuple(dict.fromkeys(self._pbuf(p) for p in params)))
            cp = b.copy(COMPUTE, f"{m.path}.debug_item", O.CopyDirection.D2H, 4, deps=(norm,))
            b.sync_ops((cp,), "debug string .item()")
        return deps

    def _release(self, step_id: int, e: TraceEntry) -> None:
        m = e.module
        release = {p.name for p in m.params if p.name not in self.persistent}
        release = {n for n in release if self.most_recent[n] <= step_id}
        traversed = 0
        for later in self.trace[step_id:]:
            if not later.fetch:  # only hook calls are positions of DeepSpeed's trace
                continue
            if traversed >= self.z.max_reuse_distance:
                break
            for p in later.module.params:
                release.discard(p.name)
                traversed += p.numel
        for p in sorted({p.name: p for p in m.params}.values(), key=lambda p: self.ds_id[p.name]):
            holders = self.holders[p.name]
            holders.discard(m.path)
            # ds_active_sub_modules: a parameter another open module still uses stays.
            if p.name in release and self.status[p.name] == AVAILABLE and not holders:
                self._free_param(p)

    def _free_param(self, p: ParamSpec) -> None:
        if self.hpz > 1 and p.name not in self.secondary:
            # hpZ: partitioning an available parameter keeps a secondary shard of it,
            # 1/h of the padded parameter, until the optimizer step invalidates it
            # (partition_parameters._partition_param_sec)
            size = self.part[p.name] * self.n_part // self.hpz * self.dt
            self.b.alloc(f"sec:{p.name}", size, COMPUTE, f"hpZ secondary shard of {p.name}")
            self.b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
            self.b.copy(COMPUTE, f"hpz.secondary:{p.name}", O.CopyDirection.D2D, size,
                        buffers=(self._pbuf(p), f"sec:{p.name}"))
            self.secondary.add(p.name)
        self.status[p.name] = NA
        self.n_available -= p.numel
        if self._pbuf(p) != "persistent":
            self.b.free(self._pbuf(p), COMPUTE, f"release {p.name}")

    # ------------------------------------------------------------ compute
    def _kernels(self, e: TraceEntry) -> tuple[Kernel, ...]:
        return e.module.bwd if e.phase is Phase.BACKWARD else e.module.fwd

    def _run_module(self, mb: str, e: TraceEntry, deps: tuple[O.OpId, ...]) -> None:
        b, m = self.b, e.module
        pbufs = tuple(dict.fromkeys(self._pbuf(p) for p in m.params))
        extra: tuple[str, ...] = ()
        if e.phase is Phase.BACKWARD and m.bwd:
            for p in m.params:
                self.bwd_uses[p.name] -= 1
                if f"grad:{p.name}" not in self.live_grads:
                    self.live_grads.add(f"grad:{p.name}")
                    b.alloc(f"grad:{p.name}", p.numel * self.dt, COMPUTE, f"gradient {p.name}")
            extra = tuple(f"grad:{p.name}" for p in m.params)
        act = self._act_buffer(mb, e) if m.fwd else ()
        for j, k in enumerate(self._kernels(e)):
            b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
            suffix = "" if k.name in ("fwd", "bwd") else f".{k.name}"
            b.compute(COMPUTE, f"{mb}{m.path}.{e.phase.value}{suffix}", k.kind, k.flops, k.bytes_read, k.bytes_written,
                      k.gemm, deps=deps if j == 0 else (), buffers=pbufs + extra + act)
        if m.fwd:
            self._after_module(mb, e)
        if e.phase is Phase.BACKWARD and m.bwd:
            for p in sorted(m.params, key=lambda p: self.ds_id[p.name]):
                if self.bwd_uses[p.name] == 0 and p.name not in self.reduced:
                    self.reduced.add(p.name)
                    self._grad_ready(p)

    # Activations: outputs kept for backward (all of them without checkpointing; only
    # each layer's input with it), re-created by the recompute pass.
    def _act_buffer(self, mb: str, e: TraceEntry) -> tuple[str, ...]:
        m = e.module
        size = sum(k.bytes_written for k in m.fwd)
        name = f"{mb}act:{m.path}"
        if e.phase in (Phase.FORWARD, Phase.RECOMPUTE):
            if self.checkpointing and m.block is not None and e.phase is Phase.FORWARD:
                first = self.block_first.get(m.block) == m.path
                if first:
                    self.b.alloc(f"{mb}ckpt:{m.block}", self._ckpt_bytes(m), COMPUTE,
                                 f"checkpointed input of layer {m.block}")
            self.b.alloc(name, size, COMPUTE, f"activation {m.path}")
            return (name,)
        return (name,)

    def _ckpt_bytes(self, first: ModuleSpec) -> int:
        """A layer's input: tokens x hidden, or what the layer's first module reads."""
        if self.md.arch is not None:
            return self.md.tokens * self.md.arch.hidden * self.dt
        return max(1, sum(k.bytes_written for k in first.fwd))

    def _after_module(self, mb: str, e: TraceEntry) -> None:
        m = e.module
        name = f"{mb}act:{m.path}"
        if e.phase is Phase.FORWARD and self.checkpointing and m.block is not None:
            self.b.free(name, COMPUTE, "activation not kept (checkpointed layer)")
        elif e.phase is Phase.BACKWARD:
            self.b.free(name, COMPUTE, "activation consumed by backward")
            if self.checkpointing and m.block is not None and self.block_first.get(m.block) == m.path:
                self.b.free(f"{mb}ckpt:{m.block}", COMPUTE, f"checkpointed input of layer {m.block}")

    # ------------------------------------------------------------ gradients
    def _grad_ready(self, p: ParamSpec) -> None:
        self.b.host(f"grad hook {p.name}", O.HostKind.GRAD_HOOK, self.costs.grad_hook_ns)
        if self.bucket and self.bucket_elems + p.numel > self.z.reduce_bucket_size:
            self._flush()
        b, s = self.b, self.rs_stream
        if self.z.contiguous_gradients:
            b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
            b.copy(s, f"grad to bucket {p.name}", O.CopyDirection.D2D, p.numel * self.dt,
                   deps=b.wait_stream(COMPUTE) if s != COMPUTE else (), buffers=(f"grad:{p.name}", "ipg_bucket"))
            b.free(f"grad:{p.name}", COMPUTE, f"gradient {p.name} (now in the bucket)")
            self.live_grads.discard(f"grad:{p.name}")
        self.bucket.append(p)
        self.bucket_elems += p.numel

    def _flush(self) -> None:
        if not self.bucket:
            return
        b, c, s = self.b, self.costs, self.rs_stream
        mx = self.knobs.max_outstanding_coalesced
        if mx and len(self.reduce_events) > mx:
            b.sync_ops((self.reduce_events[-(mx + 1)],), "reduce back-pressure: oldest outstanding reduce")
        params = sorted(self.bucket, key=lambda p: self.ds_id[p.name])
        srcs = ("ipg_bucket",) if self.z.contiguous_gradients else tuple(f"grad:{p.name}" for p in params)
        wait = b.wait_stream(COMPUTE) if s != COMPUTE else ()
        batches = [params] if self.knobs.coalesced_collectives else [[p] for p in params]
        for batch in batches:
            self.n_rs += 1
            k = self.n_rs
            shard = sum(self.part[p.name] for p in batch)
            size = shard * self.n_part * self.dt
            inp = srcs
            to_free: list[str] = []
            if not (len(batch) == 1 and batch[0].numel % self.n_part == 0):
                buf = f"rsflat[{k}]"
                b.alloc(buf, size, s, f"interleaved reduce-scatter input {k}")
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.copy(s, f"rs{k}.interleave", O.CopyDirection.D2D, size, deps=wait, buffers=srcs + (buf,))
                wait = ()
                inp = (buf,)
                to_free.append(buf)
            tmp = None
            if not self.knobs.flat_collectives:
                tmp = f"rstmp[{k}]"
                b.alloc(tmp, size, s, f"reduce-scatter flatten buffer {k}")
                b.copy(s, f"rs{k}.flatten_list", O.CopyDirection.D2D, size, deps=wait, buffers=inp + (tmp,))
                wait = ()
                inp = (tmp,)
                to_free.append(tmp)
            b.host("reduce_scatter launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(s, f"bwd.rs{k}:{batch[0].name}" + (f"+{len(batch) - 1}" if len(batch) > 1 else ""),
                         O.CollectiveKind.REDUCE_SCATTER, size, self.dtype, self.pgroup, reduce_op=O.ReduceOp.SUM,
                         deps=wait, buffers=inp)
            wait = ()
            if self.groups.replica is not None and self.last_micro:
                # MiCS: the shard's gradient partitions, scaled, all-reduced (coalesced)
                # across the replicas at the accumulation boundary (mics.py
                # allreduce_mics_shard_grads, all_reduce_coalesced path)
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.compute(s, f"rs{k}.replica_scale", O.ComputeKind.ELEMENTWISE, shard, shard * self.dt,
                          shard * self.dt, buffers=inp)
                b.host("all_reduce launch", O.HostKind.LAUNCH, c.collective_launch_ns)
                b.collective(s, f"bwd.rs{k}.replica_allreduce", O.CollectiveKind.ALL_REDUCE, shard * self.dt,
                             self.dtype, self.groups.replica, reduce_op=O.ReduceOp.SUM, buffers=inp)
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(s, f"rs{k}.partition_grads", O.ComputeKind.ELEMENTWISE, shard, 2 * shard * self.dt,
                      shard * self.dt, buffers=inp + ("grad16[0]",))
            for buf_name in to_free:
                b.free(buf_name, s, "reduce-scatter buffer")
            if not self.offload:
                continue
            if self.last_micro:
                # offload at the boundary: per-parameter norm, .to(fp32) on the device,
                # then a non-blocking copy into the host's fp32 gradient
                # (stage3._offload_grad_partition_at_boundary)
                tmp = f"grad32tmp[{k}]"
                b.alloc(tmp, shard * 4, s, f"fp32 gradient partition for the host {k}")
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.compute(s, f"rs{k}.offload_norm_and_cast", O.ComputeKind.ELEMENTWISE, 3 * shard,
                          2 * shard * self.dt, shard * 4, buffers=("grad16[0]", tmp))
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.copy(s, f"rs{k}.offload_grad_d2h", O.CopyDirection.D2H, shard * 4, buffers=(tmp,))
                b.free(tmp, s, f"fp32 gradient partition for the host {k}")
        if not self.z.contiguous_gradients:
            for p in params:
                b.free(f"grad:{p.name}", COMPUTE, f"gradient {p.name} (reduced)")
                self.live_grads.discard(f"grad:{p.name}")
        last = b.last_on_stream.get(s)
        if last is not None:
            self.reduce_events.append(last)
        self.bucket, self.bucket_elems = [], 0

    # ------------------------------------------------------------ optimizer
    def _optimizer_step(self) -> None:
        b, c = self.b, self.costs
        b.phase = Phase.OPTIMIZER
        for p in self.params:  # release everything, persistent parameters included
            if self.status[p.name] == AVAILABLE:
                self._free_param(p)
        total = sum(self.part.values())
        grads = "grad16[0]"
        if self.ds.precision == "fp16":
            k = b.compute(COMPUTE, "optimizer.overflow_check", O.ComputeKind.ELEMENTWISE, total, total * self.dt, 4,
                          buffers=(grads,))
            b.reduce_to_host("optimizer.overflow_allreduce", 4, O.DType.FP32, self.group, O.ReduceOp.MAX, 0,
                             "overflow .item()", deps=(k,))
        if self.offload:
            pass  # the per-parameter norms were taken as the gradients left for the host
        else:
            # per parameter shard, in fp64; without the fused-norm fix the host reads
            # each norm before the next
            fp64_norms(b, COMPUTE, "optimizer.norm", [(p.name, self.part[p.name]) for p in self.params], "grad16[0]",
                       self.dt, c.launch_ns, item_each=not self.knobs.fused_grad_norm)
        b.reduce_to_host("optimizer.grad_norm_allreduce", 8, O.DType.FP64, self.group, O.ReduceOp.SUM,
                         c.collective_launch_ns, "global gradient norm")
        for g, params in enumerate(self.sub_groups()):
            n = sum(self.part[p.name] for p in params)
            if self.offload:
                # CPU Adam on the host's fp32 partition (DeepSpeedCPUAdam, synchronous on
                # the host thread), then the 16-bit partition copied back to the device;
                # copy_ without non_blocking, so the host waits for it
                # (stage3._optimizer_step, _reassign_or_swap_out_partitioned_parameters)
                b.host(f"cpu adam [{g}]", O.HostKind.OPTIMIZER, n * c.cpu_adam_ps_per_param // 1000)
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                cp = b.copy(COMPUTE, f"optimizer.params_h2d[{g}]", O.CopyDirection.H2D, n * self.dt,
                            buffers=(f"flat16[{g}]",))
                b.sync_ops((cp,), "copy of the updated partition to the device")
                continue
            # _prepare_fp32_grad_for_sub_group: the sub-group's gradients flattened into
            # a fresh tensor, then .to(fp32) (a second fresh tensor unless already fp32)
            grad32 = f"grad32[{g}]"
            b.alloc(grad32, n * 4, COMPUTE, f"flat fp32 gradient, sub-group {g} (per step)")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            if self.dt == 4:
                b.copy(COMPUTE, f"optimizer.flatten_grads[{g}]", O.CopyDirection.D2D, n * 4,
                       buffers=(f"grad16[{g}]", grad32))
            else:
                flat = f"gradflat16[{g}]"
                b.alloc(flat, n * self.dt, COMPUTE, f"flat 16-bit gradient, sub-group {g}")
                b.copy(COMPUTE, f"optimizer.flatten_grads[{g}]", O.CopyDirection.D2D, n * self.dt,
                       buffers=(f"grad16[{g}]", flat))
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.compute(COMPUTE, f"optimizer.grads_to_fp32[{g}]", O.ComputeKind.ELEMENTWISE, n, n * self.dt, n * 4,
                          buffers=(flat, grad32))
                b.free(flat, COMPUTE, f"flat 16-bit gradient, sub-group {g}")
            bufs = (f"fp32[{g}]", f"exp_avg[{g}]", f"exp_avg_sq[{g}]", grad32)
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(COMPUTE, f"optimizer.unscale_clip[{g}]", O.ComputeKind.ELEMENTWISE, n, n * 4, n * 4,
                      buffers=(grad32,))
            adam_step(b, COMPUTE, f"optimizer.adam[{g}]", n, bufs, self.ds.optimizer_impl, c.launch_ns)
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(COMPUTE, f"optimizer.copy_back[{g}]", O.ComputeKind.ELEMENTWISE, n, 4 * n, self.dt * n,
                      buffers=(f"fp32[{g}]", f"flat16[{g}]"))
            b.free(grad32, COMPUTE, f"fp32 gradient, sub-group {g} (_release_sub_group)")
        pers = [p for p in self.params if p.name in self.persistent]
        if pers:
            # Synchronous gather (stage3._post_step -> Init._all_gather): one all-gather per
            # parameter, all launched, then all waited; no coordinator back-pressure.
            for p in pers:
                self._all_gather_call([p], "persistent")
            for p in pers:
                self.handle.pop(p.name)
                self.status[p.name] = AVAILABLE
            b.sync_stream(self.ag_stream, "synchronous gather of persistent parameters")
        for name in sorted(self.secondary, key=lambda n: self.ds_id[n]):  # invalidate_secondary_tensor
            b.free(f"sec:{name}", COMPUTE, f"hpZ secondary shard of {name} (invalidated after the step)")
        self.secondary.clear()

    # ------------------------------------------------------------ driver
    def program(self):
        self._emit_setup()
        self.by_name = {p.name: p for p in self.params}
        self.status = {p.name: (AVAILABLE if p.name in self.persistent else NA) for p in self.params}
        self.secondary: set[str] = set()  # hpZ: parameters holding a secondary shard
        self.handle: dict[str, _Handle] = {}
        self.fetch_events: list[O.OpId] = []
        self.reduce_events: list[O.OpId] = []
        self.block_first: dict[int, str] = {}
        for m in self.md.modules:
            if m.block is not None:
                self.block_first.setdefault(m.block, m.path)
        for micro in range(self.grad_accum):
            mb = f"mb{micro}." if self.grad_accum > 1 else ""
            self.last_micro = micro == self.grad_accum - 1
            # reset_step: queue from the recorded trace, nothing counted available.
            self.queue = deque((p.name, i) for i, e in enumerate(self.trace) if e.fetch
                               for p in sorted({q.name: q for q in e.module.params}.values(),
                                               key=lambda q: self.ds_id[q.name]))
            self.holders: dict[str, set[str]] = {p.name: set() for p in self.params}
            self.most_recent = {p.name: -10**10 for p in self.params}
            self.n_available = 0
            self.bwd_uses = {p.name: 0 for p in self.params}
            for e in self.trace:
                if e.phase is Phase.BACKWARD and e.run and e.module.bwd:
                    for p in e.module.params:
                        self.bwd_uses[p.name] += 1
            self.reduced: set[str] = set()
            self.live_grads: set[str] = set()
            self.bucket, self.bucket_elems = [], 0
            for i, e in enumerate(self.trace):
                self.b.phase = e.phase
                deps = self._fetch(i, e) if e.fetch else ()
                if e.run:
                    self._run_module(mb, e, deps)
                if e.release:
                    self._release(i + 1, e)
            self._flush()
            self.b.sync_stream(self.rs_stream, "end of backward: wait for gradient reduction")
        self._optimizer_step()
        return self.b.program()
