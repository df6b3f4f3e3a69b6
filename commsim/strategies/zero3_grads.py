"""DeepSpeed ZeRO-3's gradient reduction: hooks, the bucket, reduce-scatter.

Models deepspeed/runtime/zero/stage3.py (0.19.x) with comm/coalesced_collectives.py,
as summarised in reference/deepspeed-zero3.md:

* each parameter's gradient is allocated at its module's first backward use and is
  ready after the last; its hook (``reduce_independent_p_g_buckets_and_remove_grads``)
  flushes the bucket first when adding it would exceed ``reduce_bucket_size``
  elements, then with ``contiguous_gradients`` copies the gradient into the
  preallocated bucket on the reduce stream (after the compute stream) and frees it;
* a flush (``__reduce_and_partition_ipg_grads``): host back-pressure on the oldest
  reduce when more than ``max_outstanding_coalesced`` are outstanding; per coalesced
  batch (one per bucket, or one per gradient without ``coalesced_collectives``) the
  per-rank chunks interleaved with padding into a flat buffer (torch.cat in
  ``reduce_scatter_coalesced``) unless a lone gradient divides evenly, an extra
  flatten copy without ``flat_collectives``, one reduce-scatter over the partition
  group, the shard copied into the gradient partition (``partition_grads``);
* MiCS: at the accumulation boundary each shard is scaled and all-reduced across the
  replica group (mics.py ``allreduce_mics_shard_grads``);
* offload_optimizer: at the boundary each shard is cast to fp32 on the device (with
  its norm) and copied to the host (stage3._offload_grad_partition_at_boundary);
* end of backward (``independent_gradient_partition_epilogue``): the last bucket
  flushed and the reduce stream synchronised.

State: the reduce-scatter count and the outstanding reduce events live for the whole
step (the constructor makes them); which gradients exist, are reduced, are still to be
used by backward, and the bucket are per forward + backward (``reset_micro_step``).
"""

from __future__ import annotations

from commsim.ir import ops as O
from commsim.ir.ops import Phase
from commsim.models.spec import ModuleSpec, ParamSpec
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.dsconfig import ZeroConfig
from commsim.strategies.knobs import HostCosts, Knobs
from commsim.strategies.zero3_layout import COMPUTE, Zero3Layout
from commsim.strategies.zero3_trace import TraceEntry


