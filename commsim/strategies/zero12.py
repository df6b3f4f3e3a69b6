"""ZeRO stages 0, 1 and 2 lowered to IR, as DeepSpeed 0.19 runs them.

Parameters stay whole (16-bit) on every rank, so forward and backward fetch nothing.
What differs is the gradient reduction and the optimizer (read from
deepspeed/runtime/engine.py and zero/stage_1_and_2.py, and checked against real
DeepSpeed's collectives recorded on CPUs: tests/runtime/test_deepspeed_fidelity.py):

* stage 0: after backward, ``buffered_allreduce_fallback`` all-reduces every gradient
  in buffers of 500M elements (``MEMORY_OPT_ALLREDUCE_SIZE``), in parameter order;
* stage 1: after backward, ``reduce_gradients`` walks the parameters in order into
  buckets of ``reduce_bucket_size`` elements, one all-reduce per bucket
  (``use_multi_rank_bucket_allreduce``), each rank keeping its partition;
* stage 2: the same buckets filled by gradient hooks *during* backward, as gradients
  become ready, all-reduced on the reduction stream when ``overlap_comm`` (else on the
  compute stream); the last bucket at the end of backward;
* stages 1 and 2, a gradient larger than the bucket is a bucket of its own, and
  ``average_tensor`` cuts it where it crosses from one rank's partition into the
  next: ``allreduce_and_scatter`` then all-reduces the pieces in order, closing an
  all-reduce as soon as its pieces exceed ``reduce_bucket_size`` (so a gradient that
  straddles two partitions and whose first piece alone exceeds the bucket is reduced
  in two all-reduces); a bucket of smaller gradients never exceeds the bucket size and
  is one all-reduce;
* stages 1 and 2, optimizer (CPU Adam on the host with ``offload_optimizer: cpu``, the
  gradient shares copied to the host as they are reduced): with fp16, or bf16 unless
  ``bf16.check_grad_overflow`` is false, an overflow all-reduce (1 byte; fp32 runs no
  overflow check: engine._configure_zero_optimizer), the gradient-norm all-reduce
  (4 bytes, fp32), Adam on this rank's fp32 partition, then one all-gather of the
  updated partitions (the whole flat model, padded to a multiple of twice the world
  size: ``nccl_start_alignment_factor``).

Stage 2 makes its gradient buffers afresh every step, and so does this lowering: the
bucket buffer(s) (``setup_buckets``: ``torch.empty`` of ``reduce_bucket_size``
elements, released in the backward epilogue; only the buckets' bytes are ever written,
which the allocation's ``touch_bytes`` says), ``grads_in_partition`` (made at the
step's first reduction), one fp64 copy per gradient piece for the norm, and the flat
fp32 gradient the optimizer steps on. On GPUs the caching allocator serves them from
its cache; on CPUs large ones are fresh pages, and their first writes dominate.
Activations and activation gradients are ``activations.Activations``, as in ZeRO-3.
"""

from __future__ import annotations

from dataclasses import replace
from math import ceil

from commsim.ir import ops as O
from commsim.ir.ops import Phase
from commsim.ir.errors import CommsimInputError
from commsim.models.spec import ModelDescription, ParamSpec
from commsim.strategies.activations import Activations
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.dsconfig import DeepSpeedConfig
from commsim.strategies.knobs import HostCosts
from commsim.strategies.optimizer import adam_step, fp64_norms
from commsim.strategies.zero3_trace import TraceEntry, module_trace

COMPUTE = "compute"
STAGE0_BUFFER_ELEMS = 500_000_000  # deepspeed/runtime/engine.py MEMORY_OPT_ALLREDUCE_SIZE


