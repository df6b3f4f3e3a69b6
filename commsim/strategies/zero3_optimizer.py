"""DeepSpeed ZeRO-3's optimizer step and the partitioned state it works on.

Models deepspeed/runtime/zero/stage3.py ``DeepSpeedZeroOptimizer_Stage3`` (0.19.x, as
summarised in reference/deepspeed-zero3.md; 0.6.0 and 0.5.10 where the knobs and
dsversions.py say, ``s3`` lines from those releases):

* state, made at setup: per optimizer sub-group (``sub_group_size`` elements) the
  rank's 16-bit parameter partition, its reduced-gradient partition in the same dtype
  (``grad_partitions_flat_buffer``) and, unless offloaded to the host, the fp32 master
  copy and Adam's two moments;
* ``step``: every parameter released (the coordinator's ``release_and_reset_all``;
  0.5.10 did it at the end of backward); the overflow check (fp16 only from 0.19;
  every dtype in 0.5.10 and 0.6.0): over the partition (0.19.8), from 0.6.0's tracker,
  or per parameter with a host read each (0.5.10, ``fused_overflow_check`` off), then
  an all-reduce (MAX) read by the host; the gradient norm from per-parameter shards
  converted to fp64 (``get_grad_norm_direct``; with offload taken as the gradients left
  for the host), each read by the host without ``fused_grad_norm``, one all-reduce read
  by the host;
  per sub-group the gradients flattened into a fresh fp32 tensor
  (``_prepare_fp32_grad_for_sub_group``), unscale and clip, Adam, copy back to the
  16-bit partition, that tensor released (``_release_sub_group``); with offload CPU
  Adam on the host and a blocking copy of the partition back;
* after it (``_post_step``): the persistent parameters gathered synchronously and
  hpZ's secondary shards invalidated, both through the coordinator.
"""

from __future__ import annotations

from commsim.ir import ops as O
from commsim.ir.ops import Phase
from commsim.models.spec import ParamSpec
from commsim.strategies.builder import ProgramBuilder
from commsim.strategies.dsconfig import DeepSpeedConfig
from commsim.strategies.dsversions import CURRENT, DeepSpeedVersion
from commsim.strategies.knobs import HostCosts, Knobs
from commsim.strategies.optimizer import adam_step, fp64_norms
from commsim.strategies.zero3_layout import COMPUTE, Zero3Layout
from commsim.strategies.zero3_params import ParamCoordinator


def sub_groups(params: tuple[ParamSpec, ...], sub_group_size: int,
               part: dict[str, int] | None = None) -> list[list[ParamSpec]]:
    """Parameters split into optimizer sub-groups as _create_fp16_sub_groups does it
    (0.5.10 s3:1327-1351; 0.19.8 stage3.py:1210-1233): by the rank's partition sizes
    ``part`` (the full sizes without it), one group if they all fit, else each group
    closed by the parameter that brings it to ``sub_group_size`` or beyond."""
    size = (lambda p: part[p.name]) if part is not None else (lambda p: p.numel)
    if sub_group_size >= sum(size(p) for p in params):
        return [list(params)]
    groups: list[list[ParamSpec]] = []
    group: list[ParamSpec] = []
    total = 0
    for p in params:
        group.append(p)
        total += size(p)
        if total >= sub_group_size:
            groups.append(group)
            group, total = [], 0
    if group:
        groups.append(group)
    return groups