class GradReducer:
    """Gradient buckets and their reduce-scatters for one rank over one step."""

    def __init__(self, b: ProgramBuilder, layout: Zero3Layout, z: ZeroConfig, knobs: Knobs, costs: HostCosts,
                 trace: list[TraceEntry]):
        self.b, self.layout, self.z, self.knobs, self.costs = b, layout, z, knobs, costs
        # backward uses of each parameter in one forward + backward: its gradient is
        # ready after the last
        self.uses_per_pass = {p.name: 0 for p in layout.params}
        for e in trace:
            if e.phase is Phase.BACKWARD and e.run and e.module.bwd:
                for p in e.module.params:
                    self.uses_per_pass[p.name] += 1
        # per step
        self.n_rs = 0
        self.reduce_events: list[O.OpId] = []
        # per forward + backward (reset_micro_step)
        self.at_boundary = False  # the last micro-step before the optimizer step
        self.bwd_uses: dict[str, int] = {}  # backward uses still to come
        self.reduced: set[str] = set()
        self.live_grads: set[str] = set()  # gradient buffers allocated and not yet freed
        self.bucket: list[ParamSpec] = []
        self.bucket_elems = 0

    def reset_micro_step(self, at_boundary: bool) -> None:
        self.at_boundary = at_boundary
        self.bwd_uses = dict(self.uses_per_pass)
        self.reduced = set()
        self.live_grads = set()
        self.bucket, self.bucket_elems = [], 0

    def emit_setup(self) -> None:
        if self.z.contiguous_gradients:
            self.b.setup_alloc("ipg_bucket", self.z.reduce_bucket_size * self.layout.dt, "contiguous gradient bucket")

    # ------------------------------------------------------------ backward of a module
    def before_backward(self, m: ModuleSpec) -> tuple[str, ...]:
        """Before ``m``'s backward kernels: count the use, allocate gradients not yet
        made; the buffers the kernels write."""
        for p in m.params:
            self.bwd_uses[p.name] -= 1
            if f"grad:{p.name}" not in self.live_grads:
                self.live_grads.add(f"grad:{p.name}")
                self.b.alloc(f"grad:{p.name}", p.numel * self.layout.dt, COMPUTE, f"gradient {p.name}")
        return tuple(f"grad:{p.name}" for p in m.params)

    def after_backward(self, m: ModuleSpec) -> None:
        """After ``m``'s backward kernels: the hooks of gradients used for the last time."""
        for p in self.layout.in_ds_order(m.params):
            if self.bwd_uses[p.name] == 0 and p.name not in self.reduced:
                self.reduced.add(p.name)
                self._grad_ready(p)

    def _grad_ready(self, p: ParamSpec) -> None:
        b, s = self.b, self.layout.rs_stream
        b.host(f"grad hook {p.name}", O.HostKind.GRAD_HOOK, self.costs.grad_hook_ns)
        if self.bucket and self.bucket_elems + p.numel > self.z.reduce_bucket_size:
            self._flush()
        if self.z.contiguous_gradients:
            b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
            b.copy(s, f"grad to bucket {p.name}", O.CopyDirection.D2D, p.numel * self.layout.dt,
                   deps=b.wait_stream(COMPUTE) if s != COMPUTE else (), buffers=(f"grad:{p.name}", "ipg_bucket"))
            b.free(f"grad:{p.name}", COMPUTE, f"gradient {p.name} (now in the bucket)")
            self.live_grads.discard(f"grad:{p.name}")
        self.bucket.append(p)
        self.bucket_elems += p.numel

    # ------------------------------------------------------------ reduction
    def epilogue(self) -> None:
        """End of backward: the last bucket, then the host waits for the reduce stream."""
        self._flush()
        self.b.sync_stream(self.layout.rs_stream, "end of backward: wait for gradient reduction")

    def _flush(self) -> None:
        if not self.bucket:
            return
        b, c, lay, s = self.b, self.costs, self.layout, self.layout.rs_stream
        mx = self.knobs.max_outstanding_coalesced
        if mx and len(self.reduce_events) > mx:
            b.sync_ops((self.reduce_events[-(mx + 1)],), "reduce back-pressure: oldest outstanding reduce")
        params = lay.in_ds_order(self.bucket)
        srcs = ("ipg_bucket",) if self.z.contiguous_gradients else tuple(f"grad:{p.name}" for p in params)
        wait = b.wait_stream(COMPUTE) if s != COMPUTE else ()
        batches = [params] if self.knobs.coalesced_collectives else [[p] for p in params]
        for batch in batches:
            self.n_rs += 1
            k = self.n_rs
            shard = sum(lay.part[p.name] for p in batch)
            size = shard * lay.n_part * lay.dt
            inp = srcs
            to_free: list[str] = []
            if not (len(batch) == 1 and batch[0].numel % lay.n_part == 0):
                buf = f"rsflat[{k}]"
                b.alloc(buf, size, s, f"interleaved reduce-scatter input {k}")
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.copy(s, f"rs{k}.interleave", O.CopyDirection.D2D, size, deps=wait, buffers=srcs + (buf,))
                wait = ()
                inp = (buf,)
                to_free.append(buf)
            if not self.knobs.flat_collectives:
                tmp = f"rstmp[{k}]"
                b.alloc(tmp, size, s, f"reduce-scatter flatten buffer {k}")
                b.copy(s, f"rs{k}.flatten_list", O.CopyDirection.D2D, size, deps=wait, buffers=inp + (tmp,))
                wait = ()
                inp = (tmp,)
                to_free.append(tmp)
            b.host("reduce_scatter launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(s, f"bwd.rs{k}:{batch[0].name}" + (f"+{len(batch) - 1}" if len(batch) > 1 else ""),
                         O.CollectiveKind.REDUCE_SCATTER, size, lay.dtype, lay.groups.partition,
                         reduce_op=O.ReduceOp.SUM, deps=wait, buffers=inp)
            wait = ()
            if lay.groups.replica is not None and self.at_boundary:
                # MiCS: the shard's gradient partitions, scaled, all-reduced (coalesced)
                # across the replicas at the accumulation boundary (mics.py
                # allreduce_mics_shard_grads, all_reduce_coalesced path)
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.compute(s, f"rs{k}.replica_scale", O.ComputeKind.ELEMENTWISE, shard, shard * lay.dt,
                          shard * lay.dt, buffers=inp)
                b.host("all_reduce launch", O.HostKind.LAUNCH, c.collective_launch_ns)
                b.collective(s, f"bwd.rs{k}.replica_allreduce", O.CollectiveKind.ALL_REDUCE, shard * lay.dt,
                             lay.dtype, lay.groups.replica, reduce_op=O.ReduceOp.SUM, buffers=inp)
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(s, f"rs{k}.partition_grads", O.ComputeKind.ELEMENTWISE, shard, 2 * shard * lay.dt,
                      shard * lay.dt, buffers=inp + ("grad16[0]",))
            for buf_name in to_free:
                b.free(buf_name, s, "reduce-scatter buffer")
            if lay.offload and self.at_boundary:
                self._offload(k, shard)
        if not self.z.contiguous_gradients:
            for p in params:
                b.free(f"grad:{p.name}", COMPUTE, f"gradient {p.name} (reduced)")
                self.live_grads.discard(f"grad:{p.name}")
        last = b.last_on_stream.get(s)
        if last is not None:
            self.reduce_events.append(last)
        self.bucket, self.bucket_elems = [], 0

    def _offload(self, k: int, shard: int) -> None:
        # offload at the boundary: per-parameter norm, .to(fp32) on the device, then a
        # non-blocking copy into the host's fp32 gradient
        # (stage3._offload_grad_partition_at_boundary)
        b, c, lay, s = self.b, self.costs, self.layout, self.layout.rs_stream
        tmp = f"grad32tmp[{k}]"
        b.alloc(tmp, shard * 4, s, f"fp32 gradient partition for the host {k}")
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
        b.compute(s, f"rs{k}.offload_norm_and_cast", O.ComputeKind.ELEMENTWISE, 3 * shard,
                  2 * shard * lay.dt, shard * 4, buffers=("grad16[0]", tmp))
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
        b.copy(s, f"rs{k}.offload_grad_d2h", O.CopyDirection.D2H, shard * 4, buffers=(tmp,))
        b.free(tmp, s, f"fp32 gradient partition for the host {k}")
