"""DeepSpeed ZeRO-3's gradient reduction: hooks, the bucket, reduce-scatter.

Models deepspeed/runtime/zero/stage3.py (``s3``) with comm/coalesced_collectives.py
(``cc``) in 0.19.8 and 0.6.0 (``preallocated_reduce_buffers`` on), and 0.5.10's
reduce path with partition_parameters.py (``pp``) (off):

* each parameter's gradient is allocated at its module's first backward use and is
  ready after the last; its hook flushes the bucket first when adding it would exceed
  ``reduce_bucket_size`` elements, then with ``contiguous_gradients`` copies it into
  the bucket (a gradient larger than the bucket keeps its own buffer). 0.6.0 on: the
  bucket is allocated once and the copy runs on the reduce stream after a wait on the
  compute stream (s3:1820-1838). 0.5.10: one bucket buffer, two with ``overlap_comm``
  used in turn, made with torch.empty at the start of every backward (s3:2929-2942),
  the copy on the compute stream (s3:1903-1911), no wait between the streams;
* a flush: the host blocks on the oldest reduce when more than
  ``max_outstanding_coalesced`` are outstanding, with 0 on the reduce stream itself
  (0.5.10 s3:2159-2160). Coalesced (cc:41-116): per bucket the per-rank chunks
  interleaved with padding into a flat buffer (torch.cat) unless a lone gradient
  divides evenly, divided by the world size in place, one reduce-scatter. Not
  coalesced: one per gradient; 0.5.10's (pp:1081-1119) with a zero-filled chunk for a
  padded rank and the whole bucket buffer divided beforehand, however full
  (s3:1943-1951). Without ``flat_reduce_scatter`` the list API flattens its input
  into a new buffer with a copy. Then the rank's shard is stored in the gradient
  partition: at once on the reduce stream (0.6.0 on, s3:1970-2045, where 0.6.0 also
  updates its inf/nan tracker, 6 kernels a gradient), or at the next flush on a copy
  stream of its own after the host synchronises the reduce stream (0.5.10
  partition_previous_reduced_grads, s3:2053-2156), into a partition made with
  torch.zeros at the step's first flush (s3:2063-2083);
* MiCS: at the accumulation boundary each shard is scaled and all-reduced across the
  replica group (mics.py ``allreduce_mics_shard_grads``);
* offload_optimizer: at the boundary each shard is cast to fp32 on the device (with
  its norm) and copied to the host (stage3._offload_grad_partition_at_boundary);
* end of backward (``independent_gradient_partition_epilogue``): the last bucket
  flushed and the reduce stream synchronised; 0.5.10 then stores the last shards and
  drops its bucket buffers (s3:1722-1757).

State: the reduce-scatter count, the outstanding reduce events and (0.5.10) whether
the step's partition exists live for the whole step (the constructor makes them);
which gradients exist, are reduced, are still to be used by backward, and the bucket
are per forward + backward (``reset_micro_step``).
"""

from __future__ import annotations

from dataclasses import replace

from commsim.ir import ops as O
from commsim.ir.ops import Phase
from commsim.models.spec import ModuleSpec, ParamSpec
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.dsconfig import ZeroConfig
from commsim.strategies.dsversions import CURRENT, DeepSpeedVersion
from commsim.strategies.knobs import HostCosts, Knobs
from commsim.strategies.zero3_layout import COMPUTE, Zero3Layout
from commsim.strategies.zero3_trace import TraceEntry

COPY_GRAD = "copy_grad"  # 0.5.10's copy_grad_stream (s3:821), made whatever overlap_comm says