class Zero3OptimizerStep:
    """The rank's optimizer state and the step that updates it."""

    def __init__(self, b: ProgramBuilder, layout: Zero3Layout, ds: DeepSpeedConfig, knobs: Knobs, costs: HostCosts,
                 coordinator: ParamCoordinator, version: DeepSpeedVersion = CURRENT):
        self.b, self.layout, self.ds, self.knobs, self.costs, self.coord = b, layout, ds, knobs, costs, coordinator
        self.version = version
        self.sub_groups = sub_groups(layout.params, ds.zero.sub_group_size, dict(layout.part))
        # 0.5.10's reduce path makes the gradient partition per step (zero3_grads.py)
        self.partition_per_step = not knobs.preallocated_reduce_buffers and not layout.offload

    def sub_group_elems(self) -> tuple[int, ...]:
        return tuple(self._elems(params) for params in self.sub_groups)

    def _elems(self, params: list[ParamSpec]) -> int:
        return sum(self.layout.part[p.name] for p in params)

    def emit_setup(self) -> None:
        b, lay = self.b, self.layout
        for g, params in enumerate(self.sub_groups):
            n = self._elems(params)
            b.setup_alloc(f"flat16[{g}]", n * lay.dt, f"16-bit parameter partition, sub-group {g}")
            # the reduced gradients' partition (grad_partitions_flat_buffer), in the
            # parameters' dtype
            if not self.partition_per_step:
                b.setup_alloc(f"grad16[{g}]", n * lay.dt, f"16-bit gradient partition, sub-group {g}")
            if lay.offload:  # fp32 master, Adam state and fp32 gradients live in host memory
                continue
            # (the fp32 gradient is made per step: _prepare_fp32_grad_for_sub_group)
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                b.setup_alloc(f"{state}[{g}]", n * 4, f"fp32 {state} partition, sub-group {g}")

    def step(self) -> None:
        b, c, lay = self.b, self.costs, self.layout
        b.phase = Phase.OPTIMIZER
        if not self.version.release_all_after_backward:
            self.coord.release_all()
        # (the step's Python loops over parameters are short beside the launches of the
        # kernels they issue, which the schedule has one by one; not counted apart)
        if self.ds.precision == "fp16" or self.version.overflow_check_always:
            self._overflow_check()
        if not lay.offload:  # offloaded, the per-parameter norms were taken as the gradients left for the host
            # per parameter shard, in fp64; without the fused-norm fix the host reads
            # each norm before the next
            fp64_norms(b, COMPUTE, "optimizer.norm", [(p.name, lay.part[p.name]) for p in lay.params], "grad16[0]",
                       lay.dt, c.launch_ns, item_each=not self.knobs.fused_grad_norm)
        if not self.knobs.fused_grad_norm:
            # 0.5.10 s3:2452: torch.cuda.FloatTensor([total_norm]) from a Python float
            self._h2d_scalar("optimizer.norm_to_device", 4)
        b.reduce_to_host("optimizer.grad_norm_allreduce", 8, O.DType.FP64, lay.groups.world, O.ReduceOp.SUM,
                         c.collective_launch_ns, "global gradient norm")
        for g, params in enumerate(self.sub_groups):
            if lay.offload:
                self._cpu_adam(g, self._elems(params))
            else:
                self._device_adam(g, self._elems(params))
        self.coord.gather_persistent()
        self.coord.invalidate_secondary()

    def _h2d_scalar(self, label: str, size: int) -> None:
        """A tensor made on the device from a Python value (torch.cuda.ByteTensor([x]),
        torch.zeros(1).cuda()): a copy from pageable memory, which the host waits for."""
        b = self.b
        b.host("launch", O.HostKind.LAUNCH, self.costs.launch_ns)
        cp = b.copy(COMPUTE, label, O.CopyDirection.H2D, size)
        b.sync_ops((cp,), f"{label}: pageable host-to-device copy")

    def _overflow_check(self) -> None:
        b, c, lay = self.b, self.costs, self.layout
        total = sum(lay.part.values())
        grads = "grad16[0]"
        if not self.knobs.fused_overflow_check:
            # 0.5.10 has_overflow (s3:2859-2888): per parameter float(x.float().sum())
            # (s3:2892-2910), then with overlap_comm gpu_sum read and remade (s3:2861-2863)
            for p in lay.params:
                n = lay.part[p.name]
                tmp = f"optimizer.overflow.fp32[{p.name}]"
                b.alloc(tmp, n * 4, COMPUTE, f"fp32 copy of {p.name}'s gradient for the overflow check")
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                b.compute(COMPUTE, f"optimizer.overflow:{p.name}.to_fp32", O.ComputeKind.ELEMENTWISE, n, n * lay.dt,
                          n * 4, buffers=(grads, tmp))
                b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
                k = b.compute(COMPUTE, f"optimizer.overflow:{p.name}.sum", O.ComputeKind.ELEMENTWISE, n, n * 4, 4,
                              buffers=(tmp,))
                b.free(tmp, COMPUTE, f"fp32 copy of {p.name}'s gradient")
                cp = b.copy(COMPUTE, f"optimizer.overflow_item:{p.name}", O.CopyDirection.D2H, 4, deps=(k,))
                b.sync_ops((cp,), f"float() of {p.name}'s gradient sum")
            if self.ds.zero.overlap_comm:
                cp = b.copy(COMPUTE, "optimizer.gpu_sum_item", O.CopyDirection.D2H, 4)
                b.sync_ops((cp,), "float() of gpu_sum")
                self._h2d_scalar("optimizer.gpu_sum_reset", 4)
            self._h2d_scalar("optimizer.overflow_to_device", 1)
            b.reduce_to_host("optimizer.overflow_allreduce", 1, O.DType.UINT8, lay.groups.world, O.ReduceOp.MAX,
                             c.collective_launch_ns, "overflow .item()")
        elif self.version.overflow_tracker_per_gradient:
            # 0.6.0 has_overflow (s3:2727-2755): the tracker read under the reduce stream,
            # sent back as a ByteTensor, all-reduced (MAX) and read
            cp = b.copy(lay.rs_stream, "optimizer.inf_nan_tracker_item", O.CopyDirection.D2H, 1)
            b.sync_ops((cp,), "inf/nan tracker .item()")
            self._h2d_scalar("optimizer.overflow_to_device", 1)
            b.reduce_to_host("optimizer.overflow_allreduce", 1, O.DType.UINT8, lay.groups.world, O.ReduceOp.MAX,
                             c.collective_launch_ns, "overflow .item()")
        else:
            # 0.19.8 has_overflow (stage3.py:3009-3031): isinf / isnan over the partition
            k = b.compute(COMPUTE, "optimizer.overflow_check", O.ComputeKind.ELEMENTWISE, total, total * lay.dt, 4,
                          buffers=(grads,))
            b.reduce_to_host("optimizer.overflow_allreduce", 4, O.DType.FP32, lay.groups.world, O.ReduceOp.MAX, 0,
                             "overflow .item()", deps=(k,))

    def _cpu_adam(self, g: int, n: int) -> None:
        # CPU Adam on the host's fp32 partition (DeepSpeedCPUAdam, synchronous on the
        # host thread), then the 16-bit partition copied back to the device; copy_
        # without non_blocking, so the host waits for it
        # (stage3._optimizer_step, _reassign_or_swap_out_partitioned_parameters)
        b, c = self.b, self.costs
        b.host(f"cpu adam [{g}]", O.HostKind.OPTIMIZER, n * c.cpu_adam_ps_per_param // 1000)
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
        cp = b.copy(COMPUTE, f"optimizer.params_h2d[{g}]", O.CopyDirection.H2D, n * self.layout.dt,
                    buffers=(f"flat16[{g}]",))
        b.sync_ops((cp,), "copy of the updated partition to the device")

    def _device_adam(self, g: int, n: int) -> None:
        b, c, dt = self.b, self.costs, self.layout.dt
        # _prepare_fp32_grad_for_sub_group: the sub-group's gradients flattened into a
        # fresh tensor, then .to(fp32) (a second fresh tensor unless already fp32)
        grad32 = f"grad32[{g}]"
        b.alloc(grad32, n * 4, COMPUTE, f"flat fp32 gradient, sub-group {g} (per step)")
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
        if dt == 4:
            b.copy(COMPUTE, f"optimizer.flatten_grads[{g}]", O.CopyDirection.D2D, n * 4,
                   buffers=(f"grad16[{g}]", grad32))
        else:
            flat = f"gradflat16[{g}]"
            b.alloc(flat, n * dt, COMPUTE, f"flat 16-bit gradient, sub-group {g}")
            b.copy(COMPUTE, f"optimizer.flatten_grads[{g}]", O.CopyDirection.D2D, n * dt,
                   buffers=(f"grad16[{g}]", flat))
            b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
            b.compute(COMPUTE, f"optimizer.grads_to_fp32[{g}]", O.ComputeKind.ELEMENTWISE, n, n * dt, n * 4,
                      buffers=(flat, grad32))
            b.free(flat, COMPUTE, f"flat 16-bit gradient, sub-group {g}")
        if self.partition_per_step:
            # 0.5.10: the step's partition lives on in the gradient views until here
            b.free(f"grad16[{g}]", COMPUTE, f"16-bit gradient partition, sub-group {g}")
        bufs = (f"fp32[{g}]", f"exp_avg[{g}]", f"exp_avg_sq[{g}]", grad32)
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
        b.compute(COMPUTE, f"optimizer.unscale_clip[{g}]", O.ComputeKind.ELEMENTWISE, n, n * 4, n * 4,
                  buffers=(grad32,))
        adam_step(b, COMPUTE, f"optimizer.adam[{g}]", n, bufs, self.ds.optimizer_impl, c.launch_ns)
        b.host("launch", O.HostKind.LAUNCH, c.launch_ns)
        b.compute(COMPUTE, f"optimizer.copy_back[{g}]", O.ComputeKind.ELEMENTWISE, n, 4 * n, dt * n,
                  buffers=(f"fp32[{g}]", f"flat16[{g}]"))
        b.free(grad32, COMPUTE, f"fp32 gradient, sub-group {g} (_release_sub_group)")