class Zero12Lowering:
    def __init__(self, md: ModelDescription, world_size: int, ds: DeepSpeedConfig, costs: HostCosts,
                 checkpointing: bool, grad_accum: int, checkpoint_style: str = "reentrant"):
        z = ds.zero
        if z.offload_optimizer.device not in ("none", "cpu"):
            raise CommsimInputError("ds_config: zero_optimization.offload_optimizer.device: allowed: none, cpu")
        self.offload = z.offload_optimizer.device == "cpu" and z.stage in (1, 2)
        self.md, self.W, self.ds, self.z, self.costs = md, world_size, ds, z, costs
        self.stage = z.stage
        self.grad_accum = grad_accum
        self.checkpointing = checkpointing
        self.group = tuple(range(world_size))
        self.dt = ds.param_dtype_bytes
        self.dtype = {"bf16": O.DType.BF16, "fp16": O.DType.FP16, "fp32": O.DType.FP32}[ds.precision]
        self.rs_stream = "reduce" if (self.stage == 2 and z.overlap_comm) else COMPUTE
        self.b = ProgramBuilder()
        self.acts = Activations(self.b, md, COMPUTE, checkpointing)
        self.params = md.registered_params()
        self.total = sum(p.numel for p in self.params)
        # each parameter's start in the flat buffer (registration order)
        self.offset: dict[str, int] = {}
        at = 0
        for p in self.params:
            self.offset[p.name] = at
            at += p.numel
        # the flat buffer is padded to nccl_start_alignment_factor (2) x world size
        align = 2 * world_size
        self.padded_total = ceil(self.total / align) * align
        self.partition = self.padded_total // world_size if self.stage > 0 else self.total
        self.trace = [e for e in module_trace(md, checkpointing, checkpoint_style) if e.run]
        # stage 2 without offload (stage_1_and_2.py): the gradient bucket(s) and the
        # partition's gradients are fresh tensors every step, not persistent state
        self.fresh_grads = self.stage == 2 and not self.offload
        self.ipg = self.stage == 2 and z.contiguous_gradients
        self.n_ipg = 2 if (self.ipg and z.overlap_comm) else 1  # double buffers when overlapped

    # ------------------------------------------------------------ state
    def _setup(self) -> None:
        b = self.b
        b.setup_alloc("params16", self.total * self.dt, "16-bit parameters (whole model on every rank)")
        if not self.offload:  # offloaded, the fp32 master, Adam state and gradient live in host memory
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                b.setup_alloc(state, self.partition * 4, f"fp32 {state} ({'partition' if self.stage else 'full'})")
            if not self.fresh_grads:
                b.setup_alloc("grad32", self.partition * 4, "fp32 gradient (partition)" if self.stage else "fp32 gradient")

    # ------------------------------------------------------------ per-step gradient buffers
    def _alloc_ipg(self) -> None:
        """setup_buckets, at the first gradient of a backward: torch.empty of
        reduce_bucket_size elements per buffer (two when overlap_comm), released in the
        epilogue. Only the buckets' bytes are ever written (see _touch_ipg)."""
        for j in range(self.n_ipg):
            self.ipg_alloc_at.append(len(self.b.step))
            self.b.alloc(f"ipg_bucket{j}", self.z.reduce_bucket_size * self.dt, COMPUTE,
                         f"contiguous gradient bucket {j} (torch.empty, per backward)", touch_bytes=0)
        self.ipg_live = True
        self.ipg_index = 0

    def _free_ipg(self) -> None:
        for j in range(self.n_ipg):
            self.b.free(f"ipg_bucket{j}", self.rs_stream, f"contiguous gradient bucket {j} (epilogue)")
        self.ipg_live = False

    def _touch_ipg(self) -> None:
        """Each bucket buffer's allocation learns how much of it was written: the largest
        bucket placed in it (buckets refill a buffer from offset 0)."""
        for pos in self.ipg_alloc_at:
            op = self.b.step[pos]
            j = int(op.buffer.removeprefix("ipg_bucket"))
            self.b.step[pos] = replace(op, touch_bytes=min(op.size_bytes, self.ipg_touch[j]))

    def _oversized(self, p: ParamSpec) -> bool:
        """A gradient larger than the bucket bypasses the bucket buffer and is reduced
        on its own (reduce_independent_p_g_buckets_and_remove_grads)."""
        return p.numel > self.z.reduce_bucket_size

    def _partition_pieces(self) -> list[tuple[str, int]]:
        """(parameter, elements) of the pieces in rank 0's gradient partition (the flat
        parameter order cut into equal partitions). The program is shared by all
        ranks; the others' pieces differ only at the partition edges."""
        pieces, start = [], 0
        for p in self.params:
            end = start + p.numel
            if start < self.partition:
                pieces.append((p.name, min(end, self.partition) - start))
            start = end
        return pieces

    def _allreduce_pieces(self, p: ParamSpec) -> list[int]:
        """Elements per all-reduce of an oversized gradient (stage_1_and_2.py
        ``average_tensor`` cutting it at partition boundaries in the flat parameter
        order, then ``allreduce_and_scatter`` closing an all-reduce once its pieces
        exceed ``reduce_bucket_size``)."""
        start = self.offset[p.name]
        end = start + p.numel
        cuts = [start] + [k * self.partition for k in range(start // self.partition + 1, self.W)
                          if start < k * self.partition < end] + [end]
        out, acc = [], 0
        for a, z in zip(cuts, cuts[1:]):
            acc += z - a
            if acc > self.z.reduce_bucket_size:
                out.append(acc)
                acc = 0
        if acc:
            out.append(acc)
        return out

    # ------------------------------------------------------------ reduction
    def _reduce(self, params: list[ParamSpec], label: str) -> None:
        if self.stage in (1, 2) and len(params) == 1 and self._oversized(params[0]):
            pieces = self._allreduce_pieces(params[0])
            if len(pieces) > 1:
                for k, elems in enumerate(pieces):
                    self._reduce_elems(params, elems, f"{label}.{k}", first=k == 0, last=k == len(pieces) - 1)
                return
        self._reduce_elems(params, sum(p.numel for p in params), label)

    def _reduce_elems(self, params: list[ParamSpec], elems: int, label: str, first: bool = True,
                      last: bool = True) -> None:
        """One all-reduce of ``elems`` elements of ``params``' gradients (all of them, or a
        piece of a lone oversized gradient: ``first`` / ``last`` piece)."""
        b, c, s = self.b, self.costs, self.rs_stream
        wait = b.wait_stream(COMPUTE) if s != COMPUTE else ()
        in_ipg = self.ipg and not self._oversized(params[0])  # an oversized gradient is a bucket of its own
        bufs = (f"ipg_bucket{self.ipg_index}",) if in_ipg else tuple(f"grad:{p.name}" for p in params)
        if in_ipg:
            self.ipg_touch[self.ipg_index] = max(self.ipg_touch[self.ipg_index], elems * self.dt)
        if self.stage == 2 and first:
            # average_tensor: the bucket divided by the world size in place, before the
            # per-rank all-reduces
            whole = sum(p.numel for p in params)
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(s, f"{label}.average", O.ComputeKind.ELEMENTWISE, whole, whole * self.dt, whole * self.dt,
                      deps=wait, buffers=bufs)
            wait = ()
        flat = None
        if self.stage in (1, 2):
            # allreduce_bucket flattens the bucket into a new tensor first (stage_1_and_2.py)
            flat = f"arflat[{label}]"
            b.alloc(flat, elems * self.dt, s, f"{label} flattened bucket")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(s, f"{label}.flatten", O.CopyDirection.D2D, elems * self.dt, deps=wait, buffers=bufs + (flat,))
            wait = ()
            bufs = (flat,)
        b.host("all_reduce launch", O.HostKind.LAUNCH, c.collective_launch_ns)
        # stage_1_and_2.py:1497-1509: dist.all_reduce, async_op=False
        b.collective(s, label, O.CollectiveKind.ALL_REDUCE, elems * self.dt, self.dtype, self.group,
                     reduce_op=O.ReduceOp.SUM, deps=wait, buffers=bufs, blocking=True)
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
        # keep this rank's share: copy (stage 0: all of it) into the fp32 gradient
        keep = elems if self.stage == 0 else ceil(elems / self.W)
        if self.offload:
            # this rank's share, as fp32 (.float() on the device, with its norm), copied
            # without blocking into the host's fp32 gradient (stage_1_and_2.py
            # async_inplace_copy_grad_to_fp32_buffer_from_gpu); under accumulation every
            # micro-batch's share goes to the host this way
            tmp = f"{label}.fp32"
            b.alloc(tmp, keep * 4, s, f"{label} fp32 share for the host")
            b.compute(s, f"{label}.keep_partition", O.ComputeKind.ELEMENTWISE, 3 * keep, keep * self.dt, keep * 4,
                      buffers=bufs + (tmp,))
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.copy(s, f"{label}.offload_grad_d2h", O.CopyDirection.D2H, keep * 4, buffers=(tmp,))
            b.free(tmp, s, f"{label} fp32 share for the host")
        elif self.fresh_grads:
            # copy_grads_in_partition: into grads_in_partition, a torch.empty of the
            # partition in the 16-bit dtype made at the step's first reduction
            if not self.grad_partition_live:
                b.alloc("grad_partition", self.partition * self.dt, s, "grads_in_partition (per step)")
                self.grad_partition_live = True
            b.compute(s, f"{label}.keep_partition", O.ComputeKind.ELEMENTWISE, keep, keep * self.dt, keep * self.dt,
                      buffers=bufs + ("grad_partition",))
        else:
            b.compute(s, f"{label}.keep_partition", O.ComputeKind.ELEMENTWISE, keep, keep * self.dt + keep * 4,
                      keep * 4, buffers=bufs + ("grad32",))
        if flat is not None:
            b.free(flat, s, f"{label} flattened bucket")
        if self.stage == 2 and last:  # the full gradients are dropped once reduced
            for p in params:
                b.free(f"grad:{p.name}", COMPUTE, f"gradient {p.name} (reduced)")
                self.live_grads.discard(p.name)

    def _bucketed(self, params: list[ParamSpec], size_elems: int, phase: str) -> None:
        bucket: list[ParamSpec] = []
        elems = 0
        for p in params:
            if self.stage == 1:  # reduce_gradients walks every parameter in Python
                self.b.host(f"reduce {p.name}", O.HostKind.GRAD_HOOK, self.costs.grad_hook_ns)
            if bucket and elems + p.numel > size_elems:
                self._reduce(bucket, f"{phase}.ar{self._next()}")
                bucket, elems = [], 0
            bucket.append(p)
            elems += p.numel
        if bucket:
            self._reduce(bucket, f"{phase}.ar{self._next()}")

    def _next(self) -> int:
        self.n_ar += 1
        return self.n_ar

    # ------------------------------------------------------------ passes
    def _run(self, mb: str, e: TraceEntry) -> None:
        b, m = self.b, e.module
        kernels = m.bwd if e.phase is Phase.BACKWARD else m.fwd
        grads: tuple[str, ...] = ()
        if e.phase is Phase.BACKWARD and m.bwd:
            for p in m.params:
                if p.name not in self.live_grads:
                    self.live_grads.add(p.name)
                    b.alloc(f"grad:{p.name}", p.numel * self.dt, COMPUTE, f"gradient {p.name}")
            grads = tuple(f"grad:{p.name}" for p in m.params)
        act = self.acts.before(mb, m, e.phase)
        if kernels and m.syncs_before(e.phase):
            b.sync_stream(COMPUTE, f"{mb}{m.path}.{e.phase.value} stream synchronize")
        for k in kernels:
            b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
            suffix = "" if k.name in ("fwd", "bwd") else f".{k.name}"
            b.compute(COMPUTE, f"{mb}{m.path}.{e.phase.value}{suffix}", k.kind, k.flops, k.bytes_read, k.bytes_written,
                      k.gemm, buffers=("params16",) + grads + act)
        self.acts.after(mb, m, e.phase)
        if e.phase is Phase.BACKWARD and m.bwd and self.stage == 2:
            # gradient hooks: each parameter's gradient is ready after its last use;
            # autograd accumulates a Linear's bias before its weight
            for p in sorted(m.params, key=lambda p: (not p.name.endswith("bias"), self.order[p.name])):
                self.uses[p.name] -= 1
                if self.uses[p.name] == 0:
                    self._grad_ready(p, mb)
        elif e.phase is Phase.BACKWARD and m.bwd:
            for p in m.params:
                self.uses[p.name] -= 1

    def _grad_ready(self, p: ParamSpec, mb: str) -> None:
        self.b.host(f"grad hook {p.name}", O.HostKind.GRAD_HOOK, self.costs.grad_hook_ns)
        if self.ipg and not self.ipg_live:
            self._alloc_ipg()
        if self.bucket and self.bucket_elems + p.numel > self.z.reduce_bucket_size:
            self._reduce(self.bucket, f"{mb}bwd.ar{self._next()}")
            self.bucket, self.bucket_elems = [], 0
            self.ipg_index = (self.ipg_index + 1) % self.n_ipg if self.ipg else 0
        if self.ipg and not self._oversized(p):
            b = self.b
            b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
            b.copy(self.rs_stream, f"grad to bucket {p.name}", O.CopyDirection.D2D, p.numel * self.dt,
                   deps=b.wait_stream(COMPUTE) if self.rs_stream != COMPUTE else (),
                   buffers=(f"grad:{p.name}", f"ipg_bucket{self.ipg_index}"))
        self.bucket.append(p)
        self.bucket_elems += p.numel

    def _optimizer(self) -> None:
        b, c = self.b, self.costs
        b.phase = Phase.OPTIMIZER
        n = self.partition
        if self.stage in (1, 2):
            if self.ds.check_grad_overflow:
                b.reduce_to_host("optimizer.overflow_allreduce", 1, O.DType.UINT8, self.group, O.ReduceOp.MAX,
                                 c.collective_launch_ns, "overflow .item()")
            if self.fresh_grads:
                fp64_norms(b, COMPUTE, "optimizer.grad_norm", self._partition_pieces(), "grad_partition", self.dt,
                           c.launch_ns)
            elif not self.offload:  # offloaded, the norms were taken as the shares left the device
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.compute(COMPUTE, "optimizer.grad_norm", O.ComputeKind.ELEMENTWISE, 2 * n, n * 4, 4,
                          buffers=("grad32",))
            b.reduce_to_host("optimizer.grad_norm_allreduce", 4, O.DType.FP32, self.group, O.ReduceOp.SUM,
                             c.collective_launch_ns, "global gradient norm")
        if self.offload:
            # CPU Adam on the host's fp32 partition, then the 16-bit partition copied to
            # the device (copy_ without non_blocking: the host waits)
            b.host("cpu adam", O.HostKind.OPTIMIZER, n * c.cpu_adam_ps_per_param // 1000)
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            cp = b.copy(COMPUTE, "optimizer.params_h2d", O.CopyDirection.H2D, n * self.dt, buffers=("params16",))
            b.sync_ops((cp,), "copy of the updated partition to the device")
        elif self.fresh_grads:
            # step(): the partition's gradients flattened into a fresh tensor, as fp32
            # (a second pass when the gradients are 16-bit), the optimizer's .grad for
            # this step only
            b.alloc("grad32", n * 4, COMPUTE, "flat fp32 gradient of the partition (per step)")
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            if self.dt == 4:
                b.copy(COMPUTE, "optimizer.flatten_grads", O.CopyDirection.D2D, n * 4,
                       buffers=("grad_partition", "grad32"))
            else:
                b.alloc("grad_flat16", n * self.dt, COMPUTE, "flat 16-bit gradient of the partition")
                b.copy(COMPUTE, "optimizer.flatten_grads", O.CopyDirection.D2D, n * self.dt,
                       buffers=("grad_partition", "grad_flat16"))
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.compute(COMPUTE, "optimizer.grads_to_fp32", O.ComputeKind.ELEMENTWISE, n, n * self.dt, n * 4,
                          buffers=("grad_flat16", "grad32"))
                b.free("grad_flat16", COMPUTE, "flat 16-bit gradient")
            b.free("grad_partition", COMPUTE, "grads_in_partition")
            self.grad_partition_live = False
            self._adam(n, free_grad=True)
        else:
            self._adam(n)
        if self.stage in (1, 2):
            b.host("all_gather launch", O.HostKind.LAUNCH, c.collective_launch_ns)
            # runtime/utils.py:1016 all_gather_into_tensor_dp_groups: async_op=False
            b.collective(COMPUTE, "optimizer.allgather_params", O.CollectiveKind.ALL_GATHER,
                         self.padded_total * self.dt, self.dtype, self.group, buffers=("params16",), blocking=True)

    def _adam(self, n: int, free_grad: bool = False) -> None:
        b, c = self.b, self.costs
        adam_step(b, COMPUTE, "optimizer.adam", n, ("fp32", "exp_avg", "exp_avg_sq", "grad32"), self.ds.optimizer_impl,
                  c.launch_ns)
        if free_grad:
            b.free("grad32", COMPUTE, "fp32 gradient (.grad = None after the step)")
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
        b.compute(COMPUTE, "optimizer.copy_back", O.ComputeKind.ELEMENTWISE, n, 4 * n, self.dt * n,
                  buffers=("fp32", "params16"))

    def program(self):
        self._setup()
        self.order = {p.name: i for i, p in enumerate(self.params)}
        self.n_ar = 0
        self.live_grads: set[str] = set()
        self.ipg_live, self.ipg_index = False, 0
        self.ipg_touch = [0] * self.n_ipg
        self.ipg_alloc_at: list[int] = []
        self.grad_partition_live = False
        for micro in range(self.grad_accum):
            mb = f"mb{micro}." if self.grad_accum > 1 else ""
            self.uses = {p.name: 0 for p in self.params}
            for e in self.trace:
                if e.phase is Phase.BACKWARD and e.module.bwd:
                    for p in e.module.params:
                        self.uses[p.name] += 1
            self.bucket: list[ParamSpec] = []
            self.bucket_elems = 0
            for e in self.trace:
                self.b.phase = e.phase
                self._run(mb, e)
            self.acts.end_backward()
            last = micro == self.grad_accum - 1
            if self.stage == 2:
                if self.bucket:  # epilogue: the last bucket
                    self._reduce(self.bucket, f"{mb}bwd.ar{self._next()}")
                self.b.sync_stream(self.rs_stream, "end of backward: wait for gradient reduction")
                if self.ipg_live:
                    self._free_ipg()
            elif last:
                # stages 0 and 1 reduce at the accumulation boundary only, in parameter order
                size = STAGE0_BUFFER_ELEMS if self.stage == 0 else self.z.reduce_bucket_size
                self._bucketed(list(self.params), size, "step")
            if self.stage in (0, 1) and last:  # before that, gradients accumulate in place
                for p in self.params:
                    self.b.free(f"grad:{p.name}", COMPUTE, f"gradient {p.name}")
                self.live_grads.clear()
        self._optimizer()
        self._touch_ipg()
        return self.b.program()