class GradReducer:
    """Gradient buckets and their reduce-scatters for one rank over one step."""

    def __init__(self, b: ProgramBuilder, layout: Zero3Layout, z: ZeroConfig, knobs: Knobs, costs: HostCosts,
                 trace: list[TraceEntry], version: DeepSpeedVersion = CURRENT,
                 sub_group_elems: tuple[int, ...] = ()):
        self.b, self.layout, self.z, self.knobs, self.costs = b, layout, z, knobs, costs
        self.version = version
        self.legacy = not knobs.preallocated_reduce_buffers
        # the optimizer's sub-groups' partition sizes (0.5.10 makes the partition per step)
        self.sub_group_elems = sub_group_elems
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
        self.partition_made = False  # 0.5.10: grads_in_partition exists this step
        self.bucket_alloc_at: list[int] = []  # 0.5.10: positions of the per-backward bucket allocations
        self.bucket_touch: dict[int, int] = {}  # ... and the most of each buffer any bucket filled
        # per forward + backward (reset_micro_step)
        self.at_boundary = False  # the last micro-step before the optimizer step
        self.bwd_uses: dict[str, int] = {}  # backward uses still to come
        self.reduced: set[str] = set()
        self.live_grads: set[str] = set()  # gradient buffers allocated and not yet freed
        self.bucket: list[ParamSpec] = []
        self.in_bucket_buffer: set[str] = set()  # gradients copied into the bucket buffer
        self.bucket_elems = 0
        self.ipg_index = 0
        self.previous: list[tuple[ParamSpec, str]] = []  # 0.5.10: reduced, shard not yet stored

    def reset_micro_step(self, at_boundary: bool) -> None:
        self.at_boundary = at_boundary
        self.bwd_uses = dict(self.uses_per_pass)
        self.reduced = set()
        self.live_grads = set()
        self.bucket, self.bucket_elems, self.in_bucket_buffer = [], 0, set()
        self.ipg_index = 0
        self.previous = []

    def emit_setup(self) -> None:
        if self.z.contiguous_gradients and not self.legacy:
            self.b.setup_alloc("ipg_bucket", self.z.reduce_bucket_size * self.layout.dt, "contiguous gradient bucket")

    @property
    def n_bucket_buffers(self) -> int:
        return 2 if (self.legacy and self.z.contiguous_gradients and self.z.overlap_comm) else 1

    def bucket_buffer(self, j: int | None = None) -> str:
        if not self.legacy:
            return "ipg_bucket"
        return f"ipg_bucket{self.ipg_index if j is None else j}"

    def begin_backward(self) -> None:
        """0.5.10 backward(): the bucket buffers made with torch.empty for this backward
        (s3:2929-2942); how much of each any bucket fills is set at the epilogue."""
        if not (self.legacy and self.z.contiguous_gradients):
            return
        for j in range(self.n_bucket_buffers):
            self.bucket_alloc_at.append(len(self.b.step))
            self.b.alloc(self.bucket_buffer(j), self.z.reduce_bucket_size * self.layout.dt, COMPUTE,
                         f"contiguous gradient bucket {j} (torch.empty, per backward)", touch_bytes=0)
        self.ipg_index = 0

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
            if self.legacy and self.n_bucket_buffers == 2:
                self.ipg_index = 1 - self.ipg_index  # s3:1885-1889
        room = self.z.reduce_bucket_size - self.bucket_elems
        fits = p.numel <= room if self.version.bucket_takes_exact_fit else p.numel < room
        if self.z.contiguous_gradients and fits:
            buf = self.bucket_buffer()
            b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
            if self.legacy:  # on the compute stream, where backward wrote the gradient
                b.copy(COMPUTE, f"grad to bucket {p.name}", O.CopyDirection.D2D, p.numel * self.layout.dt,
                       buffers=(f"grad:{p.name}", buf))
                end = (self.bucket_elems + p.numel) * self.layout.dt
                self.bucket_touch[self.ipg_index] = max(self.bucket_touch.get(self.ipg_index, 0), end)
            else:
                b.copy(s, f"grad to bucket {p.name}", O.CopyDirection.D2D, p.numel * self.layout.dt,
                       deps=b.wait_stream(COMPUTE) if s != COMPUTE else (), buffers=(f"grad:{p.name}", buf))
            b.free(f"grad:{p.name}", COMPUTE, f"gradient {p.name} (now in the bucket)")
            self.live_grads.discard(f"grad:{p.name}")
            self.in_bucket_buffer.add(p.name)
        self.bucket.append(p)
        self.bucket_elems += p.numel

    def _source(self, p: ParamSpec) -> str:
        return self.bucket_buffer() if p.name in self.in_bucket_buffer else f"grad:{p.name}"

    # ------------------------------------------------------------ reduction
    def epilogue(self) -> None:
        """End of backward: the last bucket, then the host waits for the reduce stream;
        0.5.10 then stores the last shards and drops the bucket buffers."""
        s = self.layout.rs_stream
        self._flush()
        if not self.legacy:
            self.b.sync_stream(s, "end of backward: wait for gradient reduction")
            return
        if self.z.overlap_comm:
            self.b.sync_stream(s, "end of backward: reduction stream synchronize (s3:1727-1728)")
        self._store_previous()
        for j in range(self.n_bucket_buffers if self.z.contiguous_gradients else 0):
            self.b.free(self.bucket_buffer(j), COMPUTE, f"contiguous gradient bucket {j} (_release_ipg_buffers)")
        # each bucket buffer's allocation learns how much of it any bucket wrote
        for pos in self.bucket_alloc_at:
            op = self.b.step[pos]
            j = int(op.buffer.removeprefix("ipg_bucket"))
            self.b.step[pos] = replace(op, touch_bytes=min(op.size_bytes, self.bucket_touch.get(j, 0)))
        self.bucket_alloc_at = []

    def _back_pressure(self) -> None:
        b, s = self.b, self.layout.rs_stream
        mx = self.knobs.max_outstanding_coalesced
        if mx == 0:
            # 0.5.10 reduce_ipg_grads: the host waits for every earlier reduction (overlap_comm only)
            if self.z.overlap_comm and b.last_on_stream.get(s) is not None:
                b.sync_stream(s, "reduce: reduction stream synchronize before the flush (s3:2159-2160)")
        elif len(self.reduce_events) > mx:
            b.sync_ops((self.reduce_events[-(mx + 1)],), "reduce back-pressure: oldest outstanding reduce")

    def _flush(self) -> None:
        if not self.bucket:
            return
        b, c, lay, s = self.b, self.costs, self.layout, self.layout.rs_stream
        self._back_pressure()
        if self.legacy:
            self._store_previous()
        params = lay.in_ds_order(self.bucket)
        b.host("reduce bucket", O.HostKind.GRAD_HOOK, c.flush_ns(len(params), lay.n_part))
        wait = b.wait_stream(COMPUTE) if (s != COMPUTE and not self.legacy) else ()
        legacy_per_param = self.legacy and not self.knobs.coalesced_collectives
        if legacy_per_param:
            # average_tensor (s3:1943-1951): the whole bucket buffer, however full, and each
            # gradient kept outside it, divided in place by the world size
            for src, n in ([(self.bucket_buffer(), self.z.reduce_bucket_size)] if self.in_bucket_buffer else []) + \
                    [(f"grad:{p.name}", p.numel) for p in params if p.name not in self.in_bucket_buffer]:
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.compute(s, f"rs.divide:{src}", O.ComputeKind.ELEMENTWISE, n, n * lay.dt, n * lay.dt,
                          deps=wait, buffers=(src,))
                wait = ()
        batches = [params] if self.knobs.coalesced_collectives else [[p] for p in params]
        for batch in batches:
            self.n_rs += 1
            k = self.n_rs
            shard = sum(lay.part[p.name] for p in batch)
            size = shard * lay.n_part * lay.dt
            srcs = tuple(dict.fromkeys(self._source(p) for p in batch))
            inp = srcs
            to_free: list[str] = []
            if legacy_per_param:
                p = batch[0]
                if p.numel % lay.n_part:
                    # pp:1097-1109: the padded rank's chunk is a torch.zeros with the tail copied in
                    tail = f"rspad[{k}]"
                    b.alloc(tail, lay.part[p.name] * lay.dt, s, f"padded reduce-scatter chunk {k}")
                    b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                    b.compute(s, f"rs{k}.pad_zero_and_copy", O.ComputeKind.ELEMENTWISE, 0, lay.part[p.name] * lay.dt,
                              lay.part[p.name] * lay.dt, buffers=srcs + (tail,))
                    inp = srcs + (tail,)
                    to_free.append(tail)
            else:
                if not (len(batch) == 1 and batch[0].numel % lay.n_part == 0):
                    buf = f"rsflat[{k}]"
                    b.alloc(buf, size, s, f"interleaved reduce-scatter input {k}")
                    b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                    b.copy(s, f"rs{k}.interleave", O.CopyDirection.D2D, size, deps=wait, buffers=srcs + (buf,))
                    wait = ()
                    inp = (buf,)
                    to_free.append(buf)
                # cc:94: the flat buffer (or the lone gradient) pre-divided by the world size
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.compute(s, f"rs{k}.divide", O.ComputeKind.ELEMENTWISE, size // lay.dt, size, size, deps=wait,
                          buffers=inp)
                wait = ()
            if not self.knobs.flat_reduce_scatter:
                # the list API: ProcessGroupNCCL flattens the input list into a new tensor,
                # one copy_ per rank's piece launched from the calling thread
                # (flatten_for_scatter_gather), as the list all_gather copies out
                tmp = f"rstmp[{k}]"
                b.alloc(tmp, size, s, f"reduce-scatter flatten buffer {k}")
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns * lay.n_part)
                b.copy(s, f"rs{k}.flatten_list", O.CopyDirection.D2D, size, deps=wait, buffers=inp + (tmp,))
                wait = ()
                inp = (tmp,)
                to_free.append(tmp)
            b.host("reduce_scatter launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            b.collective(s, f"bwd.rs{k}:{batch[0].name}" + (f"+{len(batch) - 1}" if len(batch) > 1 else ""),
                         O.CollectiveKind.REDUCE_SCATTER, size, lay.dtype, lay.groups.partition,
                         reduce_op=O.ReduceOp.SUM, deps=wait, buffers=inp, blocking=True)  # cc:128: async_op=False
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
                             lay.dtype, lay.groups.replica, reduce_op=O.ReduceOp.SUM, buffers=inp, blocking=True)
            if self.legacy:
                # the shard is stored at the next flush (partition_previous_reduced_grads)
                for buf_name in to_free:
                    b.free(buf_name, s, "reduce-scatter buffer")
                self.previous.extend((p, self._source(p)) for p in batch)
                continue
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(s, f"rs{k}.partition_grads", O.ComputeKind.ELEMENTWISE, shard, 2 * shard * lay.dt,
                      shard * lay.dt, buffers=inp + ("grad16[0]",))
            if self.knobs.fused_overflow_check and self.version.overflow_tracker_per_gradient:
                for p in batch:
                    self._inf_nan_tracker(k, p)
            for buf_name in to_free:
                b.free(buf_name, s, "reduce-scatter buffer")
            if lay.offload and self.at_boundary:
                self._offload(k, shard)
        if not self.legacy:
            for p in params:
                if p.name not in self.in_bucket_buffer:
                    b.free(f"grad:{p.name}", COMPUTE, f"gradient {p.name} (reduced)")
                    self.live_grads.discard(f"grad:{p.name}")
        last = b.last_on_stream.get(s)
        if last is not None:
            self.reduce_events.append(last)
        self.bucket, self.bucket_elems, self.in_bucket_buffer = [], 0, set()

    def _inf_nan_tracker(self, k: int, p: ParamSpec) -> None:
        """0.6.0 __partition_grads (s3:2003-2010): tracker.logical_or_(isinf(shard).any()),
        then the same for isnan: per test a bool tensor of the shard, its any(), the or."""
        b, c, lay, s = self.b, self.costs, self.layout, self.layout.rs_stream
        n = lay.part[p.name]
        for test in ("isinf", "isnan"):
            tmp = f"rs{k}.{test}:{p.name}"
            b.alloc(tmp, n, s, f"{test} of {p.name}'s gradient shard")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(s, f"rs{k}.{test}:{p.name}", O.ComputeKind.ELEMENTWISE, n, n * lay.dt, n,
                      buffers=("grad16[0]", tmp))
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(s, f"rs{k}.{test}_any:{p.name}", O.ComputeKind.ELEMENTWISE, n, n, 1, buffers=(tmp,))
            b.free(tmp, s, f"{test} of {p.name}'s gradient shard")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(s, f"rs{k}.{test}_or:{p.name}", O.ComputeKind.ELEMENTWISE, 1, 2, 1, buffers=())

    def _store_previous(self) -> None:
        """0.5.10 partition_previous_reduced_grads (s3:2053-2156): at the step's first
        flush the gradient partition made with torch.zeros on the reduce stream; then,
        under the copy stream, the host synchronises the reduce stream and each reduced
        gradient's shard is copied into the partition (or, offloaded, sent to the host)."""
        if not self.previous:
            return
        b, c, lay, s = self.b, self.costs, self.layout, self.layout.rs_stream
        if not self.partition_made and not lay.offload:
            for g, n in enumerate(self.sub_group_elems):
                b.alloc(f"grad16[{g}]", n * lay.dt, s, f"16-bit gradient partition, sub-group {g} (torch.zeros, "
                        "per step)")
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.compute(s, f"grads_in_partition.zero[{g}]", O.ComputeKind.ELEMENTWISE, 0, 0, n * lay.dt,
                          buffers=(f"grad16[{g}]",))
            self.partition_made = True
        # (without overlap_comm the reduction stream is the compute stream: s3:818-819)
        b.sync_stream(s, "store shards: reduction stream synchronize under the copy stream (s3:2092-2093)")
        for p, src in self.previous:
            if lay.offload:
                if self.at_boundary:
                    self._offload(f"{self.n_rs}:{p.name}", lay.part[p.name], stream=COPY_GRAD)
            else:
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.copy(COPY_GRAD, f"store shard {p.name}", O.CopyDirection.D2D, lay.part[p.name] * lay.dt,
                       buffers=(src, "grad16[0]"))
            if src == f"grad:{p.name}":
                b.free(src, COPY_GRAD, f"gradient {p.name} (shard stored)")
                self.live_grads.discard(src)
        self.previous = []

    def _offload(self, k: int | str, shard: int, stream: str | None = None) -> None:
        # offload at the boundary: per-parameter norm, .to(fp32) on the device, then a
        # non-blocking copy into the host's fp32 gradient
        # (stage3._offload_grad_partition_at_boundary)
        b, c, lay = self.b, self.costs, self.layout
        s = stream or lay.rs_stream
        tmp = f"grad32tmp[{k}]"
        b.alloc(tmp, shard * 4, s, f"fp32 gradient partition for the host {k}")
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
        b.compute(s, f"rs{k}.offload_norm_and_cast", O.ComputeKind.ELEMENTWISE, 3 * shard,
                  2 * shard * lay.dt, shard * 4, buffers=("grad16[0]", tmp))
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
        b.copy(s, f"rs{k}.offload_grad_d2h", O.CopyDirection.D2H, shard * 4, buffers=(tmp,))
        b.free(tmp, s, f"fp32 gradient partition for the host {k}")
